"""The plain tensors of one call are promoted by one node and their gradients reduced in one collective.

A layer's weight and bias (``linear``, ``conv``, ``layer_norm``) meet the
sharded activation in the same call: their gradients are pending sums of the
same kind, so one all-reduce over their concatenation gives both, with the
bytes of two. These tests check the count and bytes of that collective, and
that every gradient equals the one-process gradient, also where the tensors
of one call need different moves (a pending sum and a sharded gradient), one
tensor appears twice, one needs no gradient, or the pair is reused.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import count_collectives
from physicsnemo_dp.promotion import promote_together
from tests._harness import distributed

from ._util import integer_tensor, make_spec, shard_from_global


def _x(ctx, rows=9, cols=4):
    X = integer_tensor((rows, cols), seed=1)
    placements = (Shard(0),) * ctx.mesh.ndim  # rows over every mesh dim (nested on the 2-D mesh)
    return X, shard_from_global(X, make_spec(ctx.mesh, placements, X.shape))


def _params(*shapes, seed=2):
    """Parameters and their one-process twins."""
    values = [integer_tensor(s, seed=seed + k) for k, s in enumerate(shapes)]
    return [torch.nn.Parameter(v.clone()) for v in values], [torch.nn.Parameter(v.clone()) for v in values]


def _ring_bytes(ctx, *tensors) -> int:
    """Bytes one rank sends in a ring all-reduce of ``tensors`` over each mesh dim (as counted)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return sum(2 * (n - 1) * nbytes // n for n in ctx.mesh.shape)


def _backward(y):
    """Backward from ``y * y`` with a unit gradient in its own layout (no loss reduction, no other collective)."""
    z = y * y
    z.backward(torch.ones_like(z))


@distributed
def test_weight_and_bias_are_reduced_in_one_collective(ctx):
    X, x = _x(ctx)
    (w, b), (rw, rb) = _params((3, 4), (3,))
    for _ in range(2):  # the pair used twice in one forward: one node, one reduction
        y = F.linear(x, w, b) + F.linear(x * 2, w, b)
        with count_collectives() as bwd:
            _backward(y)
        _backward(F.linear(X, rw, rb) + F.linear(X * 2, rw, rb))
        for got, want in ((w.grad, rw.grad), (b.grad, rb.grad)):
            assert type(got) is torch.Tensor and torch.equal(got, want)
        with count_collectives() as alone:  # the weight without a bias: the collectives of one tensor
            _backward(F.linear(x, w))
        assert set(bwd.calls) == {"all_reduce"} and bwd.bytes_sent["all_reduce"] == _ring_bytes(ctx, w, b)
        if ctx.world_size > 1:  # (on one rank nothing is summed: each tensor's no-op call is left alone)
            assert bwd.calls == alone.calls, bwd.summary()
        for t in (w, b, rw, rb):
            t.grad = None


@distributed(world_sizes=(3,))
def test_tensors_of_one_call_with_different_gradient_layouts(ctx):
    """``addcmul(a, x, w)``: ``a``'s gradient is sharded (gathered), ``w``'s a pending sum (reduced)."""
    X, x = _x(ctx)
    (a, w), (ra, rw) = _params((9, 4), (4,))
    _backward(torch.addcmul(a, x, w))
    _backward(torch.addcmul(ra, X, rw))
    assert torch.equal(a.grad, ra.grad) and torch.equal(w.grad, rw.grad)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_a_tensor_twice_and_a_tensor_without_gradient(ctx):
    X, x = _x(ctx)
    (w,), (rw,) = _params((4,))
    frozen = integer_tensor((4,), seed=7)
    _backward(torch.addcmul(x, w, w))  # the same plain tensor twice in one call
    _backward(torch.addcmul(X, rw, rw))
    assert torch.equal(w.grad, rw.grad)
    w.grad, rw.grad = None, None
    with count_collectives() as bwd:
        _backward(torch.addcmul(x, w, frozen))  # only w tracks a gradient
    _backward(torch.addcmul(X, rw, frozen))
    assert torch.equal(w.grad, rw.grad) and frozen.grad is None
    assert bwd.bytes_sent.get("all_reduce", 0) == _ring_bytes(ctx, w)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_kept_together_while_unchanged(ctx):
    (w, b), _ = _params((3, 4), (3,))
    first = promote_together((w, b), ctx.mesh)
    assert first[0].grad_fn is first[1].grad_fn  # one node
    assert all(v is u for v, u in zip(promote_together((w, b), ctx.mesh), first))
    assert promote_together((b, w), ctx.mesh)[0] is not first[1]  # another call: its own node
    with torch.no_grad():
        b.add_(1)
    again = promote_together((w, b), ctx.mesh)
    assert again[0] is not first[0] and again[1] is not first[1]  # b changed: promoted afresh
    assert torch.equal(again[1].full_tensor(), b.detach())


@distributed(world_sizes=(1, 3, 4))
def test_dtypes_strided_scalar_parameters_and_an_empty_shard(ctx):
    """float32 and mixed-dtype pools, a transposed (non-contiguous) weight, a 0-dim weight, a rank with no rows."""
    rows = 2 if ctx.world_size >= 3 else 9  # on 3 and 4 ranks some rank holds no row
    X = integer_tensor((rows, 4), seed=1, dtype=torch.float32)
    spec = make_spec(ctx.mesh, (Shard(0),) * ctx.mesh.ndim, X.shape, dtype=torch.float32)
    x = shard_from_global(X, spec)
    W = integer_tensor((4, 3), seed=2, dtype=torch.float32)
    cases = {
        "float32, transposed weight": lambda: (torch.nn.Parameter(W.t()), torch.nn.Parameter(W[0, :3].clone())),
        "0-dim weight, float32 bias": lambda: (torch.nn.Parameter(torch.tensor(3.0)), torch.nn.Parameter(W[:, 0].clone())),
        "float64 weight, float32 bias": lambda: (torch.nn.Parameter(W.t().double()), torch.nn.Parameter(W[0, :3].clone())),
    }
    ops = {
        "float32, transposed weight": lambda x, w, b: F.linear(x, w, b),
        "0-dim weight, float32 bias": lambda x, w, b: torch.addcmul(b, x, w),
        "float64 weight, float32 bias": lambda x, w, b: F.linear(x.double(), w) + b,  # separate calls: no pool
    }
    for name, make in cases.items():
        w, b = make()
        rw, rb = (torch.nn.Parameter(t.detach().clone()) for t in (w, b))
        assert not w.is_contiguous() or w.ndim != 2
        _backward(ops[name](x, w, b))
        _backward(ops[name](X, rw, rb))
        for got, want in ((w.grad, rw.grad), (b.grad, rb.grad)):
            assert type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name
    # a pool of two dtypes in one call: each dtype reduced on its own, both exact
    w64, b32 = torch.nn.Parameter(W[:, 0].double()), torch.nn.Parameter(W[:, 1].clone())
    r64, r32 = (torch.nn.Parameter(t.detach().clone()) for t in (w64, b32))
    _backward(torch.addcmul(b32, x, w64))
    _backward(torch.addcmul(r32, X, r64))
    assert w64.grad.dtype == torch.float64 and torch.equal(w64.grad, r64.grad) and torch.equal(b32.grad, r32.grad)
