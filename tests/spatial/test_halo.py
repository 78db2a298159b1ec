"""The halo-exchange primitive on real ranks: values, gradients, bytes, thin and empty shards."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import PlacementError, ShardTensorSpec, count_collectives
from physicsnemo_dp.spatial import halo_exchange
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._cases import grid

SHAPE = (2, 3, 11, 9)
HALO = {2: (1, 2), 3: (2, 1)}


def _placements(mesh):
    if mesh.ndim == 1:
        return [(Shard(2),), (Shard(3),), (Replicate(),)]
    return [(Shard(2), Shard(3)), (Shard(3), Shard(2)), (Shard(0), Shard(3)), (Replicate(), Shard(2))]


def _padded(g, halo, mode):
    """The global tensor padded by the halo widths in ``mode`` (what the windows are cut from)."""
    pads = []
    for d in range(g.ndim - 1, 1, -1):
        pads += list(halo.get(d, (0, 0)))
    return F.pad(g, pads, mode={"zeros": "constant"}.get(mode, mode))


def _window(padded, spec, halo, coord):
    """Rows of ``padded`` that the rank at ``coord`` gets back."""
    index = []
    for d in range(len(spec.global_shape)):
        start, n = spec.local_offsets(coord)[d], spec.local_shape_at(coord)[d]
        left, right = halo.get(d, (0, 0))
        if spec.dim_sizes[d] is None:
            start, n = 0, spec.global_shape[d]
        index.append(slice(start, start + n + left + right))
    return padded[tuple(index)]


def _distinct_coords(spec):
    """Mesh coordinates holding distinct boxes (this rank's coordinate on mesh dims that shard nothing)."""
    me = spec.coordinate
    ranges = [range(n) if p.is_shard() else [me[m]] for m, (n, p) in enumerate(zip(spec.mesh_shape, spec.placements))]
    return list(itertools.product(*ranges))


@distributed
def test_values_and_gradients_in_every_mode(ctx):
    G = grid(SHAPE)
    W = grid((2, 3, 14, 12), seed=5)  # upstream gradient, cut like the windows
    for mode in ("zeros", "replicate", "reflect", "circular"):
        for placements in _placements(ctx.mesh):
            spec = make_spec(ctx.mesh, placements, SHAPE)
            x = shard_from_global(G, spec, requires_grad=True)
            out = halo_exchange(x, HALO, mode=mode)
            ref = G.clone().requires_grad_(True)
            padded = _padded(ref, HALO, mode)
            assert torch.equal(out, _window(padded, spec, HALO, spec.coordinate)), (mode, placements)
            out.backward(_window(W, spec, HALO, spec.coordinate))
            # reference: every distinct box's window, each with its cut of the same upstream gradient
            total = sum((_window(padded, spec, HALO, c) * _window(W, spec, HALO, c)).sum() for c in _distinct_coords(spec))
            total.backward()
            assert torch.allclose(x.grad.full_tensor(), ref.grad), (mode, placements)


@distributed
def test_bytes_are_the_halo_volume_and_backward_mirrors_them(ctx):
    G = grid(SHAPE)
    for placements in _placements(ctx.mesh):
        spec = make_spec(ctx.mesh, placements, SHAPE)
        x = shard_from_global(G, spec, requires_grad=True)
        with count_collectives() as fwd:
            out = halo_exchange(x, HALO, mode="zeros")
        with count_collectives() as bwd:
            out.backward(torch.ones_like(out))
        expected_calls, expected_bytes = 0, 0
        shape = list(spec.local_shape)
        for d in sorted(HALO):
            left, right = HALO[d]
            if spec.dim_sizes[d] is not None and any(p.is_shard() and p.dim == d and ctx.mesh.size(m) > 1 for m, p in enumerate(placements)):
                a, n, N = spec.local_offsets()[d], shape[d], spec.global_shape[d]
                lo, hi = a - left, a + n + right
                rows = max(0, min(hi, N) - max(lo, 0)) - n
                expected_calls += 1
                expected_bytes += rows * _row(shape, d) * 8
                shape[d] += rows  # later dims carry received rows (corners), never padding
        assert fwd.calls.get("halo", 0) == expected_calls and fwd.total_calls == expected_calls, fwd.summary()
        assert fwd.bytes_received["halo"] == expected_bytes, (placements, fwd.summary(), expected_bytes)
        assert bwd.calls.get("halo", 0) == expected_calls and bwd.total_calls == expected_calls, bwd.summary()
        assert bwd.bytes_sent["halo"] == fwd.bytes_received["halo"]
        assert bwd.bytes_received["halo"] == fwd.bytes_sent["halo"]


def _row(shape, d):
    n = 1
    for i, s in enumerate(shape):
        n *= 1 if i == d else s
    return n


@distributed(world_sizes=(3, 4), mesh_2d=False)
def test_thin_and_empty_shards_gather_from_further_ranks(ctx):
    G = grid((1, 2, 12))
    sizes = {3: (1, 0, 11), 4: (1, 0, 1, 10)}[ctx.world_size]
    spec = ShardTensorSpec.from_sizes(ctx.mesh, (Shard(2),), (1, 2, 12), torch.float64, (None, None, sizes))
    x = shard_from_global(G, spec)
    for mode in ("zeros", "replicate", "reflect", "circular"):
        out = halo_exchange(x, {2: (3, 3)}, mode=mode)
        assert torch.equal(out, _window(_padded(G, {2: (3, 3)}, mode), spec, {2: (3, 3)}, spec.coordinate)), mode


@distributed(world_sizes=(1, 2), mesh_2d=True)
def test_nested_sharding_and_bad_widths_raise_clearly(ctx):
    x = shard_from_global(grid(SHAPE), make_spec(ctx.mesh, (Shard(2),) * ctx.mesh.ndim, SHAPE))
    with pytest.raises(ValueError, match="halo widths must be >= 0"):
        halo_exchange(x, {2: (-1, 1)})
    if ctx.mesh.ndim == 2:
        with pytest.raises(PlacementError, match="sharded by one mesh dim"):
            halo_exchange(x, {2: (1, 1)})
