"""Helpers for building ShardTensors from a reference tensor every rank holds.

Tests create the same global tensor on every rank (seeded), cut this rank's
piece out of it by the layout, and compare results with the single-process
computation on the global tensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial

from physicsnemo_dp import ShardTensor, ShardTensorSpec
from physicsnemo_dp import _layout
from physicsnemo_dp.collectives import mesh_device




def uneven_table(extent: int, shards: int, salt: int = 0) -> tuple[int, ...]:
    """Deliberately uneven sizes summing to ``extent``, with empty shards when possible."""
    weights = [((i + salt) * 7 + 3) % 5 for i in range(shards)]
    if sum(weights) == 0:
        weights = [1] * shards
    sizes = [extent * w // sum(weights) for w in weights]
    last = max(i for i, w in enumerate(weights) if w)
    sizes[last] += extent - sum(sizes)
    return tuple(sizes)


def make_spec(mesh, placements, global_shape, kind="uneven", dtype=torch.float64, salt=0):
    """Spec with chunk-rule sizes (``kind="chunk"``) or deliberately uneven ones."""
    if kind == "chunk":
        return ShardTensorSpec.chunked(mesh, placements, global_shape, dtype)
    placements = _layout.normalize_placements(placements, mesh.ndim, len(global_shape))
    tables = []
    for d, extent in enumerate(global_shape):
        dims = _layout.sharding_mesh_dims(placements, d)
        n = 1
        for m in dims:
            n *= mesh.size(m)
        tables.append(uneven_table(extent, n, salt + d) if dims else None)
    return ShardTensorSpec.from_sizes(mesh, placements, global_shape, dtype, tuple(tables))


def box(spec, coord=None):
    """Slices of the global tensor that the rank at ``coord`` holds."""
    coord = spec.coordinate if coord is None else coord
    offsets = spec.local_offsets(coord)
    shape = spec.local_shape_at(coord)
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


def partial_weight(spec, coord=None) -> int:
    """Integer weights per rank that sum to 1 over every Partial mesh dim (exact in float)."""
    coord = spec.coordinate if coord is None else coord
    w = 1
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            n = spec.mesh.size(m)
            w *= 1 if n == 1 else (2 if coord[m] == 0 else (-1 if coord[m] == 1 else 0))
    return w


def local_piece(global_tensor, spec):
    """This rank's local tensor for ``spec`` (a contribution where Partial)."""
    piece = global_tensor[box(spec)].clone()
    return piece * partial_weight(spec) if any(isinstance(p, Partial) for p in spec.placements) else piece


def on_mesh_device(t, mesh):
    """``t`` on the device of ``mesh``'s collectives (``ctx.device``): CUDA under ``PDP_TEST_DEVICE=cuda``.

    Tests draw their data on CPU (seeded CPU generators give the same values
    everywhere) and move it here, so the same test runs on CPU or CUDA tensors.
    """
    return t.to(mesh_device(mesh)) if isinstance(t, torch.Tensor) else t


def shard_from_global(global_tensor, spec, requires_grad=False):
    """A ShardTensor with layout ``spec`` holding ``global_tensor`` (a leaf if requires_grad),
    its local tensor on the mesh's device."""
    st = ShardTensor(local_piece(on_mesh_device(global_tensor, spec.mesh), spec), spec, requires_grad=False)
    return st.requires_grad_(requires_grad)


def integer_tensor(shape, seed=0, dtype=torch.float64):
    """Small integers stored as floats: sums and products are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)
