"""Boolean masks: ``x[mask]``, ``masked_select``, ``nonzero`` and ``x[mask] = v``.

Their output size depends on the data, so the layout is defined here:

* The selected elements come out in global row-major order, like torch. Each
  rank selects from its own box, and the concatenation of the ranks' pieces
  in mesh order is row-major only when the mask is sharded along its
  *leading* dim alone. So a mesh dim that shards a later masked dim first
  moves its shard to the leading one (one all-to-all); a replicated ``x``
  with a sharded mask is sliced to the mask's boxes (no communication).
* The output's selected dim is sharded over the mesh dims that shard the
  leading masked dim, with each rank's *count* as its shard size. Every rank
  learns all counts from one all-gather of one int per rank (the only
  communication of a forward ``x[mask]`` whose mask is laid out like ``x``).
  With no sharded masked dim, nothing moves and the dim is whole everywhere.
* The gradient is scattered back into the owned boxes locally.

``x[mask] = v`` writes in place, so ``x`` cannot move: a ``v`` that
broadcasts along the selected dim needs no communication; a full ``v`` is
matched to the elements by their global row-major rank, which takes the
whole mask (an all-gather of bools) and ``v`` replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from ... import _layout
from ...rule_kit import broadcast_shape, shard_tensor_cls, to_layout, wrap
from ._common import (
    as_shard,
    box,
    gather_count_table,
    mesh_of,
    relayout_spec,
    replicated_local,
    spec_like,
    to_input_layout,
    without_partial,
)

aten = torch.ops.aten


def is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def mask_position(indices):
    """Index of the (single) boolean mask among ``indices``, or None if there is none."""
    masks = [i for i, t in enumerate(indices) if is_mask(t)]
    if not masks:
        return None
    if len(masks) > 1 or any(t is not None for t in indices if not is_mask(t)):
        raise NotImplementedError(
            "ShardTensor indexing supports one boolean mask as the only tensor index; "
            "for several masks or masks mixed with integer indices, convert the masks "
            "first: x[mask.nonzero(as_tuple=True)] or x[mask.nonzero()[:, 0], idx]"
        )
    return masks[0]


def _bool_local(local):
    return local if local.dtype == torch.bool else local.bool()


# --------------------------------------------------------------------------- #
# x[mask] (a k-dim mask on dims p .. p+k-1)
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class MaskPlan:
    x_spec: object  # layout x is read in
    mask_spec: object
    p: int
    masked: tuple  # mesh dims that shard the selected dim


def plan_mask(x_spec, mask_spec, p: int) -> MaskPlan:
    k = len(mask_spec.global_shape)
    placements, masked = [], []
    for m, px in enumerate(x_spec.placements):
        if (issubclass(type(px), Shard) and p <= px.dim < p + k) or (issubclass(type(px), Replicate) and issubclass(type(mask_spec.placements[m]), Shard)):
            placements.append(Shard(p))
            masked.append(m)
        else:
            placements.append(px)
    tables = {}
    if (
        masked
        and all(issubclass(type(x_spec.placements[m]), Replicate) for m in masked)
        and _layout.sharding_mesh_dims(mask_spec.placements, 0) == tuple(masked)
    ):
        tables[p] = mask_spec.dim_sizes[0]  # slice x to the mask's boxes: nothing moves
    x_target = relayout_spec(x_spec, placements, tables)
    mask_target = mask_spec.with_layout(
        [Shard(0) if m in masked else Replicate() for m in range(len(placements))],
        (x_target.dim_sizes[p],) + (None,) * (k - 1),
    )
    return MaskPlan(x_target, mask_target, p, tuple(masked))


def selected_spec(plan: MaskPlan, count: int):
    """Spec of the selection: the masked dims collapse into one dim of ``count``-per-rank sizes."""
    x_spec, p = plan.x_spec, plan.p
    k = len(plan.mask_spec.global_shape)

    def new_dim(d):
        return d if d < p else d - k + 1

    placements = [
        Shard(p) if m in plan.masked else (Shard(new_dim(q.dim)) if issubclass(type(q), Shard) else q)
        for m, q in enumerate(x_spec.placements)
    ]
    shape = list(x_spec.global_shape[:p]) + [0] + list(x_spec.global_shape[p + k:])
    tables = list(x_spec.dim_sizes[:p]) + [None] + list(x_spec.dim_sizes[p + k:])
    if plan.masked:
        tables[p] = gather_count_table(count, x_spec.mesh, plan.masked)
        shape[p] = sum(tables[p])
    else:
        shape[p] = count
    return spec_like(x_spec, placements, shape, tables)


def mask_read(x, indices):
    """``x[indices]`` with one boolean mask: (result, plan, local mask)."""
    p = mask_position(indices)
    mesh = mesh_of(x, *[t for t in indices if t is not None])
    x, mask = as_shard(x, mesh), as_shard(indices[p], mesh)
    plan = plan_mask(x._spec, mask._spec, p)
    m_local = _bool_local(to_layout(mask, plan.mask_spec))
    out = aten.index.Tensor(to_layout(x, plan.x_spec), [None] * p + [m_local])
    return wrap(out, selected_spec(plan, int(m_local.sum()))), plan, m_local


def mask_read_backward(plan: MaskPlan, out_spec, grad, m_local, input_spec):
    g = to_layout(as_shard(grad, plan.x_spec.mesh), without_partial(out_spec))
    acc = g.new_zeros(tuple(plan.x_spec.local_shape))
    aten.index_put_(acc, [None] * plan.p + [m_local], g, True)
    return wrap(*to_input_layout(acc, without_partial(plan.x_spec), input_spec))


def masked_select(x, mask):
    """``torch.masked_select``: ``x[mask]`` after broadcasting both to one shape."""
    mesh = mesh_of(x, mask)
    x, mask = as_shard(x, mesh), as_shard(mask, mesh)
    shape = broadcast_shape(tuple(x.shape), tuple(mask.shape))
    if tuple(x.shape) != shape:  # a broadcast x is replicated data anyway
        x = as_shard(replicated_local(x).expand(shape), mesh)
    if tuple(mask.shape) != shape:
        mask = as_shard(replicated_local(mask).expand(shape), mesh)
    return mask_read(x, [mask])


# --------------------------------------------------------------------------- #
# nonzero
# --------------------------------------------------------------------------- #
def nonzero(x):
    """Global coordinates of the nonzero elements, ``(count, ndim)``, rows sharded by rank counts."""
    spec = x._spec
    placements = [Shard(0) if issubclass(type(p), Shard) else Replicate() for p in spec.placements]
    target = relayout_spec(spec, placements) if spec.global_shape else without_partial(spec)
    local = to_layout(x, target)
    coords = torch.nonzero(local)
    if coords.numel():
        coords = coords + torch.tensor(target.local_offsets(), dtype=coords.dtype, device=coords.device)
    masked = tuple(m for m, p in enumerate(target.placements) if issubclass(type(p), Shard))
    out_placements = [Shard(0) if issubclass(type(p), Shard) else Replicate() for p in target.placements]
    ndim = len(spec.global_shape)
    if masked:
        table = gather_count_table(coords.shape[0], spec.mesh, masked)
        out = spec_like(spec, out_placements, (sum(table), ndim), (table, None), torch.int64)
    else:
        out = spec_like(spec, out_placements, (coords.shape[0], ndim), (None, None), torch.int64)
    return wrap(coords, out)


# --------------------------------------------------------------------------- #
# x[mask] = v
# --------------------------------------------------------------------------- #
def mask_put_(x, p: int, mask, values, accumulate: bool) -> None:
    """Write ``values`` into the elements of ``x`` (already without pending sums) selected by ``mask``."""
    mesh = x._spec.mesh
    mask = as_shard(mask, mesh)
    k = mask.ndim
    spec = x._spec
    mask_spec = mask._spec.with_layout(
        [Shard(q.dim - p) if issubclass(type(q), Shard) and p <= q.dim < p + k else Replicate() for q in spec.placements],
        spec.dim_sizes[p : p + k],
    )
    m_local = _bool_local(to_layout(mask, mask_spec))
    r_ndim = len(spec.global_shape) - k + 1
    values = replicated_local(values) if isinstance(values, shard_tensor_cls()) else values
    lead = r_ndim - values.ndim
    count_dim = p - lead
    if count_dim >= 0 and values.shape[count_dim] != 1:
        rank = replicated_local(mask).reshape(-1).long().cumsum(0) - 1
        rank = rank.reshape(tuple(mask.shape))
        for j in range(k):
            offset, extent = box(spec, p + j)
            rank = rank.narrow(j, offset, extent)
        values = values.index_select(count_dim, rank[m_local])
    for d in sorted({q.dim for q in spec.placements if issubclass(type(q), Shard)} - set(range(p, p + k))):
        vd = (d if d < p else d - k + 1) - lead  # slice the other dims to this rank's box
        if vd >= 0 and values.shape[vd] != 1:
            offset, extent = box(spec, d)
            values = values.narrow(vd, offset, extent)
    aten.index_put_(x._local_tensor, [None] * p + [m_local], values, accumulate)


def _masked_select_rule(func, args, kwargs):
    return masked_select(*args)[0]


def _nonzero_rule(func, args, kwargs):
    return nonzero(args[0])


RULES = {
    aten.masked_select.default: _masked_select_rule,
    aten.nonzero.default: _nonzero_rule,
}
