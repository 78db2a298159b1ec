"""Losses on ShardTensors against one process: forward, gradients of input, target and weights.

Each test is one job per world size that loops over its cases (a job per case
cost several times as much in harness round trips and pool waits): every loss,
each reduction, input and target in the same layout, in different layouts, and
the target a plain tensor; uneven shards with an empty one (3 ranks), the 2x2
mesh. Bad data on one rank raises the same error on every rank.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (6, 4, 5)
REDUCTIONS = ("none", "sum", "mean")


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _u(shape=SHAPE, seed=0):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.9 + 0.05


def _pairs(mesh, ndim):
    """(input placements, target placements or None): same layout, a different one, a plain target."""
    options = layouts(mesh, ndim)
    pairs = [(p, p) for p in options] + [(p, options[(i + 1) % len(options)]) for i, p in enumerate(options)]
    return pairs + [(options[0], None)]


def _cases(mesh, ndim):
    """Every pair once, with the reductions taking turns; every reduction on the first pair."""
    pairs = _pairs(mesh, ndim)
    yield from ((pairs[0][0], pairs[0][1], r) for r in REDUCTIONS)
    yield from ((pi, pt, REDUCTIONS[i % 3]) for i, (pi, pt) in enumerate(pairs[1:]))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_elementwise_losses(ctx):
    bce_w = _u((5,), seed=7)  # captured: torch's BCE weights carry no gradient
    logit_w, pos_w = _u((4, 1), seed=8), _u((5,), seed=9) * 3
    losses = {
        "mse": (lambda x, t, r: F.mse_loss(x, t, reduction=r), _g),
        "l1": (lambda x, t, r: F.l1_loss(x, t, reduction=r), _g),
        "huber": (lambda x, t, r: F.huber_loss(x, t, reduction=r, delta=0.7), _g),
        "smooth_l1": (lambda x, t, r: F.smooth_l1_loss(x, t, reduction=r, beta=0.5), _g),
        "smooth_l1 beta=0": (lambda x, t, r: F.smooth_l1_loss(x, t, reduction=r, beta=0.0), _g),
        "bce": (lambda x, t, r: F.binary_cross_entropy(x, t, reduction=r), None),
        "bce weight": (lambda x, t, r: F.binary_cross_entropy(x, t, weight=bce_w, reduction=r), None),
        "bce logits": (lambda x, t, r: F.binary_cross_entropy_with_logits(x, t, reduction=r), _u),
        "bce logits weights": (
            lambda x, t, r: F.binary_cross_entropy_with_logits(x, t, weight=logit_w, pos_weight=pos_w, reduction=r),
            _u,
        ),
        "MSELoss module": (lambda x, t, r: torch.nn.MSELoss(reduction=r)(x, t), _g),
    }
    for name, (fn, data) in losses.items():
        for pi, pt, r in _cases(ctx.mesh, 3):
            x = _g(seed=1) if data is not None else _u(seed=1)  # None: probabilities in and out
            t = (data or _u)(seed=2)
            check(lambda x, t: fn(x, t, r), [(x, pi), (t, pt)], ctx.mesh, label=f"{name} {r}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_weighted_and_broadcast_losses(ctx):
    for pi, pt, r in _cases(ctx.mesh, 3):
        for name, fn in (
            ("mse", lambda x, t, w: F.mse_loss(x, t, reduction=r, weight=w)),
            ("l1", lambda x, t, w: F.l1_loss(x, t, reduction=r, weight=w)),  # torch does not hand handlers l1's weight
            ("huber", lambda x, t, w: F.huber_loss(x, t, reduction=r, weight=w, delta=0.5)),
        ):
            check(fn, [(_g(seed=1), pi), (_g(seed=2), pt), (_u(seed=3), None)], ctx.mesh, label=f"{name} weight {r}")
            check(fn, [(_g(seed=1), pi), (_g(seed=2), None), (_u(seed=3), pt)], ctx.mesh, label=f"{name} weight {r}")
        # a target that broadcasts (torch warns once, on the global shapes), and broadcast logits weights with grads
        check(
            lambda x, t: F.mse_loss(x, t, reduction=r),
            [(_g(seed=1), pi), (_g((4, 1), seed=2), None)],
            ctx.mesh,
            label=f"mse broadcast {r}",
        )
        # the broadcast target's gradient: summed over the ranks' boxes


def _classes(shape, n_classes, seed, ignore=()):
    t = torch.randint(0, n_classes, shape, generator=torch.Generator().manual_seed(seed))
    for index in ignore:
        t[index] = -100
    return t


def _target_layout(placements, ndim):
    """The input's placements with the class dim (1) removed; a sharded class dim becomes Replicate."""
    if placements is None:
        return None
    return tuple(
        Shard(p.dim - (p.dim > 1)) if p.is_shard() and p.dim != 1 else (Replicate() if p.is_shard() else p)
        for p in placements
    )


@distributed(world_sizes=OP_WORLD_SIZES)
def test_nll_and_cross_entropy(ctx):
    n, c, s = SHAPE
    weight = _u((c,), seed=5)
    index_target = _classes((n, s), c, seed=6, ignore=[(0, 1), (4, 3), (5, 0)])
    probs = torch.softmax(_g(seed=7), 1)
    calls = {
        "nll": lambda x, t, r: F.nll_loss(torch.log_softmax(x, 1), t, reduction=r),
        "nll weight": lambda x, t, r: F.nll_loss(x, t, weight=weight, reduction=r),
        "ce": lambda x, t, r: F.cross_entropy(x, t, reduction=r),
        "ce weight ignore smoothing": lambda x, t, r: F.cross_entropy(
            x, t, weight=weight, label_smoothing=0.2, reduction=r
        ),
        "nll ignore_index=2": lambda x, t, r: F.nll_loss(x, t.clamp(min=0), ignore_index=2, reduction=r),
        "CrossEntropyLoss module": lambda x, t, r: torch.nn.CrossEntropyLoss(weight=weight, reduction=r)(x, t),
    }
    for pi, pt, r in _cases(ctx.mesh, 3):  # the class dim sharded too: moved to another dim first
        pt = _target_layout(pi, 3) if pt is not None else None
        for name, fn in calls.items():
            check(lambda x, t: fn(x, t, r), [(_g(seed=1), pi), (index_target, pt)], ctx.mesh, label=f"{name} {r}")
        # probabilities as target: their gradient and the class weights' too
        check(
            lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction=r),
            [(_g(seed=1), pi), (probs, pi), (weight, None)],
            ctx.mesh,
            label=f"ce probabilities {r}",
        )
    for r in REDUCTIONS:  # (N, C) with the batch or the class dim sharded; (C,) with a 0-dim target
        for pi in layouts(ctx.mesh, 2):
            t2 = _classes((n,), c, seed=8, ignore=[2])
            check(
                lambda x, t: F.cross_entropy(x, t, weight=weight, reduction=r, label_smoothing=0.1),
                [(_g((n, c), seed=1), pi), (t2, None)],
                ctx.mesh,
                label=f"ce 2-d {r}",
            )
        for pi in layouts(ctx.mesh, 1):
            check(
                lambda x: F.cross_entropy(x, torch.tensor(3), reduction=r),
                [(_g((c + 2,), seed=1), pi)],
                ctx.mesh,
                label=f"ce 1-d {r}",
            )
    # a pending sum as input (resolved first)
    partial = (Partial(),) * ctx.mesh.ndim
    check(F.cross_entropy, [(_g(seed=1), partial), (index_target, None)], ctx.mesh, label="ce partial input")
    check(F.mse_loss, [(_g(seed=1), partial), (_g(seed=2), None)], ctx.mesh, label="mse partial input")
    # everything ignored: a mean of nothing is NaN, as in one process
    check(
        lambda x, t: F.cross_entropy(x, t),
        [(_g(seed=1), layouts(ctx.mesh, 3)[0]), (torch.full((n, s), -100), None)],
        ctx.mesh,
        label="all ignored",
    )


@distributed(world_sizes=OP_WORLD_SIZES)
def test_bad_data_raises_on_every_rank(ctx):
    """A bad value on one rank's shard only: the same error everywhere, no hang; the ranks go on in step."""
    n, c, s = SHAPE
    placements = (Shard(0),) * ctx.mesh.ndim
    x = shard_from_global(_g(seed=1), make_spec(ctx.mesh, placements, SHAPE), requires_grad=True)
    for bad in (c, -3):
        target = _classes((n, s), c, seed=2)
        target[n - 1, s - 1] = bad  # the last rank's shard
        t = shard_from_global(target, make_spec(ctx.mesh, placements, (n, s), dtype=torch.int64))
        for fn in (F.cross_entropy, F.nll_loss):
            with pytest.raises(IndexError, match=r"1 target value\(s\) out of bounds.*0 <= target < 4"):
                fn(x, t)
    u = _u(seed=3)
    u[0, 0, 0] = 1.5  # the first rank's shard
    p = shard_from_global(u, make_spec(ctx.mesh, placements, SHAPE))
    with pytest.raises(RuntimeError, match="all elements of input should be between 0 and 1"):
        F.binary_cross_entropy(p, shard_from_global(_u(seed=4), make_spec(ctx.mesh, placements, SHAPE)))
    with pytest.raises(RuntimeError, match="all elements of target should be between 0 and 1"):
        F.binary_cross_entropy(shard_from_global(_u(seed=4), make_spec(ctx.mesh, placements, SHAPE)), p)
    # torch's own argument errors, from the global shapes
    with pytest.raises(RuntimeError, match="Expected target size"):
        F.cross_entropy(
            x,
            shard_from_global(
                torch.zeros(n, s + 1, dtype=torch.int64), make_spec(ctx.mesh, placements, (n, s + 1), dtype=torch.int64)
            ),
        )
    with pytest.raises(ValueError, match="Weights and input must have the same size"):
        F.mse_loss(x, x.detach(), weight=torch.ones(n))
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        F.mse_loss(x, x.detach(), reduction="average")
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        F.nll_loss(x, t.clamp(0, c - 1), weight=torch.ones(c, dtype=torch.float64, requires_grad=True))
    loss = F.cross_entropy(
        x, shard_from_global(_classes((n, s), c, seed=2), make_spec(ctx.mesh, placements, (n, s), dtype=torch.int64))
    )
    loss.backward()  # the ranks are still in step
    assert x.grad is not None


@distributed(world_sizes=OP_WORLD_SIZES)
def test_loss_collectives(ctx):
    """A mean loss on aligned shards: one all-reduce of the sum (and for class indices the count check)."""
    if ctx.world_size == 1:
        return
    n, c, s = SHAPE
    placements = (Shard(0),) * ctx.mesh.ndim
    x = shard_from_global(_g(seed=1), make_spec(ctx.mesh, placements, SHAPE))
    y = shard_from_global(_g(seed=2), make_spec(ctx.mesh, placements, SHAPE))
    t = shard_from_global(_classes((n, s), c, seed=2), make_spec(ctx.mesh, placements, (n, s), dtype=torch.int64))
    with count_collectives() as counter:
        F.mse_loss(x, y).item()
    assert dict(counter.calls) == {"all_reduce": ctx.mesh.ndim}, counter.calls  # (counted on one rank too)
    for reduction in ("sum", "mean"):  # the index check, then the sum (mean: the loss and weight sums together)
        with count_collectives() as counter:
            F.cross_entropy(x, t, reduction=reduction).item()
        assert dict(counter.calls) == {"all_reduce": 2 * ctx.mesh.ndim}, (reduction, counter.calls)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_backward_of_a_scalar_loss_makes_its_gradient_without_torchs_checks(ctx):
    """``loss.backward()`` / ``torch.autograd.backward(loss)`` on a real scalar ShardTensor: the implicit
    gradient (ones, pending sums resolved) is built without ``torch.autograd._make_grads`` (six calls through
    ``__torch_function__``); gradients are the one-process ones. Anything else keeps torch's checks."""
    make_grads = torch.autograd._make_grads

    def refuse(*args, **kwargs):
        raise AssertionError("_make_grads called for an implicit scalar gradient")

    ref = _g().requires_grad_(True)
    ref.square().mean().backward()
    for placements in layouts(ctx.mesh, 3, partial=True):
        torch.autograd._make_grads = refuse
        try:
            x = shard_from_global(_g(), make_spec(ctx.mesh, placements, SHAPE), requires_grad=True)
            x.square().mean().backward()
            torch.testing.assert_close(x.grad.full_tensor(), ref.grad.to(x.grad.device))
            x = shard_from_global(_g(), make_spec(ctx.mesh, placements, SHAPE), requires_grad=True)
            torch.autograd.backward((x * 3).sum())  # the entry itself (a Partial loss stays Partial here)
            assert torch.equal(x.grad.full_tensor(), torch.full(SHAPE, 3.0, dtype=torch.float64))
        finally:
            torch.autograd._make_grads = make_grads
        x = shard_from_global(_g(), make_spec(ctx.mesh, placements, SHAPE), requires_grad=True)
        with pytest.raises(RuntimeError, match="only for scalar outputs"):  # torch's own check and message
            torch.autograd.backward(x * 2)
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.backward(x.detach().sum())
