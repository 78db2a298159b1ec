"""Shared inputs for the spatial tests: tiny float64 grids and the layouts to try."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..ops._diff import check


def grid(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def spatial_layouts(mesh, ndim: int, k: int, batch: bool = False):
    """Placements sharding one spatial dim (1-D mesh) or two dims (2-D mesh) of an input with ``k`` spatial dims.

    On the 2x2 mesh: two different spatial dims, batch x spatial, nested
    sharding of one spatial dim, and replicated x spatial. (One pair of spatial
    dims: another pair, or the same pair in the other order, is the same case
    with other dims or the mesh dims swapped.)
    """
    spatial = list(range(ndim - k, ndim))
    if mesh.ndim == 1:
        return [(Shard(d),) for d in spatial] + ([(Shard(0),)] if batch else [])
    pairs = [(Shard(spatial[0]), Shard(spatial[1]))] if k > 1 else []
    return pairs + [(Shard(0), Shard(spatial[-1])), (Shard(spatial[0]), Shard(spatial[0])), (Replicate(), Shard(spatial[0]))]


def check_module(module, x, placements, mesh, label=""):
    """``check`` of ``module(x)`` with fresh parameter gradients (``check`` compares, not resets, them)."""
    module.zero_grad(set_to_none=True)
    return check(lambda m, x: m(x), [(x, placements)], mesh, module=module, label=label)
