"""``F.pad`` in every mode on sharded tensors, padding only at the global boundary."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import OP_WORLD_SIZES, check
from ._cases import grid, spatial_layouts


@distributed(world_sizes=OP_WORLD_SIZES)
def test_pad_every_mode(ctx):
    cases = [
        ((2, 3, 13), (2, 3), "constant", 1.5),
        ((2, 3, 13), (3, 1), "reflect", None),
        ((2, 3, 13), (2, 4), "replicate", None),
        ((2, 3, 13), (4, 2), "circular", None),
        ((2, 3, 11, 9), (1, 2, 3, 0), "constant", None),
        ((2, 3, 11, 9), (1, 2, 2, 3), "reflect", None),
        ((2, 3, 11, 9), (3, 3, 1, 2), "replicate", None),
        ((2, 3, 11, 9), (2, 1, 3, 4), "circular", None),
        ((2, 3, 11, 9), (-1, 2, 3, -2), "constant", 0.0),
        ((2, 3, 11, 9), (2, 1), "constant", None),
        ((1, 2, 7, 6, 5), (1, 1, 2, 0, 1, 2), "reflect", None),
        ((1, 2, 7, 6, 5), (1, 2, 1, 1, 2, 1), "circular", None),
        ((1, 2, 7, 6, 5), (1, 0, 0, 2, 3, 1), "replicate", None),
    ]
    for shape, pad, mode, value in cases:
        x = grid(shape)
        kw = {} if value is None else dict(value=value)
        for placements in spatial_layouts(ctx.mesh, len(shape), len(pad) // 2, batch=len(shape) == 4):
            check(lambda x: F.pad(x, pad, mode=mode, **kw), [(x, placements)], ctx.mesh, label=f"pad {pad} {mode}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_constant_padding_does_not_communicate(ctx):
    shape = (2, 3, 11, 9)
    spec = make_spec(ctx.mesh, spatial_layouts(ctx.mesh, 4, 2)[0], shape)
    x = shard_from_global(grid(shape), spec, requires_grad=True)
    with count_collectives() as counter:
        y = F.pad(x, (1, 2, 3, 4), value=2.0)
        y.backward(torch.ones_like(y))
    assert counter.total_calls == 0, counter.summary()


@distributed(world_sizes=(4,), mesh_2d=False)
def test_reflect_and_circular_on_thin_boundary_shards(ctx):
    from physicsnemo_dp import ShardTensorSpec

    shape = (1, 2, 9)
    for sizes in ((1, 0, 7, 1), (0, 1, 8, 0), (2, 2, 2, 3)):
        spec = ShardTensorSpec.from_sizes(ctx.mesh, (Shard(2),), shape, torch.float64, (None, None, sizes))
        g = grid(shape)
        for mode in ("reflect", "replicate", "circular"):
            y = F.pad(shard_from_global(g, spec), (4, 3), mode=mode)
            assert torch.equal(y.full_tensor(), F.pad(g, (4, 3), mode=mode)), (sizes, mode)
            assert sum(y._spec.dim_sizes[2]) == 16


@distributed(world_sizes=OP_WORLD_SIZES)
def test_circular_padding_with_negative_pads_wraps_the_cropped_tensor(ctx):
    """torch crops first and wraps the cropped tensor: the period is the cropped extent, not the input's."""
    cases = [
        ((2, 3, 11, 9), (-1, 1, -2, 1)),
        ((2, 3, 13), (1, -2)),
        ((2, 3, 13), (-3, 2)),
        ((2, 3, 11, 9), (2, -1, -1, -1)),
        ((1, 2, 7, 6, 5), (-1, 1, 1, -2, -1, 2)),
    ]
    for shape, pad in cases:
        x = grid(shape)
        for placements in spatial_layouts(ctx.mesh, len(shape), len(pad) // 2, batch=len(shape) == 4):
            check(lambda x: F.pad(x, pad, mode="circular"), [(x, placements)], ctx.mesh, label=f"circular {pad}")


@distributed(world_sizes=(1, 2, 3, 4))
def test_constant_padding_of_an_empty_sharded_dim(ctx):
    """Every shard of the padded dim is empty: the first takes the whole output, so the size table adds up."""
    from torch.distributed.tensor.placement_types import Replicate

    rest = (Replicate(),) * (ctx.mesh.ndim - 1)
    for shape, pad, dim in (((0, 3, 3), (1, 1, 1, 1, 1, 1), 0), ((2, 0, 3), (1, 1, 2, 1), 1), ((2, 0, 3), (1, 1), 1)):
        g = torch.zeros(shape, dtype=torch.float64)
        x = shard_from_global(g, make_spec(ctx.mesh, (Shard(dim),) + rest, shape), requires_grad=True)
        y = F.pad(x, pad, value=1.5)
        want = F.pad(g, pad, value=1.5)
        assert tuple(y.shape) == tuple(want.shape) and sum(y._spec.dim_sizes[dim]) == want.shape[dim]
        assert torch.equal(y.full_tensor(), want), (shape, pad)
        y.backward(torch.ones_like(y))
        assert tuple(x.grad.shape) == shape
