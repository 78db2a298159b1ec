"""``F.interpolate`` / ``nn.Upsample`` in every mode on spatially sharded inputs."""

import pytest
import torch
import torch.nn.functional as F

from tests._harness import distributed

from ..ops._diff import OP_WORLD_SIZES, check
from ._cases import check_module, grid, spatial_layouts

SHAPES = {1: (2, 3, 13), 2: (2, 3, 11, 9), 3: (1, 2, 7, 6, 5)}
MODES = {1: ["nearest", "nearest-exact", "linear", "area"], 2: ["nearest", "nearest-exact", "bilinear", "bicubic", "area"], 3: ["nearest", "nearest-exact", "trilinear", "area"]}


def _sizing(n):
    return [
        dict(scale_factor=2),
        dict(scale_factor=0.5),
        dict(scale_factor=1.7),
        dict(scale_factor=1.7, recompute_scale_factor=True),
        dict(size={1: 20, 2: (7, 17), 3: (9, 4, 11)}[n]),
    ]


@pytest.mark.parametrize("n", [1, 2, 3])
@distributed(world_sizes=OP_WORLD_SIZES)
def test_interpolate(ctx, n):
    x = grid(SHAPES[n])
    for mode in MODES[n]:
        corners = [False, True] if mode in ("linear", "bilinear", "bicubic", "trilinear") else [None]
        for sizing in _sizing(n):
            for align_corners in corners:
                kw = dict(sizing, mode=mode, align_corners=align_corners)
                for placements in spatial_layouts(ctx.mesh, n + 2, n, batch=n == 2):
                    check(lambda x: F.interpolate(x, **kw), [(x, placements)], ctx.mesh, label=f"interpolate {kw}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_antialias_float32_and_upsample_module(ctx):
    x = grid(SHAPES[2])
    for mode in ("bilinear", "bicubic"):
        for placements in spatial_layouts(ctx.mesh, 4, 2):
            check(lambda x: F.interpolate(x, scale_factor=0.4, mode=mode, antialias=True), [(x, placements)], ctx.mesh, label=f"antialias {mode}")
            check(lambda x: F.interpolate(x, scale_factor=1.3, mode=mode), [(x.float(), placements)], ctx.mesh, label=f"float32 {mode}")
    for module in (torch.nn.Upsample(scale_factor=2, mode="nearest"), torch.nn.Upsample(size=(14, 5), mode="bilinear", align_corners=True)):
        for placements in spatial_layouts(ctx.mesh, 4, 2):
            check_module(module, x, placements, ctx.mesh, label=repr(module))
