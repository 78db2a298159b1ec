"""Reductions on uneven shards (empty shards included): forward, backward and communication.

Every case is a differential check against the same call on the full tensor,
over sharded and unsharded dims, ``dim=None``, ``keepdim``, tuples and
negative dims, on every layout of ``layouts`` (nested sharding on the 2x2 mesh).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import integer_tensor, make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 5, 3)
aten = torch.ops.aten


def _g(shape=SHAPE, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _with_nans(seed=0):
    g = _g(seed=seed)
    g[g > 1.0] = float("nan")
    return g


def _near_one(seed=0):
    """Values around 1 (products stay moderate), with a zero in some slices and two in others."""
    g = 1 + 0.3 * _g(seed=seed)
    g[1, 2, 0] = g[4, 2, 0] = g[3, 0, 1] = g[5, 4, 2] = 0.0
    return g


def _check_all(cases, mesh, data, dims_layouts=None):
    for name, fn in cases:
        for g in data:
            for placements in layouts(mesh, g.ndim) if dims_layouts is None else dims_layouts:
                check(fn, [(g, placements)], mesh, label=name)


SUMS = [
    ("sum()", lambda x: x.sum()),
    ("sum(0)", lambda x: x.sum(0)),
    ("sum(1)", lambda x: torch.sum(x, 1)),
    ("sum(-1)", lambda x: x.sum(dim=-1)),
    ("sum((0,2))", lambda x: x.sum((0, 2))),
    ("sum((0,1,2))", lambda x: x.sum([0, 1, 2])),
    ("sum(0,keepdim)", lambda x: x.sum(0, keepdim=True)),
    ("sum((1,-1),keepdim)", lambda x: torch.sum(x, (1, -1), True)),
    ("mean()", lambda x: x.mean()),
    ("mean(0)", lambda x: torch.mean(x, 0)),
    ("mean((0,1))", lambda x: x.mean((0, 1))),
    ("mean(-1,keepdim)", lambda x: x.mean(-1, keepdim=True)),
    ("mean((0,2),keepdim)", lambda x: torch.mean(x, dim=(0, 2), keepdim=True)),
    ("mean(None,keepdim)", lambda x: torch.mean(x, None, True)),
    ("sum then op", lambda x: (x.sum(0) * 2 + 1).tanh()),
    ("mean then op", lambda x: torch.exp(x.mean((0, 1)))),
]

NAN_SUMS = [
    ("nansum()", lambda x: x.nansum()),
    ("nansum(0)", lambda x: torch.nansum(x, 0)),
    ("nansum((1,2),keepdim)", lambda x: x.nansum((1, 2), keepdim=True)),
    ("nanmean(0)", lambda x: x.nanmean(0)),
    ("nanmean()", lambda x: torch.nanmean(x)),
    ("nanmean((0,-1),keepdim)", lambda x: x.nanmean((0, -1), keepdim=True)),
]

EXTREMES = [
    ("max()", lambda x: x.max()),
    ("min()", lambda x: torch.min(x)),
    ("max(0)", lambda x: x.max(0)),
    ("max(1,keepdim)", lambda x: torch.max(x, 1, keepdim=True)),
    ("min(-1)", lambda x: x.min(dim=-1)),
    ("min(0).values", lambda x: x.min(0).values * 3),
    ("amax(0)", lambda x: x.amax(0)),
    ("amax((0,1))", lambda x: torch.amax(x, (0, 1))),
    ("amax()", lambda x: x.amax()),
    ("amax(-1,keepdim)", lambda x: x.amax(-1, keepdim=True)),
    ("amin((1,2),keepdim)", lambda x: x.amin((1, 2), keepdim=True)),
    ("amin(0)", lambda x: torch.amin(x, 0)),
    ("argmax()", lambda x: x.argmax()),
    ("argmax(0)", lambda x: torch.argmax(x, 0)),
    ("argmax(keepdim)", lambda x: x.argmax(keepdim=True)),
    ("argmin(1,keepdim)", lambda x: x.argmin(1, keepdim=True)),
    ("argmin()", lambda x: torch.argmin(x)),
    ("argmin(-1)", lambda x: x.argmin(-1)),
]

PRODS = [
    ("prod()", lambda x: x.prod()),
    ("prod(0)", lambda x: torch.prod(x, 0)),
    ("prod(1,keepdim)", lambda x: x.prod(1, keepdim=True)),
    ("prod(-1)", lambda x: x.prod(-1)),
]

NORMS = [
    ("norm()", lambda x: x.norm()),
    ("norm(dim=0)", lambda x: torch.norm(x, dim=0)),
    ("norm(1,(0,2))", lambda x: x.norm(1, dim=(0, 2))),
    ("vnorm(inf,0)", lambda x: torch.linalg.vector_norm(x, float("inf"), dim=0)),
    ("vnorm(-inf,(0,1),keepdim)", lambda x: torch.linalg.vector_norm(x, float("-inf"), dim=(0, 1), keepdim=True)),
    ("vnorm(0)", lambda x: torch.linalg.vector_norm(x, 0)),
    ("vnorm(0.5,1)", lambda x: torch.linalg.vector_norm(x, 0.5, dim=1)),
    ("vnorm(3,-1,keepdim)", lambda x: torch.linalg.vector_norm(x, 3, dim=-1, keepdim=True)),
    ("vnorm(-1,0)", lambda x: torch.linalg.vector_norm(x, -1, dim=0)),
    ("vnorm(inf)", lambda x: torch.linalg.vector_norm(x, float("inf"))),
    ("normalize(dim=0)", lambda x: F.normalize(x, dim=0)),
]

MOMENTS = [
    ("var()", lambda x: x.var()),
    ("var(0)", lambda x: torch.var(x, 0)),
    ("var((0,2),correction=0)", lambda x: x.var((0, 2), correction=0)),
    ("var(1,unbiased=False,keepdim)", lambda x: x.var(1, unbiased=False, keepdim=True)),
    ("var(False)", lambda x: torch.var(x, False)),
    ("std()", lambda x: x.std()),
    ("std(0)", lambda x: x.std(0)),
    ("std(-1,correction=2)", lambda x: torch.std(x, -1, correction=2)),
    ("std((0,1),keepdim)", lambda x: x.std((0, 1), keepdim=True)),
    ("var_mean(0)", lambda x: torch.var_mean(x, 0)),
    ("var_mean()", lambda x: torch.var_mean(x)),
    ("std_mean((0,1),keepdim)", lambda x: torch.std_mean(x, (0, 1), keepdim=True)),
    ("std_mean(-1,correction=0)", lambda x: torch.std_mean(x, -1, correction=0)),
    ("logsumexp(0)", lambda x: x.logsumexp(0)),
    ("logsumexp((0,1))", lambda x: torch.logsumexp(x, (0, 1))),
    ("logsumexp(-1,keepdim)", lambda x: x.logsumexp(-1, keepdim=True)),
]

LOGICAL = [
    ("any(0)", lambda x: (x > 0.5).any(0)),
    ("any()", lambda x: (x > 2.0).any()),
    ("any((0,2))", lambda x: torch.any(x > 1.5, dim=(0, 2))),
    ("all(1,keepdim)", lambda x: (x > -1.5).all(1, keepdim=True)),
    ("all()", lambda x: (x > -3).all()),
    ("all(-1)", lambda x: torch.all(x < 1, -1)),
    ("count_nonzero()", lambda x: torch.count_nonzero(x.round())),
    ("count_nonzero(0)", lambda x: torch.count_nonzero(x.round(), 0)),
    ("count_nonzero((0,1))", lambda x: x.round().count_nonzero((0, 1))),
]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_sum_and_mean(ctx):
    _check_all(SUMS, ctx.mesh, [_g()])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_nansum_and_nanmean(ctx):
    _check_all(NAN_SUMS, ctx.mesh, [_with_nans()])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_max_min_and_arg_reductions(ctx):
    # random data, then small integers: many ties, where the lowest global index must win
    _check_all(EXTREMES, ctx.mesh, [_g(), integer_tensor(SHAPE, 3)])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_prod_with_and_without_zeros(ctx):
    _check_all(PRODS, ctx.mesh, [_near_one(), 1 + 0.3 * _g(seed=4)])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_norms(ctx):
    _check_all(NORMS, ctx.mesh, [_g()])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_var_std_and_logsumexp(ctx):
    _check_all(MOMENTS, ctx.mesh, [_g() * 3 + 100])  # a large mean: a one-pass formula would lose digits


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_logical_and_counting(ctx):
    _check_all(LOGICAL, ctx.mesh, [_g()])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_partial_inputs(ctx):
    """Pending sums stay pending through sum/mean; every other reduction resolves them first."""
    mesh = ctx.mesh
    partial_layouts = [p for p in layouts(mesh, 3, partial=True) if any(isinstance(q, Partial) for q in p)]
    cases = [c for c in SUMS + EXTREMES + MOMENTS + PRODS[:2] + NORMS[:3] if "normalize" not in c[0]]
    for name, fn in cases:
        for placements in partial_layouts:
            check(fn, [(_near_one() if name.startswith("prod") else _g(), placements)], mesh, label=name)
    G = integer_tensor(SHAPE, 5)
    for placements in partial_layouts:
        x = shard_from_global(G, make_spec(mesh, placements, SHAPE))
        with count_collectives() as counter:
            y = x.sum((0, 1))
            z = x.mean(-1)
        assert counter.total_calls == 0
        for out, dims in ((y, (0, 1)), (z, (2,))):
            pending = [isinstance(p, Partial) or (p.is_shard() and p.dim in dims and mesh.size(m) > 1)
                       for m, p in enumerate(placements)]
            assert [isinstance(p, Partial) for p in out.placements] == pending


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_float32(ctx):
    cases = [
        ("sum(0)", lambda x: x.sum(0)),
        ("sum(dtype=float64)", lambda x: x.sum((0, 1), dtype=torch.float64)),
        ("mean(1)", lambda x: x.mean(1)),
        ("max(0)", lambda x: x.max(0)),
        ("argmin()", lambda x: x.argmin()),
        ("var(0)", lambda x: x.var(0)),
        ("std()", lambda x: x.std()),
        ("norm(dim=1)", lambda x: x.norm(dim=1)),
        ("logsumexp(0)", lambda x: x.logsumexp(0)),
        ("prod(0)", lambda x: x.prod(0)),
    ]
    _check_all(cases, ctx.mesh, [_g(dtype=torch.float32)])


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_aten_level_backward_formulas(ctx):
    """Reductions reached below the function handlers use ATen's derivatives on the rules."""
    cases = [
        ("aten.sum", lambda x: aten.sum.dim_IntList(x, [0], True)),
        ("aten.sum()", lambda x: aten.sum.default(x)),
        ("aten.mean", lambda x: aten.mean.dim(x, [1, 2])),
        ("aten.max.default", lambda x: aten.max.default(x)),
        ("aten.max.dim keepdim", lambda x: aten.max.dim(x, 0, True)[0]),
        ("aten.prod.dim_int", lambda x: aten.prod.dim_int(x, 1)),
        ("aten.norm.ScalarOpt_dim", lambda x: aten.norm.ScalarOpt_dim(x, 3, [0, 2])),
        ("aten.nansum", lambda x: aten.nansum.default(x, [0])),
        ("aten.var_mean", lambda x: aten.var_mean.correction(x, [0], correction=1)),
    ]
    _check_all(cases, ctx.mesh, [_near_one()])


@distributed(world_sizes=OP_WORLD_SIZES)
def test_sum_mean_grads_stay_in_layout_without_communication(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3):
        spec = make_spec(mesh, placements, SHAPE)
        for name, fn in (("sum", lambda x: x.sum()), ("mean(0)", lambda x: x.mean(0)),
                         ("sum((0,2),keepdim)", lambda x: torch.sum(x, (0, 2), keepdim=True)),
                         ("nansum(1)", lambda x: x.nansum(1))):
            x = shard_from_global(_g(), spec, requires_grad=True)
            with count_collectives() as forward:
                y = fn(x)
            assert forward.total_calls == 0, (name, placements, forward.summary())
            sharded = {m for m, p in enumerate(placements) if p.is_shard() and mesh.size(m) > 1}
            assert {m for m, p in enumerate(y.placements) if p.is_partial()} <= sharded
            gspec = y._spec.with_layout([Replicate() if p.is_partial() else p for p in y.placements], y._spec.dim_sizes)
            with count_collectives() as backward:  # (y.backward() would first resolve y's pending sum)
                torch.autograd.backward(y, shard_from_global(torch.ones(y.shape, dtype=y.dtype), gspec))
            assert backward.total_calls == 0, (name, placements, backward.summary())
            assert x.grad._spec == x._spec, (name, placements)
            assert tuple(x.grad._local_tensor.shape) == tuple(spec.local_shape)
            assert x.grad._local_tensor.is_contiguous()


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_communication_is_reduced_size_only(ctx):
    """Forward and backward move only reduced-size tensors, in the number of collectives documented."""
    mesh, P = ctx.mesh, ctx.world_size
    spec = make_spec(mesh, [Shard(0)], SHAPE)
    reduced = SHAPE[1] * SHAPE[2] * 8  # bytes of one float64 result over dim 0
    gather, ring = (P - 1) * reduced, 2 * reduced  # most a rank receives per all-gather / all-reduce
    expected = {  # op -> (fn, forward calls, forward bytes, backward calls, backward bytes)
        "sum": (lambda t: t.sum(0), 0, 0, 0, 0),
        "mean": (lambda t: t.mean(0), 0, 0, 0, 0),
        "amax": (lambda t: t.amax(0), 1, gather, 1, ring),
        "norm": (lambda t: t.norm(dim=0), 1, gather, 0, 0),
        "logsumexp": (lambda t: t.logsumexp(0), 1, gather, 0, 0),
        "max(dim)": (lambda t: t.max(0).values, 2, 2 * gather, 0, 0),
        "argmax": (lambda t: t.argmax(0), 2, 2 * gather, None, None),  # not differentiable
        "var": (lambda t: t.var(0), 2, 2 * ring, 1, ring),
        "std_mean": (lambda t: torch.std_mean(t, 0), 2, 2 * ring, 1, ring),
        "prod": (lambda t: t.prod(0), 1, gather, 2, gather + ring),
        # backward: ATen's ``result == self`` broadcasts a kept-dims tensor sharded like ``self``;
        # the elementwise rule may gather that reduced-size operand, never the data
        "amax over unsharded dims": (lambda t: t.amax((1, 2)), 0, 0, None, 2 * (P - 1) * SHAPE[0] * 8),
    }
    for name, (fn, calls, volume, back_calls, back_volume) in expected.items():
        x = shard_from_global(_g(), spec, requires_grad=True)
        with count_collectives() as forward:
            y = fn(x)
        assert forward.total_calls == calls, (name, forward.summary())
        assert forward.total_received <= volume, (name, forward.summary())
        if back_volume is None:
            continue
        outs = list(y) if isinstance(y, tuple) else [y]
        grads = [shard_from_global(torch.ones(o.shape, dtype=o.dtype), o._spec.with_layout(
            [Replicate() if p.is_partial() else p for p in o.placements], o._spec.dim_sizes)) for o in outs]
        with count_collectives() as backward:
            torch.autograd.backward(outs, grads)
        assert back_calls is None or backward.total_calls == back_calls, (name, backward.summary())
        assert backward.total_received <= back_volume, (name, backward.summary())


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_nan_propagates_like_torch(ctx):
    """A NaN anywhere wins max/min/norm/logsumexp on every rank, and argmax points at the first one."""
    cases = EXTREMES + [c for c in NORMS + MOMENTS if "normalize" not in c[0]]
    for name, fn in cases:
        for placements in layouts(ctx.mesh, 3):
            check(fn, [(_with_nans(seed=6), placements)], ctx.mesh, grad=False, label=name)


@distributed(world_sizes=(1, 3), mesh_2d=False)
def test_empty_global_dims_behave_like_torch(ctx):
    mesh = ctx.mesh
    g = torch.zeros((0, 4), dtype=torch.float64)
    x = shard_from_global(g, make_spec(mesh, [Shard(0)], g.shape))
    assert torch.equal(x.sum(0).full_tensor(), g.sum(0))
    assert x.mean(1).full_tensor().shape == (0,)
    assert x.amax(1).full_tensor().shape == (0,)
    with pytest.raises((IndexError, RuntimeError)):
        x.amax(0)
    with pytest.raises((IndexError, RuntimeError)):
        x.argmax(0)
    with pytest.raises(IndexError):
        x.sum(2)
