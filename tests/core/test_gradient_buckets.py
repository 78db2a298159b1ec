"""bucket_gradients: many layers' promoted gradients reduced by one node, equal to the one-process gradients.

Every test runs a model on sharded rows and the same model (a deep copy) on
the whole input in one process, and compares every parameter gradient, on
worlds 1-4 and the 2x2 mesh. Inputs and weights are small integers, so the
sums are exact in float64 and the comparisons are bitwise. Besides the
values: the number of all-reduces (one per bucket), buckets cut by size in
reverse order, parameters a forward leaves unused, a parameter used twice,
two forwards before one backward, gradient accumulation, a parameter changed
in place within the forward, no-grad forwards, activation checkpointing, and
the refused arguments.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Shard
from torch.utils.checkpoint import checkpoint

from physicsnemo_dp import bucket_gradients, count_collectives
from physicsnemo_dp.promotion import clear_gradient_buckets
from tests._harness import distributed

from ._util import integer_tensor, make_spec, shard_from_global


def _mlp(seed=3) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    return _integer_weights(net, seed)


def _integer_weights(module: nn.Module, seed: int, only=None) -> nn.Module:
    """Small integers / 4 in every parameter (of ``only``, default all): sums of products are exact in any order."""
    with torch.no_grad():
        for k, p in enumerate((only or module).parameters()):
            p.copy_(integer_tensor(tuple(p.shape), seed=seed + k).to(p.dtype) / 4)
    return module


def _x(ctx, rows=10, cols=4):
    X = integer_tensor((rows, cols), seed=1).double()
    placements = (Shard(0),) * ctx.mesh.ndim
    return X, shard_from_global(X, make_spec(ctx.mesh, placements, X.shape))


def _step(net, x, twice=False):
    y = net(x)
    if twice:
        y = y + net(x * 2)
    z = y * y
    z.backward(torch.ones_like(z))


def _assert_same_grads(net, ref):
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert type(p.grad) is torch.Tensor, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def _all_reduces(counter) -> int:
    return counter.calls.get("all_reduce", 0)


@contextlib.contextmanager
def _bucketed(ctx, build=None):
    """``(X, x, net, ref)``: the whole input and this rank's rows, a model (the MLP by default) in one
    bucket and its one-process twin."""
    X, x = _x(ctx)
    net = build() if build else _mlp()
    ref = copy.deepcopy(net)
    bucket_gradients(net, cap_mb=None)
    try:
        yield X, x, net, ref
    finally:
        clear_gradient_buckets()


@distributed
def test_one_bucket_reduces_every_layer_in_one_collective(ctx):
    X, x = _x(ctx)
    net, ref = _mlp(), _mlp()
    assert bucket_gradients(net, cap_mb=None) == 1
    from physicsnemo_dp.promotion import _BUCKETS

    bucket, nodes = _BUCKETS[id(net[0].weight)][1], []
    try:
        for _ in range(2):  # a second step: the bucket is promoted afresh after the first backward
            with count_collectives() as counted:
                y = net(x)
                nodes.append(bucket.views[id(net[0].weight)][1].grad_fn)
                z = y * y
                z.backward(torch.ones_like(z))
            assert bucket.views is None  # backward reached the node: never reused in another graph
            _step(ref, X)
            _assert_same_grads(net, ref)
            if ctx.world_size > 1:  # (on one rank nothing is summed: each gradient's no-op call is left alone)
                assert _all_reduces(counted) == ctx.mesh.ndim, counted.summary()
            net.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    finally:
        clear_gradient_buckets()
    assert nodes[0] is not nodes[1]
    with count_collectives() as without:  # back to one reduction per layer call
        _step(net, x)
    if ctx.world_size > 1:
        assert _all_reduces(without) == 4 * ctx.mesh.ndim  # three linears and the layer norm


@distributed(world_sizes=(1, 3))
def test_buckets_are_cut_by_size_in_reverse_order(ctx):
    X, x = _x(ctx)
    net, ref = _mlp(), _mlp()
    # parameters: 0.w 24, 0.b 6, 2.w 30, 2.b 5, 3.w 5, 3.b 5, 4.w 15, 4.b 3 values (float64); a cap of 36
    # values cuts from the end: [4.b 4.w 3.b 3.w 2.b] (33), [2.w 0.b] (36), [0.w] (24)
    try:
        assert bucket_gradients(net, cap_mb=36 * 8 / 2**20) == 3
        from physicsnemo_dp.promotion import _BUCKETS

        ids = [id(_BUCKETS[id(p)][1]) for p in net.parameters()]
        assert ids[3] == ids[4] == ids[5] == ids[6] == ids[7] and ids[1] == ids[2] and len(set(ids)) == 3
        with count_collectives() as counted:
            _step(net, x)
        _step(ref, X)
        _assert_same_grads(net, ref)
        if ctx.world_size > 1:
            assert _all_reduces(counted) == 3 * ctx.mesh.ndim  # one per bucket and mesh dim
    finally:
        clear_gradient_buckets()


class _Branches(nn.Module):
    """Two heads on a shared trunk; ``forward(x, which)`` uses one head: the other's parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(4, 4).double(), nn.Linear(4, 2).double(), nn.Linear(4, 3).double()
        _integer_weights(self, seed=20)

    def forward(self, x, which="a"):
        h = torch.tanh(self.trunk(x))
        h = self.trunk(h)  # the trunk twice: its views are used twice, autograd sums their gradients
        return (self.a if which == "a" else self.b)(h)


@distributed
def test_unused_and_reused_parameters(ctx):
    with _bucketed(ctx, _Branches) as (X, x, net, ref):
        _step(lambda t: net(t, "a"), x)
        _step(lambda t: ref(t, "a"), X)
        assert net.b.weight.grad is None and net.b.bias.grad is None
        for p, q in zip(net.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@distributed(world_sizes=(2, 3))
def test_two_forwards_before_one_backward_and_accumulation(ctx):
    with _bucketed(ctx) as (X, x, net, ref):
        with count_collectives() as counted:
            _step(net, x, twice=True)  # one bucket node for both forwards
        _step(ref, X, twice=True)
        assert _all_reduces(counted) == ctx.mesh.ndim
        _step(net, x * 3)  # accumulation into .grad over a second backward
        _step(ref, X * 3)
        _assert_same_grads(net, ref)


@distributed(world_sizes=(3,), mesh_2d=False)
def test_a_parameter_changed_in_place_within_the_forward(ctx):
    """The changed parameter gets a new bucket node; both nodes reduce what reached them."""
    with _bucketed(ctx) as (X, x, net, ref):

        def run(model, inp):
            y = model[0](inp)
            with torch.no_grad():
                model[2].weight.mul_(2)  # between two layers' uses: the next use sees the new values
            return model[1:](y)

        y, r = run(net, x), run(ref, X)
        (y * y).backward(torch.ones_like(y))
        (r * r).backward(torch.ones_like(r))
        _assert_same_grads(net, ref)


@distributed(world_sizes=(1, 3))
def test_no_grad_forwards_and_checkpointed_layers(ctx):
    with _bucketed(ctx) as (X, x, net, ref):
        with torch.no_grad():
            torch.testing.assert_close(net(x).full_tensor(), ref(X), rtol=1e-12, atol=1e-12)  # tanh, layer norm: ulps
        y = checkpoint(net[:3], x, use_reentrant=False)
        y = net[3:](y)
        r = ref[3:](checkpoint(ref[:3], X, use_reentrant=False))
        (y * y).backward(torch.ones_like(y))
        (r * r).backward(torch.ones_like(r))
        _assert_same_grads(net, ref)


class _Mixed(nn.Module):
    """A float64 linear, a 0-dim float64 scale, a float32 vector and a weight used through a view (``w.t()``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).double()
        self.scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
        self.w32 = nn.Parameter(integer_tensor((3,), seed=31, dtype=torch.float32) / 4)
        self.wt = nn.Parameter(integer_tensor((4, 3), seed=32) / 4)  # used as wt.t(): a view meets the data
        _integer_weights(self, seed=40, only=self.lin)

    def forward(self, x):
        h = self.lin(x) * self.scale + self.w32
        return h @ self.wt.t() + x


@distributed
def test_dtypes_a_scalar_parameter_and_a_parameter_used_through_a_view(ctx):
    """float64 and float32 gradients pool apart; the view's weight is promoted per call; all exact."""
    with _bucketed(ctx, _Mixed) as (X, x, net, ref):
        _step(net, x)
        _step(ref, X)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert p.grad.dtype == q.grad.dtype and p.grad.shape == q.grad.shape, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6 if p.dtype == torch.float32 else 1e-12,
                                       atol=1e-6 if p.dtype == torch.float32 else 1e-12, msg=name)


def test_refused_arguments():
    w = nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="plain leaf tensors.*not a leaf"):
        bucket_gradients([w * 2])
    with pytest.raises(TypeError, match="got int"):
        bucket_gradients([w, 3])
    with pytest.raises(ValueError, match="cap_mb must be positive"):
        bucket_gradients([w], cap_mb=0)
    clear_gradient_buckets()


def test_plain_tensors_are_untouched_by_buckets():
    """Without a mesh nothing is promoted: bucketing a model changes nothing on plain tensors."""
    net = _mlp()
    bucket_gradients(net)
    try:
        x = integer_tensor((5, 4), seed=9).double()
        torch.testing.assert_close(net(x), _mlp()(x), rtol=0, atol=0)
        assert F.linear(x, net[0].weight).shape == (5, 6)
    finally:
        clear_gradient_buckets()
