"""Max, average and adaptive pooling on spatially sharded inputs against the single-process result."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from tests._harness import distributed

from ..ops._diff import OP_WORLD_SIZES, check
from ._cases import check_module, grid, spatial_layouts

SHAPES = {1: (2, 3, 13), 2: (2, 3, 11, 9), 3: (1, 2, 7, 6, 5)}

MAX_CASES = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=2, stride=1, dilation=2),
    dict(kernel_size=3, stride=3, padding=1, dilation=2, ceil_mode=True),
    dict(kernel_size=2, stride=2, return_indices=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, return_indices=True),
]
AVG_CASES = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=4, stride=3, padding=2, ceil_mode=True),
]


@pytest.mark.parametrize("n", [1, 2, 3])
@distributed(world_sizes=OP_WORLD_SIZES)
def test_max_and_avg_pool(ctx, n):
    x = grid(SHAPES[n])
    cases = [(getattr(F, f"max_pool{n}d"), c) for c in MAX_CASES] + [(getattr(F, f"avg_pool{n}d"), c) for c in AVG_CASES]
    if n > 1:
        cases.append((getattr(F, f"avg_pool{n}d"), dict(kernel_size=3, stride=2, padding=1, divisor_override=5)))
    for fn, kw in cases:
        for placements in spatial_layouts(ctx.mesh, n + 2, n, batch=n == 2):
            check(lambda x: fn(x, **kw), [(x, placements)], ctx.mesh, label=f"{fn.__name__} {kw}")


@pytest.mark.parametrize("n", [1, 2, 3])
@distributed(world_sizes=OP_WORLD_SIZES)
def test_adaptive_pool(ctx, n):
    x = grid(SHAPES[n])
    sizes = {1: [4, 1, 13, 20], 2: [(4, 5), 1, (13, 11), (None, 3), (3, 20)], 3: [(3, 2, 4), 1, (None, 9, 2)]}[n]
    for size in sizes:
        for fn, kw in (
            (getattr(F, f"adaptive_avg_pool{n}d"), {}),
            (getattr(F, f"adaptive_max_pool{n}d"), {}),
            (getattr(F, f"adaptive_max_pool{n}d"), dict(return_indices=True)),
        ):
            for placements in spatial_layouts(ctx.mesh, n + 2, n, batch=n == 2):
                check(lambda x: fn(x, size, **kw), [(x, placements)], ctx.mesh, label=f"{fn.__name__} {size} {kw}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_pool_modules_and_unbatched_and_channel_sharded(ctx):
    x = grid(SHAPES[2])
    modules = [torch.nn.MaxPool2d(3, 2, 1), torch.nn.AvgPool2d(2), torch.nn.AdaptiveAvgPool2d((3, 4)), torch.nn.AdaptiveMaxPool2d(2)]
    for module in modules:
        for placements in spatial_layouts(ctx.mesh, 4, 2):
            check_module(module, x, placements, ctx.mesh, label=repr(module))
        for placements in spatial_layouts(ctx.mesh, 3, 2):
            check(lambda x: module(x), [(x[0], placements)], ctx.mesh, label=f"unbatched {module}")
    channel = (Shard(1),) * ctx.mesh.ndim
    check(lambda x: F.max_pool2d(x, 3, 2, 1), [(x, channel)], ctx.mesh, label="channel-sharded max_pool")
