"""Elementwise ops and broadcasting on uneven shards, with plain tensors and scalars."""

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import integer_tensor, make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 5, 3)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


UNARY = [torch.sin, torch.tanh, torch.exp, torch.relu, torch.sigmoid, lambda x: x.abs() + 1, lambda x: -x,
         lambda x: torch.nn.functional.gelu(x), lambda x: torch.nn.functional.silu(x), lambda x: x.clamp(-0.5, 0.5),
         lambda x: x.pow(2), lambda x: torch.where(x > 0, x, 0.1 * x), lambda x: x.to(torch.float32).to(torch.float64),
         lambda x: x.clone(), lambda x: x.detach() * x]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_unary_ops(ctx):
    for i, fn in enumerate(UNARY):
        for placements in layouts(ctx.mesh, 3):
            check(fn, [(_g(), placements)], ctx.mesh, label=f"unary[{i}]")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_binary_ops_with_same_and_different_layouts(ctx):
    ops = [torch.add, torch.sub, torch.mul, lambda a, b: a / (b.abs() + 1), torch.maximum, lambda a, b: torch.atan2(a, b)]
    lay = layouts(ctx.mesh, 3)
    for i, fn in enumerate(ops):
        for pa in lay:
            for pb in (pa, lay[-1], lay[0]):
                check(fn, [(_g(seed=1), pa), (_g(seed=2), pb)], ctx.mesh, label=f"binary[{i}]")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_broadcasting_with_plain_tensors_and_scalars(ctx):
    weight = _g((3,), seed=3)
    column = _g((7, 1, 1), seed=4)
    for placements in layouts(ctx.mesh, 3):
        check(lambda x, w: x * w + 2.5, [(_g(), placements), (weight, None)], ctx.mesh, label="x*w")
        check(lambda x, c: x - c, [(_g(), placements), (column, None)], ctx.mesh, label="x-col")
        check(lambda x, w: torch.addcmul(x, x, w, value=0.5), [(_g(), placements), (weight, None)], ctx.mesh, label="addcmul")
        # a sharded operand that broadcasts against a larger sharded one
        check(lambda x, c: x * c, [(_g(), placements), (column, placements[:1] + (Replicate(),) * (ctx.mesh.ndim - 1) if placements[0] == Shard(0) else None)], ctx.mesh, label="bcast-sharded")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_partial_stays_pending_only_for_linear_ops(ctx):
    mesh = ctx.mesh
    G, H = integer_tensor(SHAPE, 1), integer_tensor(SHAPE, 2)
    pspec = make_spec(mesh, [Partial()] * mesh.ndim, SHAPE)
    a, b = shard_from_global(G, pspec), shard_from_global(H, pspec)
    with count_collectives() as counter:
        s = a + b
        d = a - 2 * b
        n = -a
    assert counter.total_calls == 0
    assert all(p.is_partial() for p in s.placements + d.placements + n.placements)
    assert torch.equal(s.full_tensor(), G + H) and torch.equal(d.full_tensor(), G - 2 * H)
    assert torch.equal(n.full_tensor(), -G)
    # nonlinear ops reduce first
    assert torch.equal((a * b).full_tensor(), G * H)
    assert torch.equal((a + 1).full_tensor(), G + 1)
    assert torch.equal(torch.relu(a).full_tensor(), torch.relu(G))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_elementwise_ops_do_not_communicate(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, layouts(mesh, 3)[0], SHAPE)
    x = shard_from_global(_g(), spec, requires_grad=True)
    w = _g((3,), 5).requires_grad_(True)
    with count_collectives() as counter:
        y = torch.tanh(x * w + 1.0) * 2
    assert counter.total_calls == 0
    assert y._spec.dim_sizes == spec.dim_sizes


@distributed(world_sizes=OP_WORLD_SIZES)
def test_in_place_ops(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3):
        spec = make_spec(mesh, placements, SHAPE)
        G = _g()
        x = shard_from_global(G, spec)
        x.mul_(2).add_(_g((3,), 7)).clamp_(max=1.0)
        expected = (G * 2 + _g((3,), 7)).clamp(max=1.0)
        assert torch.allclose(x.full_tensor(), expected)
        x.zero_()
        assert torch.equal(x.full_tensor(), torch.zeros(SHAPE, dtype=G.dtype))
        x.copy_(shard_from_global(G, make_spec(mesh, layouts(mesh, 3)[-1], SHAPE)))
        assert torch.equal(x.full_tensor(), G) and x._spec.dim_sizes == spec.dim_sizes


@distributed(world_sizes=OP_WORLD_SIZES)
def test_dtype_casts_and_like_factories(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, layouts(mesh, 3)[0], SHAPE)
    x = shard_from_global(_g(), spec)
    assert x.to(torch.float32).dtype == torch.float32
    assert x.float()._spec.dim_sizes == spec.dim_sizes
    for f, v in ((torch.zeros_like, 0.0), (torch.ones_like, 1.0)):
        y = f(x)
        assert y._spec.dim_sizes == spec.dim_sizes and torch.equal(y.full_tensor(), torch.full(SHAPE, v, dtype=torch.float64))
    assert torch.equal(torch.full_like(x, 3.0).full_tensor(), torch.full(SHAPE, 3.0, dtype=torch.float64))
    assert (x > 0).dtype == torch.bool and torch.equal((x > 0).full_tensor(), _g() > 0)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_rsub_floor_divide_fill_sgn(ctx):
    """rsub, floor_divide and fill through the pointwise family; sgn's gradient laid out like its input."""
    mesh = ctx.mesh
    scalar = torch.tensor(1.5, dtype=torch.float64)
    grads = [
        lambda x: torch.rsub(x, 2.0), lambda x: torch.rsub(x, x.exp(), alpha=2), lambda x: 1.0 - x,
        lambda x: torch.fill(x, 2.0), lambda x: torch.fill(x, scalar) * x, lambda x: (x * 1).fill_(-1.0) + x,
        lambda x: (x * 2).fill_(scalar), torch.sgn, lambda x: torch.sgn(x * 2) + x, lambda x: x.sgn().sum(),
    ]
    no_grad = [lambda x: torch.floor_divide(x, 0.3), lambda x: torch.floor_divide(x * 7, x.abs() + 1),
               lambda x: (x * 5).floor_divide_(2.0), lambda x: x // 0.25]
    for placements in layouts(mesh, 3, partial=True):
        for i, fn in enumerate(grads):
            check(fn, [(_g(), placements)], mesh, label=f"rsub/fill/sgn[{i}]")
        for i, fn in enumerate(no_grad):
            check(fn, [(_g(), placements)], mesh, grad=False, label=f"floor_divide[{i}]")
    # fill drops a pending sum without reducing it; a pending 0-d value is reduced (one tiny all-reduce)
    pspec = make_spec(mesh, [Partial()] * mesh.ndim, SHAPE)
    x = shard_from_global(_g(), pspec)
    with count_collectives() as counter:
        y = torch.fill(x, 3.0)
        x.fill_(1.0)
    assert counter.total_calls == 0 and not y._spec.has_partial and not x._spec.has_partial
    assert torch.equal(y.full_tensor(), torch.full(SHAPE, 3.0, dtype=torch.float64))
    value = shard_from_global(torch.tensor(2.0, dtype=torch.float64), make_spec(mesh, [Partial()] * mesh.ndim, ()))
    assert torch.equal(torch.fill(x, value).full_tensor(), torch.full(SHAPE, 2.0, dtype=torch.float64))
    # an op tagged pointwise with a non-tensor result is not an elementwise op
    from physicsnemo_dp import propagation

    assert propagation.is_elementwise(torch.ops.aten.mul.Tensor)
    assert not propagation.is_elementwise(torch.ops.aten.equal.default)
