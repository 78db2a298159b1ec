"""Halo exchange (convolution) and ring attention traffic, against the minimum each needs.

* **Halo**: a 3x3 convolution (padding 1) on uneven shards along one spatial
  dim (1-D mesh) and along two (2-D mesh, when the world size factors as
  ``a x b`` with ``a, b >= 2``). A rank that owns outputs must receive the
  input rows of its window that it does not hold: the window clipped to the
  domain minus its own box (zero padding is never sent). Backward returns
  exactly those rows' gradients, so its minimum is the same.
* **Ring attention**: ``F.scaled_dot_product_attention`` with queries, keys
  and values sharded along the sequence (uneven, an empty shard when P > 2).
  Forward, every rank must receive every other rank's key/value block. Backward
  with O(local) memory must receive them again (they are not kept) and ship
  each block's gradient contributions to its owner: with additive reduction
  along any schedule, ``P - 1`` contributions of the block's size per block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensor, ShardTensorSpec, count_collectives
from physicsnemo_dp.collectives import mesh_device

from .._models import global_input, uneven_sizes
from .._record import Result, over_ranks

SUITE = "comm_volume"
_HALO = "halo"
_RING = "send_recv"


def _factor(P: int) -> tuple[int, int] | None:
    """``(a, b)`` with ``a * b == P``, both >= 2 and ``a`` as large as possible up to sqrt(P); None if prime."""
    for a in range(math.isqrt(P), 1, -1):
        if P % a == 0:
            return a, P // a
    return None


def _sharded(g: torch.Tensor, mesh, placements, tables, requires_grad: bool) -> ShardTensor:
    spec = ShardTensorSpec.from_sizes(mesh, placements, tuple(g.shape), g.dtype, tables)
    box = tuple(slice(o, o + n) for o, n in zip(spec.local_offsets(), spec.local_shape))
    return ShardTensor.from_spec(g[box].clone().to(mesh_device(mesh)), spec).requires_grad_(requires_grad)


def _halo_minimum(spec, dims: tuple[int, ...], channels: int, elem: int) -> int:
    """Bytes of this rank's 3x3 window (clipped to the domain) that other ranks hold."""
    offsets, shape = spec.local_offsets(), spec.local_shape
    if any(shape[d] == 0 for d in dims):
        return 0  # no outputs, no window
    window = own = 1
    for d in dims:
        lo, hi = max(offsets[d] - 1, 0), min(offsets[d] + shape[d] + 1, spec.global_shape[d])
        window *= hi - lo
        own *= shape[d]
    rest = math.prod(shape[d] for d in range(2, len(shape)) if d not in dims)
    return (window - own) * rest * channels * elem


def _conv_halo(mesh, label: str, size: int, channels: int, placements, tables, dims) -> list[Result]:
    P = mesh.size()
    torch.manual_seed(0)
    conv = nn.Conv2d(channels, channels, 3, padding=1).to(mesh_device(mesh))
    x = _sharded(global_input((1, channels, size, size)), mesh, placements, tables, requires_grad=True)
    with count_collectives() as fwd:
        y = conv(x)
    with count_collectives() as bwd:
        y.backward(torch.ones_like(y))
    minimum = over_ranks(_halo_minimum(x.spec, dims, channels, 4))
    return [
        Result(SUITE, f"halo, conv 3x3, {label}, forward", P, over_ranks(fwd.bytes_received[_HALO]), minimum,
               "bytes", ("<=", 1.1)),
        Result(SUITE, f"halo, conv 3x3, {label}, backward", P, over_ranks(bwd.bytes_received[_HALO]), minimum,
               "bytes", ("<=", 1.1)),
    ]  # fmt: skip


def halo(mesh, size: int, channels: int) -> list[Result]:
    P = mesh.size()
    results = _conv_halo(mesh, "1 sharded dim (uneven)", size, channels, [Shard(2)],
                         (None, None, uneven_sizes(size, P), None), (2,))  # fmt: skip
    grid = _factor(P)
    if grid is not None:
        mesh2d = DeviceMesh(mesh.device_type, torch.arange(P).reshape(grid), mesh_dim_names=("rows", "cols"))
        tables = (None, None, uneven_sizes(size, grid[0]), uneven_sizes(size, grid[1]))
        results += _conv_halo(mesh2d, f"2 sharded dims on {grid[0]}x{grid[1]} (uneven)", size, channels,
                              [Shard(2), Shard(3)], tables, (2, 3))  # fmt: skip
    return results


def ring(mesh, seq: int, heads: int, head_dim: int) -> list[Result]:
    """Forward and backward bytes of ring attention over the minimum (see the module docstring)."""
    P, me, elem = mesh.size(), mesh.get_local_rank(), 4
    sizes = uneven_sizes(seq, P)
    tables = (None, None, sizes, None)
    q, k, v = (
        _sharded(global_input((1, heads, seq, head_dim), seed), mesh, [Shard(2)], tables, requires_grad=True)
        for seed in (1, 2, 3)
    )
    with count_collectives() as fwd:
        out = F.scaled_dot_product_attention(q, k, v)
    with count_collectives() as bwd:
        out.backward(torch.ones_like(out))
    block = 2 * heads * head_dim * elem  # bytes of one token's key + value
    others = (seq - sizes[me]) * block
    return [
        Result(SUITE, "ring attention, forward (uneven)", P, over_ranks(fwd.bytes_received[_RING]),
               over_ranks(others), "bytes", ("<=", 1.1)),
        Result(SUITE, "ring attention, backward (uneven)", P, over_ranks(bwd.bytes_received[_RING]),
               over_ranks(others + (P - 1) * sizes[me] * block), "bytes", ("<=", 1.1)),
    ]  # fmt: skip
