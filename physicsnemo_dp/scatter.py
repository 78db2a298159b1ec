"""``scatter_tensor``: distribute a tensor that one rank holds.

Every rank first contributes a few ints of metadata to one all-gather (the
source its tensor's shape and dtype, every rank its arguments and whether they
were valid), so every rank validates the same facts and raises the same error
— never a hang, also when only one rank passed a wrong argument. The data
then travels mesh dim by mesh dim: at stage ``m`` each rank that holds a block
splits it by the placement of mesh dim ``m`` and sends every member of its
group only the part that member's subtree needs. On a 1-D mesh this is one all-to-all in which each rank receives exactly
its shard; on an n-D mesh a block may be relayed once per mesh dim.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from . import _agreement, _layout, collectives
from ._plan import marginal
from .errors import PlacementError
from .split import offsets_from_sizes
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec

__all__ = ["scatter_tensor"]


def _coords_of(mesh: DeviceMesh, global_rank: int) -> tuple[int, ...] | None:
    hits = (mesh.mesh == global_rank).nonzero()
    return tuple(int(c) for c in hits[0]) if len(hits) else None


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
    if issubclass(type(placement), Replicate) or (issubclass(type(placement), Partial) and placement.reduce_op != "sum"):
        shape = _subtree_shape(spec, coord, m)
        buf = block if holder else torch.empty(shape, dtype=spec.tensor_meta.dtype, device=collectives.mesh_device(mesh))
        return collectives.broadcast(buf, src_m, mesh, m)
    if issubclass(type(placement), Partial):  # pending sum: the source keeps the value, others contribute zero
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
    source's tensor; the result is a leaf that requires grad if asked. Every
    argument is compared across ranks first (one all-gather of a few ints), so
    a mistake on any rank raises the same error on every rank.
    """
    me = torch.distributed.get_rank()
    _, error = _agreement.with_checked_arguments(lambda: _check_arguments(tensor, global_src, mesh, dtype, me))
    is_src = error is None and me == global_src
    keys = (
        global_src if isinstance(global_src, int) and not isinstance(global_src, bool) else -1,
        _agreement.dtype_code(dtype) if isinstance(dtype, torch.dtype) else -2,
    )
    row = _agreement.row(
        "scatter_tensor",
        error,
        mesh,
        local=tensor if is_src else None,
        placements=placements,
        global_shape=global_shape,
        keys=keys,
    )
    table = _agreement.exchange(row, error, mesh, "scatter_tensor")
    if len({f.keys for f in table}) > 1:
        raise PlacementError(
            "scatter_tensor: ranks passed different global_src or dtype ("
            + "; ".join(f"rank {f.rank}: global_src={f.keys[0]}, dtype={_dtype_name(f.keys[1])}" for f in table)
            + "); pass the same values on every rank"
        )
    source = next(f for f in table if f.rank == global_src)
    src_shape = source.shape
    _agreement.global_shape_matches(table, src_shape, "scatter_tensor", f"the source tensor's shape {src_shape}")
    placements = _agreement.same_placements(table, mesh.ndim, source.ndim)
    out_dtype = dtype or _agreement.DTYPES[source.dtype]
    spec = ShardTensorSpec.chunked(mesh, placements, src_shape, out_dtype)
    src = _coords_of(mesh, global_src)
    coord = tuple(mesh.get_coordinate())
    block = tensor.detach().to(out_dtype).contiguous() if me == global_src else None
    for m in range(mesh.ndim):
        if coord[m + 1 :] == tuple(src[m + 1 :]):
            block = _scatter_stage(block, spec, coord, m, src[m])
    local = block.contiguous()
    if me == global_src and local.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        local = local.clone()  # never alias the caller's tensor
    return ShardTensor(local, spec, requires_grad=requires_grad)


def _check_arguments(tensor, global_src, mesh: DeviceMesh, dtype, me: int) -> None:
    """This rank's own argument checks (raised by every rank after the exchange, never before)."""
    if isinstance(global_src, bool) or not isinstance(global_src, int):
        raise ValueError(f"global_src must be an int rank, got {global_src!r}")
    if _coords_of(mesh, global_src) is None:
        raise ValueError(f"global_src={global_src} is not a rank of the mesh {mesh.mesh.tolist()}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"scatter_tensor: dtype must be a torch.dtype or None, got {dtype!r}")
    if me != global_src:
        return
    if not isinstance(tensor, torch.Tensor) or tensor.ndim > _agreement.MAX_NDIM:
        raise ValueError(
            f"scatter_tensor: the source rank {global_src} must pass a torch.Tensor "
            f"(of at most {_agreement.MAX_NDIM} dims) as `tensor`"
        )
    if tensor.device.type != mesh.device_type:
        raise ValueError(
            f"scatter_tensor: the source tensor is not on a {mesh.device_type!r} device like the "
            "mesh; move it there first"
        )
    if _agreement.dtype_code(tensor.dtype) < 0:
        raise ValueError(f"scatter_tensor: the source tensor's dtype {tensor.dtype} is not supported")


def _dtype_name(code: int) -> str:
    return "None" if code == -2 else str(_agreement.DTYPES[code]) if code >= 0 else "unsupported"
