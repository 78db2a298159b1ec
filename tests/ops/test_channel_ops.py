"""Channel ops on uneven shards against one process: prelu (nn.PReLU), glu, pixel_shuffle, pixel_unshuffle."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts


def _g(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_prelu_and_glu(ctx):
    for placements in layouts(ctx.mesh, 3, partial=True):  # the channel dim 1 sharded too
        for n in (1, 4):
            prelu = torch.nn.PReLU(n).double()
            with torch.no_grad():
                prelu.weight.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(n))
            check(lambda m, x: m(x), [(_g((5, 4, 6), seed=1), placements)], ctx.mesh, module=prelu, label=f"PReLU({n})")
        check(
            lambda x, w: F.prelu(x, w),
            [(_g((5, 4, 6), seed=1), placements), (_g((4,), seed=2), None)],
            ctx.mesh,
            label="prelu weight input",
        )
        for d in (0, 1, 2, -1):
            check(lambda x: F.glu(x, d), [(_g((6, 4, 8), seed=3), placements)], ctx.mesh, label=f"glu dim={d}")
    check(
        lambda x: F.prelu(x, torch.tensor([0.25], dtype=torch.float64)),
        [(_g((7,), seed=4), layouts(ctx.mesh, 1)[0])],
        ctx.mesh,
        label="prelu 1-d",
    )


@distributed(world_sizes=OP_WORLD_SIZES)
def test_pixel_shuffle_and_unshuffle(ctx):
    for placements in layouts(ctx.mesh, 4):
        check(lambda x: F.pixel_shuffle(x, 2), [(_g((2, 8, 5, 3), seed=1), placements)], ctx.mesh, label="shuffle")
        check(lambda x: F.pixel_unshuffle(x, 2), [(_g((2, 2, 6, 4), seed=2), placements)], ctx.mesh, label="unshuffle")
        check(
            lambda x: torch.nn.PixelShuffle(3)(F.pixel_unshuffle(x, 3)),
            [(_g((1, 2, 9, 6), seed=3), placements)],
            ctx.mesh,
            label="unshuffle 3 then shuffle 3",
        )
    # an SRResNet-style upsampling block (PhysicsNeMo's SRResNet: conv, PReLU, pixel shuffle) with H sharded
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.Conv2d(3, 12, 3, padding=1),
        torch.nn.PixelShuffle(2),
        torch.nn.PReLU(3),
        torch.nn.Conv2d(3, 2, 3, padding=1),
    ).double()
    check(
        lambda m, x: m(x),
        [(_g((2, 3, 7, 5), seed=4), (Shard(2),) * ctx.mesh.ndim)],
        ctx.mesh,
        module=block,
        label="upsampling block",
    )
    # the layout the docs promise: H shard sizes times r, placements kept
    placements = (Shard(2),) * ctx.mesh.ndim
    spec = make_spec(ctx.mesh, placements, (2, 8, 5, 3))
    y = F.pixel_shuffle(shard_from_global(_g((2, 8, 5, 3)), spec), 2)
    assert y.placements == spec.placements
    assert y._spec.dim_sizes[2] == tuple(2 * s for s in spec.dim_sizes[2])
    # torch's argument errors, alike on every rank
    x = shard_from_global(_g((2, 6, 5, 3)), make_spec(ctx.mesh, placements, (2, 6, 5, 3)))
    with pytest.raises(RuntimeError, match="pixel_shuffle"):
        F.pixel_shuffle(x, 2)
    with pytest.raises(RuntimeError, match="Halving dimension must be even"):
        F.glu(x, 2)
