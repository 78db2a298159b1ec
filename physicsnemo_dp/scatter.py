"""``scatter_tensor``: distribute a tensor that one rank holds.

The source first broadcasts a few ints of metadata (shape, dtype, and whether
its input is valid) so every rank validates the same facts and raises the same
error — never a hang. The data then travels mesh dim by mesh dim: at stage
``m`` each rank that holds a block splits it by the placement of mesh dim ``m``
and sends every member of its group only the part that member's subtree
needs. On a 1-D mesh this is one all-to-all in which each rank receives exactly
its shard; on an n-D mesh a block may be relayed once per mesh dim.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from . import _layout, collectives
from ._plan import marginal
from .split import offsets_from_sizes
from .shard_tensor import _DTYPES, _MAX_NDIM, ShardTensor
from .spec import ShardTensorSpec

__all__ = ["scatter_tensor"]

_OK, _NOT_A_TENSOR, _WRONG_DEVICE = 1, 0, 2


def _coords_of(mesh: DeviceMesh, global_rank: int) -> tuple[int, ...] | None:
    hits = (mesh.mesh == global_rank).nonzero()
    return tuple(int(c) for c in hits[0]) if len(hits) else None


def _broadcast_ints(values: list[int] | None, n: int, src: Sequence[int], mesh: DeviceMesh) -> list[int]:
    """Stage-wise broadcast of ``n`` ints from mesh coordinate ``src``."""
    coord = tuple(mesh.get_coordinate())
    buf = torch.tensor(values if values is not None else [0] * n, dtype=torch.int64, device=collectives.mesh_device(mesh))
    for m in range(mesh.ndim):
        if coord[m + 1 :] == tuple(src[m + 1 :]):
            buf = collectives.broadcast(buf, src[m], mesh, m)
    return buf.tolist()


def _subtree_shape(spec: ShardTensorSpec, coord, upto: int) -> list[int]:
    """Shape of the block covering every rank that shares ``coord`` on mesh dims <= ``upto``."""
    shape = []
    for d, extent in enumerate(spec.global_shape):
        table = spec.dim_sizes[d]
        if table is None:
            shape.append(extent)
            continue
        dims = _layout.sharding_mesh_dims(spec.placements, d)
        keep = [x for x in dims if x <= upto]
        sub = marginal(table, dims, spec.mesh_shape, keep)
        shape.append(extent if sub is None else sub[_layout.table_index(spec.mesh_shape, keep, coord)])
    return shape


def _scatter_stage(block, spec: ShardTensorSpec, coord, m: int, src_m: int) -> torch.Tensor:
    mesh = spec.mesh
    placement = spec.placements[m]
    group = mesh.size(m)
    holder = coord[m] == src_m
    if group == 1:
        return block
    if placement.is_replicate() or (placement.is_partial() and placement.reduce_op != "sum"):
        shape = _subtree_shape(spec, coord, m)
        buf = block if holder else torch.empty(shape, dtype=spec.tensor_meta.dtype, device=collectives.mesh_device(mesh))
        return collectives.broadcast(buf, src_m, mesh, m)
    if placement.is_partial():  # pending sum: the source keeps the value, others contribute zero
        return block if holder else torch.zeros(_subtree_shape(spec, coord, m), dtype=spec.tensor_meta.dtype, device=collectives.mesh_device(mesh))
    d = placement.dim
    member_shapes = []
    for i in range(group):
        c = list(coord)
        c[m] = i
        member_shapes.append(_subtree_shape(spec, c, m))
    if holder:
        sizes = [s[d] for s in member_shapes]
        pieces = [block.narrow(d, o, n).reshape(-1) for o, n in zip(offsets_from_sizes(sizes), sizes)]
        send = torch.cat(pieces)
        in_splits = [p.numel() for p in pieces]
    else:
        send = torch.empty(0, dtype=spec.tensor_meta.dtype, device=collectives.mesh_device(mesh))
        in_splits = [0] * group
    mine = member_shapes[coord[m]]
    out_splits = [0] * group
    out_splits[src_m] = int(torch.Size(mine).numel())
    received = collectives.all_to_all_v(send, in_splits, out_splits, mesh, m, kind="scatter")
    return received.reshape(mine)


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> ShardTensor:
    """Split ``tensor``, held by global rank ``global_src``, over ``mesh`` as ``placements``.

    Other ranks may pass ``None``. Shard sizes follow the one split rule.
    ``global_shape`` and ``dtype``, when given, are checked against the
    source's tensor; the result is a leaf that requires grad if asked.
    """
    if isinstance(global_src, bool) or not isinstance(global_src, int):
        raise ValueError(f"global_src must be an int rank, got {global_src!r}")
    src = _coords_of(mesh, global_src)
    if src is None:
        raise ValueError(f"global_src={global_src} is not a rank of the mesh {mesh.mesh.tolist()}")
    me = torch.distributed.get_rank()
    header = None
    if me == global_src:
        header = [_NOT_A_TENSOR] + [0] * (_MAX_NDIM + 2)
        if isinstance(tensor, torch.Tensor) and tensor.ndim <= _MAX_NDIM:
            code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
            status = _OK if tensor.device.type == mesh.device_type else _WRONG_DEVICE
            header = [status, tensor.ndim, code, *tensor.shape, *([0] * (_MAX_NDIM - tensor.ndim))]
    status, ndim, code, *shape = _broadcast_ints(header, _MAX_NDIM + 3, src, mesh)
    if status == _NOT_A_TENSOR:
        raise ValueError(
            f"scatter_tensor: the source rank {global_src} must pass a torch.Tensor "
            f"(of at most {_MAX_NDIM} dims) as `tensor`"
        )
    if status == _WRONG_DEVICE:
        raise ValueError(
            f"scatter_tensor: the source tensor is not on a {mesh.device_type!r} device like the "
            "mesh; move it there first"
        )
    if code < 0:
        raise ValueError("scatter_tensor: the source tensor's dtype is not supported")
    src_shape = tuple(shape[:ndim])
    src_dtype = _DTYPES[code]
    if global_shape is not None and tuple(global_shape) != src_shape:
        raise ValueError(f"scatter_tensor: global_shape={tuple(global_shape)} but the source tensor has shape {src_shape}")
    out_dtype = dtype or src_dtype
    placements = _layout.normalize_placements(placements, mesh.ndim, ndim)
    spec = ShardTensorSpec.chunked(mesh, placements, src_shape, out_dtype)
    coord = tuple(mesh.get_coordinate())
    block = tensor.detach().to(out_dtype).contiguous() if me == global_src else None
    for m in range(mesh.ndim):
        if coord[m + 1 :] == tuple(src[m + 1 :]):
            block = _scatter_stage(block, spec, coord, m, src[m])
    local = block.contiguous()
    if me == global_src and local.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        local = local.clone()  # never alias the caller's tensor
    return ShardTensor(local, spec, requires_grad=requires_grad)

