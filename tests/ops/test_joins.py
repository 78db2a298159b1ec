"""Joining and splitting along and across the sharded dim, forward and backward, on uneven shards."""

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensorSpec, count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 5, 3)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


SLICES = [
    lambda x: x[1:6:2],
    lambda x: x[-3:],
    lambda x: x[:-2],
    lambda x: x[5:100],
    lambda x: x[2:2],
    lambda x: x[::3],
    lambda x: x[:, 1:],
    lambda x: x[:, ::2],
    lambda x: x[..., 1:2],
    lambda x: x.narrow(0, 2, 3),
    lambda x: x.narrow(1, -3, 2),
    lambda x: torch.narrow_copy(x, 0, 1, 4),
    lambda x: x[1:][1:][::2],
]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_slice_and_narrow(ctx):
    for i, fn in enumerate(SLICES):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(fn, [(_g(), placements)], ctx.mesh, label=f"slice[{i}]")


SPLITS = [
    lambda x: x.split(3, 0),
    lambda x: x.split([2, 0, 5], 0),
    lambda x: torch.split(x, 2, dim=1),
    lambda x: x.split([1, 2], -1),
    lambda x: x.chunk(3, 0),
    lambda x: x.chunk(4, 1),
    lambda x: x.tensor_split(3, 0),
    lambda x: x.tensor_split([1, 4], 1),
    lambda x: torch.hsplit(x, [2]),
    lambda x: x.unbind(0),
    lambda x: x.unbind(1),
    lambda x: torch.unbind(x, -1),
    lambda x: x.split(3, 0)[1] * 2,  # unused pieces get zero gradients
    lambda x: x.unbind(0)[3] - x.unbind(0)[6] * 2,
]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_split_chunk_unbind(ctx):
    for i, fn in enumerate(SPLITS):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(fn, [(_g(), placements)], ctx.mesh, label=f"split[{i}]")


SELECTS = [
    lambda x: x[2],
    lambda x: x[-1],
    lambda x: x.select(1, 3),
    lambda x: x[:, -1],
    lambda x: x.select(2, 0),
    lambda x: x[3, 1],
    lambda x: x[0] + x[6],
]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_select(ctx):
    for i, fn in enumerate(SELECTS):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(fn, [(_g(), placements)], ctx.mesh, label=f"select[{i}]")


@distributed(world_sizes=OP_WORLD_SIZES, timeout=300)
def test_cat_along_and_across_the_sharded_dim(ctx):
    lay = layouts(ctx.mesh, 3)
    for d in range(3):
        other = list(SHAPE)
        other[d] = 4
        for pa in lay:
            for pb in (pa, lay[0], lay[-1]):
                check(lambda a, b: torch.cat([a, b], d), [(_g(), pa), (_g(tuple(other), 1), pb)], ctx.mesh, label=f"cat{d}")
            check(lambda a, b: torch.cat([b, a, b], dim=d - 3), [(_g(), pa), (_g(tuple(other), 2), None)], ctx.mesh, label=f"cat-plain{d}")
            check(lambda a: torch.cat([a.narrow(d, 0, 2), a, a.narrow(d, 1, 2)], d), [(_g(), pa)], ctx.mesh, label=f"cat-self{d}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_cat_edge_cases(ctx):
    for pa in layouts(ctx.mesh, 3, partial=True):
        check(lambda a: torch.cat([a, a.new_zeros(0, 5, 3), a], 0), [(_g(), pa)], ctx.mesh, label="cat-empty")
        check(lambda a: torch.cat([torch.empty(0, dtype=a.dtype), a], 0), [(_g(), pa)], ctx.mesh, label="cat-legacy")
        check(lambda a: torch.cat([a, a.to(torch.float32)], 2), [(_g(), pa)], ctx.mesh, label="cat-dtypes")
        check(lambda a: torch.cat(a.split([3, 4])), [(_g(), pa)], ctx.mesh, label="cat-split")


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_stack(ctx):
    lay = layouts(ctx.mesh, 3, partial=True)
    for d in (0, 1, 3, -1):
        for pa in lay:
            for pb in (pa, lay[0], lay[-1]):
                check(lambda a, b: torch.stack([a, b], d), [(_g(), pa), (_g(seed=1), pb)], ctx.mesh, label=f"stack{d}")
            check(lambda a, b: torch.stack([b, a], d), [(_g(), pa), (_g(seed=2), None)], ctx.mesh, label=f"stack-plain{d}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_split_slice_narrow_along_the_sharded_dim_do_not_communicate(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3):
        spec = make_spec(mesh, placements, SHAPE)
        G = _g()
        x = shard_from_global(G, spec, requires_grad=True)
        with count_collectives() as counter:
            pieces = x.split([2, 0, 5], 0)
            chunks = x.chunk(3, 1)
            sl = x[1:6:2]
            nw = x.narrow(2, 1, 2)
            ts = x.tensor_split(3, 0)
            joined = torch.cat(pieces, 0)  # pieces of one tensor, in rank order: free
            token = shard_from_global(_g((1, 5, 3), 9), make_spec(mesh, [Replicate()] * mesh.ndim, (1, 5, 3)))
            padded = torch.cat([token, x, token], 0)  # replicated rows go whole to a neighbour
        assert counter.total_calls == 0, placements
        assert torch.equal(padded.full_tensor(), torch.cat([_g((1, 5, 3), 9), G, _g((1, 5, 3), 9)]))
        assert joined._spec.dim_sizes == spec.dim_sizes
        for got, want in ((sl, G[1:6:2]), (nw, G.narrow(2, 1, 2)), (pieces[2], G[2:]), (chunks[1], G.chunk(3, 1)[1]), (ts[2], G.tensor_split(3)[2])):
            assert torch.equal(got.full_tensor(), want)
        grad = shard_from_global(torch.ones(sl.shape, dtype=G.dtype), sl._spec)
        with count_collectives() as counter:
            torch.autograd.backward([sl], [grad])
        assert counter.total_calls == 0
        expected = torch.zeros_like(G)
        expected[1:6:2] = 1
        assert torch.equal(x.grad.full_tensor(), expected)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_cat_and_stack_across_the_sharded_dim_do_not_communicate(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3, dims=[0]):
        spec = make_spec(mesh, placements, SHAPE)
        a, b = shard_from_global(_g(), spec), shard_from_global(_g(seed=1), spec)
        with count_collectives() as counter:
            c = torch.cat([a, b], 2)
            s = torch.stack([a, b], 1)
            u = s.unbind(1)
        assert counter.total_calls == 0
        assert c._spec.dim_sizes[0] == spec.dim_sizes[0] and s._spec.dim_sizes[0] == spec.dim_sizes[0]
        assert torch.equal(u[1].full_tensor(), _g(seed=1))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_select_along_the_sharded_dim_broadcasts_from_the_owner(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, [Shard(0)] * mesh.ndim, SHAPE)
    x = shard_from_global(_g(), spec)
    with count_collectives() as counter:
        row = x[4]
    assert all(p == Replicate() for p in row.placements)
    assert counter.calls.get("broadcast", 0) == sum(1 for n in mesh.shape if n > 1)
    assert counter.total_calls == counter.calls.get("broadcast", 0)
    assert torch.equal(row._local_tensor, _g()[4])


@distributed(world_sizes=OP_WORLD_SIZES)
def test_in_place_write_through_a_slice_reaches_the_base(ctx):
    for placements in layouts(ctx.mesh, 3):
        spec = make_spec(ctx.mesh, placements, SHAPE)
        G = _g()
        x = shard_from_global(G, spec)
        x.narrow(0, 1, 4).mul_(2)
        x[:, 2:].zero_()
        expected = G.clone()
        expected[1:5] *= 2
        expected[:, 2:] = 0
        assert torch.equal(x.full_tensor(), expected)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_one_dimensional_select_and_unbind(ctx):
    for placements in layouts(ctx.mesh, 1):
        g = _g((6,), 4)
        check(lambda x: x[3], [(g, placements)], ctx.mesh, label="select-1d")
        check(lambda x: x.unbind(), [(g, placements)], ctx.mesh, label="unbind-1d")
        check(lambda x: torch.stack([x[1:], x[:-1]], 1), [(g, placements)], ctx.mesh, label="stack-shifted")


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_cat_along_the_sharded_dim_moves_each_element_at_most_once(ctx):
    """Operands that do not tile go to the split rule's layout with one all-to-all each, no gather."""
    mesh = ctx.mesh
    a = shard_from_global(_g(), make_spec(mesh, [Shard(0)], SHAPE, salt=1))
    b = shard_from_global(_g((4, 5, 3), 1), make_spec(mesh, [Shard(0)], (4, 5, 3), salt=2))
    with count_collectives() as counter:
        c = torch.cat([a, b])
    assert set(counter.calls) <= {"all_to_all"} and counter.total_calls <= 2
    assert c._spec.dim_sizes[0] == ShardTensorSpec.chunked(mesh, [Shard(0)], (11, 5, 3), torch.float64).dim_sizes[0]
    assert torch.equal(c.full_tensor(), torch.cat([_g(), _g((4, 5, 3), 1)]))
    element = 5 * 3 * 8
    assert counter.total_sent <= (7 + 4) * element
