"""scatter_tensor from any source rank, on 1-D and 2-D meshes, with the one split rule."""

from itertools import product

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensorSpec, count_collectives, scatter_tensor
from physicsnemo_dp.split import chunk_sizes
from tests._harness import distributed

from ._util import box, integer_tensor

SHAPES = [(6, 3), (9, 2), (2, 5), (1, 4), (0, 3)]


def _placement_sets(mesh):
    options = [Shard(0), Shard(1), Replicate(), Partial()]
    return [(p,) for p in options] if mesh.ndim == 1 else list(product(options, repeat=2))


@distributed
def test_scatter_every_layout_from_every_source(ctx):
    mesh = ctx.mesh
    for shape, placements, src in product(SHAPES, _placement_sets(mesh), range(ctx.world_size)):
        G = integer_tensor(shape, seed=src)
        x = scatter_tensor(G if ctx.rank == src else None, src, mesh, placements)
        expected = ShardTensorSpec.chunked(mesh, placements, shape, G.dtype)
        assert x._spec == expected, (shape, placements, src)
        if not any(p.is_partial() for p in placements):
            assert torch.equal(x.to_local(), G[box(expected)])
        assert torch.equal(x.full_tensor(), G)


@distributed(world_sizes=(3, 4), mesh_2d=False)
def test_scatter_follows_the_split_rule(ctx):
    for rows in (6, 9, 2, 1, 0):
        G = integer_tensor((rows, 2))
        x = scatter_tensor(G if ctx.rank == 0 else None, 0, ctx.mesh, [Shard(0)])
        assert tuple(s[0] for s in x._spec.sharding_shapes(0)) == chunk_sizes(rows, ctx.world_size)


@distributed(mesh_2d=False)
def test_scatter_sends_each_rank_only_its_shard(ctx):
    G = integer_tensor((11, 3))
    with count_collectives() as counter:
        x = scatter_tensor(G if ctx.rank == 0 else None, 0, ctx.mesh, [Shard(0)])
    mine = x.to_local().numel() * G.element_size()
    assert counter.bytes_received["scatter"] == (0 if ctx.rank == 0 else mine)


@distributed
def test_scatter_options(ctx):
    mesh = ctx.mesh
    G = integer_tensor((5, 4))
    src = ctx.world_size - 1
    x = scatter_tensor(G if ctx.rank == src else None, src, mesh, [Replicate()] * mesh.ndim,
                       global_shape=(5, 4), dtype=torch.float32, requires_grad=True)
    assert x.dtype == torch.float32 and x.requires_grad and x.is_leaf
    assert torch.equal(x.full_tensor(), G.float())
    if ctx.rank == src:  # never aliases the caller's tensor
        with torch.no_grad():
            x.to_local().add_(1)
        assert torch.equal(G, integer_tensor((5, 4)))


@distributed(world_sizes=(1, 2, 3))
def test_scatter_errors_reach_every_rank(ctx):
    mesh = ctx.mesh
    for bad_src in ("0", 99, True):
        with pytest.raises(ValueError, match="global_src"):
            scatter_tensor(None, bad_src, mesh, [Replicate()] * mesh.ndim)
    with pytest.raises(ValueError, match="must pass a torch.Tensor"):
        scatter_tensor(None, 0, mesh, [Replicate()] * mesh.ndim)
    G = integer_tensor((4, 2))
    with pytest.raises(ValueError, match="global_shape"):
        scatter_tensor(G if ctx.rank == 0 else None, 0, mesh, [Shard(0)] * mesh.ndim, global_shape=(3, 2))
    with pytest.raises(ValueError, match="out of range"):
        scatter_tensor(G if ctx.rank == 0 else None, 0, mesh, [Shard(2)] * mesh.ndim)


@distributed(world_sizes=(2, 3))
def test_scatter_arguments_wrong_on_one_rank_raise_everywhere(ctx):
    """Every rank's arguments go into the one metadata all-gather, so a mistake made on one
    rank only raises the same error on all of them (before: that rank raised alone, or the
    ranks split the tensor in different layouts)."""
    import torch.distributed as dist

    mesh = ctx.mesh
    G = integer_tensor((4, 2))
    src_tensor = G if ctx.rank == 0 else None
    one = ctx.rank == 1
    sharded = [Shard(0)] * mesh.ndim
    cases = [
        (dict(placements=[Shard(1)] * mesh.ndim if one else sharded), "different placements"),
        (dict(placements=[Shard(2)] * mesh.ndim if one else sharded), "out of range"),
        (dict(placements=sharded, global_shape=(3, 2) if one else None), "global_shape"),
        (dict(placements=sharded, dtype=torch.float32 if one else None), "global_src or dtype"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            scatter_tensor(src_tensor, 0, mesh, **kwargs)
        assert "rank 1" in str(info.value)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, str(info.value))
        assert len(set(everyone)) == 1, everyone
    with pytest.raises(ValueError, match="global_src") as info:  # another source on one rank
        scatter_tensor(G, 1 if one else 0, mesh, sharded)
    x = scatter_tensor(src_tensor, 0, mesh, sharded)  # the ranks stayed in step
    assert torch.equal(x.full_tensor(), G)
