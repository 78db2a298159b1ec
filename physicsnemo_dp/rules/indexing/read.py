"""Reads with integer indices: ``x[idx]``, ``index_select``, ``gather``, ``embedding``.

Every read is planned from metadata alone (:func:`plan_read`,
:func:`plan_gather`), then executed on local tensors. Per mesh dim the
data tensor ``x`` decides:

* ``x`` sharded along an **indexed** dim: the index is replicated there and
  each rank reads only the entries whose global index falls into its box,
  into a zero-filled output — a pending sum, ``Partial("sum")``. No data
  moves forward; the result is exact once reduced (each entry has exactly
  one owner). The gradient needs no communication either: each rank
  scatters the (replicated) output gradient into the entries it owns.
* ``x`` sharded along another dim: the output keeps that sharding with the
  same shard sizes; the index is replicated there (``gather``: sharded like
  ``x``, clipped to the index's extent).
* ``x`` replicated: the output follows the index's sharding (sharded indices
  give a sharded output, no communication); the gradient of ``x`` is then a
  pending sum over that mesh dim, which whoever consumes it reduces once (a
  promoted weight: in its backward).
* ``x`` pending (``Partial``): the output stays pending (a read is linear).

The index is all-gathered only over mesh dims where it is sharded and ``x``
is not replicated: that moves integers, never the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ...rule_kit import broadcast_shape, normalize_dim, replicated_to_box, shard_tensor_cls, to_layout, wrap
from ._common import (
    SUM,
    as_shard,
    clip_sizes,
    box,
    check_range,
    grad_spec_for,
    localize,
    mesh_of,
    note_index_gather,
    reading_spec,
    relayout_spec,
    replicated_local,
    result_shape,
    sharded_dims,
    spec_like,
    without_partial,
)
from .masks import mask_position, mask_read

aten = torch.ops.aten


# --------------------------------------------------------------------------- #
# x[indices] with integer index tensors (also index_select and embedding)
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class ReadPlan:
    x_spec: object  # layout x is read in
    positions: tuple  # indexed dims of x
    bshape: tuple  # broadcast shape of the index tensors
    index_spec: object  # layout of full-shape index tensors (None: all replicated)
    out_spec: object
    owners: tuple  # indexed dims x shards: entries are filtered by ownership
    pending: frozenset  # mesh dims where x's gradient is a pending sum
    allow_negative: bool


def plan_read(x_spec, index_specs, allow_negative: bool = True) -> ReadPlan:
    """Plan ``x[indices]``; ``index_specs`` has a spec per indexed dim and ``None`` elsewhere."""
    positions = tuple(d for d, s in enumerate(index_specs) if s is not None)
    specs = [s for s in index_specs if s is not None]
    x_spec = reading_spec(x_spec, positions)
    bshape = broadcast_shape(*(s.global_shape for s in specs))
    out_shape, start, where = result_shape(x_spec.global_shape, positions, bshape)
    lead = next((s for s in specs if s.global_shape == bshape), None)
    index_placements, out_placements, pending = [], [], set()
    for m, p in enumerate(x_spec.placements):
        q = lead.placements[m] if lead is not None and issubclass(type(p), Replicate) else Replicate()
        index_placements.append(q if issubclass(type(q), Shard) else Replicate())
        if issubclass(type(p), Shard):
            out_placements.append(SUM if p.dim in positions else Shard(where[p.dim]))
        elif issubclass(type(p), Partial):
            out_placements.append(p)
        elif issubclass(type(q), Shard):
            out_placements.append(Shard(start + q.dim))
            pending.add(m)
        else:
            out_placements.append(Replicate())
    index_spec = relayout_spec(lead, index_placements) if lead is not None else None
    tables = [None] * len(out_shape)
    for d, table in enumerate(x_spec.dim_sizes):
        if table is not None and d not in positions:
            tables[where[d]] = table
    for b, table in enumerate(index_spec.dim_sizes if index_spec is not None else ()):
        if table is not None:
            tables[start + b] = table
    out_spec = spec_like(x_spec, out_placements, out_shape, tables)
    owners = tuple(d for d in positions if d in sharded_dims(x_spec))
    return ReadPlan(x_spec, positions, bshape, index_spec, out_spec, owners, frozenset(pending), allow_negative)


def local_indices(plan: ReadPlan, indices):
    """This rank's index tensors (local coordinates) and the ownership mask (or None)."""
    shards = [t for t in indices if t is not None]
    locals_ = []
    for t in shards:  # all communication first, then the data-dependent checks (index gathers: note_index_gather)
        if plan.index_spec is not None and tuple(t.shape) == plan.bshape:
            locals_.append(to_layout(t, plan.index_spec, implicit=False))
        elif plan.index_spec is not None:
            locals_.append(replicated_to_box(replicated_local(t, implicit=False), plan.index_spec))
        else:
            locals_.append(replicated_local(t, implicit=False))
    owned = None
    out = []
    for d, loc in zip(plan.positions, locals_):
        size = plan.x_spec.global_shape[d]
        if d in plan.owners or not plan.allow_negative:  # the local op would accept negatives
            check_range(loc, size, plan.allow_negative, "indexing", d)
        if d in plan.owners:
            offset, extent = box(plan.x_spec, d)
            loc, mine = localize(loc, size, offset, extent, plan.allow_negative)
            owned = mine if owned is None else owned & mine
        out.append(loc)
    full = [None] * len(plan.x_spec.global_shape)
    for d, loc in zip(plan.positions, out):
        full[d] = loc
    return full[: plan.positions[-1] + 1], owned


def _owned_view(owned, bshape, start, ndim):
    """``owned`` shaped to broadcast against a result whose index dims start at ``start``."""
    owned = owned.expand(bshape)
    return owned.reshape((1,) * start + tuple(bshape) + (1,) * (ndim - start - len(bshape)))


def read_local(plan: ReadPlan, x_local, idx, owned):
    """Local result of the planned read."""
    bshape = broadcast_shape(*(t.shape for t in idx if t is not None))
    shape, start, _ = result_shape(tuple(x_local.shape), plan.positions, bshape)
    if owned is None:
        return aten.index.Tensor(x_local, idx)
    if any(x_local.shape[d] == 0 for d in plan.owners):
        return x_local.new_zeros(shape)
    out = aten.index.Tensor(x_local, idx)
    return torch.where(_owned_view(owned, bshape, start, len(shape)), out, 0)


def put_local(target, idx, values, owned, accumulate: bool) -> None:
    """``target[idx] = values`` (or ``+=``) in place, for owned entries only when ``owned`` is given."""
    if owned is None:
        aten.index_put_(target, idx, values, accumulate)
        return
    positions = [d for d, t in enumerate(idx) if t is not None]
    bshape = broadcast_shape(*(t.shape for t in idx if t is not None))
    shape, start, _ = result_shape(tuple(target.shape), positions, bshape)
    n = 1
    for s in bshape:
        n *= s
    rows = values.expand(shape).reshape(shape[:start] + (n,) + shape[start + len(bshape):])
    sel = owned.expand(bshape).reshape(-1).nonzero().squeeze(1)
    flat = [None if t is None else t.expand(bshape).reshape(-1).index_select(0, sel) for t in idx]
    aten.index_put_(target, flat, rows.index_select(start, sel), accumulate)


def read(x, indices, allow_negative: bool = True):
    """``x[indices]`` on ShardTensors: (result, the plan, local indices, ownership)."""
    mesh = mesh_of(x, *indices)
    x = as_shard(x, mesh)
    indices = [None if t is None else as_shard(t, mesh) for t in indices]
    plan = plan_read(x._spec, [None if t is None else t._spec for t in indices], allow_negative)
    _, start, _ = result_shape(plan.x_spec.global_shape, plan.positions, plan.bshape)
    note_index_gather(plan.x_spec, [t._spec for t in indices if t is not None], plan.out_spec, start, len(plan.bshape))
    idx, owned = local_indices(plan, indices)
    out = read_local(plan, to_layout(x, plan.x_spec), idx, owned)
    return wrap(out, plan.out_spec), plan, idx, owned


def read_backward(plan: ReadPlan, grad, idx, owned):
    """Gradient of ``x`` for the planned read: output gradient scattered into the owned entries."""
    g = to_layout(as_shard(grad, plan.x_spec.mesh), without_partial(plan.out_spec))
    acc = g.new_zeros(tuple(plan.x_spec.local_shape))
    put_local(acc, idx, g, owned, accumulate=True)
    return wrap(acc, grad_spec_for(plan.x_spec, plan.pending))


def as_vector_index(index):
    """A 0-d index as a 1-element vector (``index_select`` keeps the dim)."""
    if index.ndim == 1:
        return index
    if index.ndim != 0:
        raise IndexError(f"index_select(): index must be 0-d or 1-d, got {index.ndim}-d")
    if isinstance(index, shard_tensor_cls()):
        spec = index._spec
        local = to_layout(index, without_partial(spec)).reshape(1)
        return wrap(local, spec_like(spec, without_partial(spec).placements, (1,), (None,)))
    return index.reshape(1)


def select_indices(x, dim: int, index):
    """``index_select(x, dim, index)`` as an indexing list."""
    dim = normalize_dim(dim, x.ndim)
    return [None] * dim + [as_vector_index(index)]


# --------------------------------------------------------------------------- #
# gather
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class GatherPlan:
    x_spec: object
    dim: int
    index_spec: object
    out_spec: object
    pending: frozenset


def plan_gather(x_spec, dim: int, index_spec) -> GatherPlan:
    x_spec = reading_spec(x_spec, [dim])
    positional = sharded_dims(x_spec) - {dim}
    placements, out_placements, tables, pending = [], [], {}, set()
    for m, p in enumerate(x_spec.placements):
        q = index_spec.placements[m]
        if issubclass(type(p), Shard) and p.dim != dim:
            placements.append(p)
            out_placements.append(p)
            tables[p.dim] = clip_sizes(x_spec.dim_sizes[p.dim], index_spec.global_shape[p.dim])
        elif issubclass(type(p), Replicate) and issubclass(type(q), Shard) and q.dim not in positional:
            placements.append(q)
            out_placements.append(q)
            pending.add(m)
        else:
            placements.append(Replicate())
            out_placements.append(SUM if issubclass(type(p), Shard) else (p if issubclass(type(p), Partial) else Replicate()))
    index_target = relayout_spec(index_spec, placements, tables)
    out_spec = spec_like(x_spec, out_placements, index_spec.global_shape, index_target.dim_sizes)
    return GatherPlan(x_spec, dim, index_target, out_spec, frozenset(pending))


def _aligned(plan: GatherPlan, x_local):
    """``x_local`` narrowed so that its first rows along each dim match the local index's."""
    x_off, i_off = plan.x_spec.local_offsets(), plan.index_spec.local_offsets()
    i_shape = plan.index_spec.local_shape
    for d in range(x_local.ndim):
        if d == plan.dim or plan.index_spec.dim_sizes[d] is None or i_shape[d] == 0:
            continue
        start = i_off[d] - x_off[d]
        x_local = x_local.narrow(d, start, x_local.shape[d] - start)
    return x_local


def gather(x, dim: int, index):
    """``torch.gather`` on ShardTensors: (result, plan, local index, ownership)."""
    mesh = mesh_of(x, index)
    x, index = as_shard(x, mesh), as_shard(index, mesh)
    dim = normalize_dim(dim, x.ndim)
    plan = plan_gather(x._spec, dim, index._spec)
    note_index_gather(plan.x_spec, [index._spec], plan.out_spec, 0, index.ndim)
    idx = to_layout(index, plan.index_spec, implicit=False)
    x_local = _aligned(plan, to_layout(x, plan.x_spec))
    owned = None
    if dim in sharded_dims(plan.x_spec):
        size = plan.x_spec.global_shape[dim]
        check_range(idx, size, False, "gather", dim)
        offset, extent = box(plan.x_spec, dim)
        idx, owned = localize(idx, size, offset, extent, False)
        if extent == 0:
            return wrap(x_local.new_zeros(idx.shape), plan.out_spec), plan, idx, owned
        out = torch.where(owned, x_local.gather(dim, idx), 0)
    else:
        out = x_local.gather(dim, idx)
    return wrap(out, plan.out_spec), plan, idx, owned


def gather_backward(plan: GatherPlan, grad, idx, owned):
    g = to_layout(as_shard(grad, plan.x_spec.mesh), without_partial(plan.out_spec))
    acc = g.new_zeros(tuple(plan.x_spec.local_shape))
    if acc.shape[plan.dim] > 0:
        src = g if owned is None else torch.where(owned, g, 0)
        _aligned(plan, acc).scatter_add_(plan.dim, idx, src)
    return wrap(acc, grad_spec_for(plan.x_spec, plan.pending))


# --------------------------------------------------------------------------- #
# embedding backward (the forward is a read of the weight's rows)
# --------------------------------------------------------------------------- #
def embedding_dense_backward(grad, indices, num_weights: int, padding_idx: int, scale_grad_by_freq: bool):
    """Weight gradient laid out by the output gradient's sharding.

    Output rows sharded like the indices give a pending sum (each rank adds
    its rows' contributions); a sharded embedding dim gives a weight gradient
    sharded the same way. ``scale_grad_by_freq`` needs global counts, so
    there the indices and gradient are gathered first.
    """
    mesh = mesh_of(grad, indices)
    grad, indices = as_shard(grad, mesh), as_shard(indices, mesh)
    nidx = indices.ndim
    g_spec = grad._spec
    g_placements, i_placements, w_placements = [], [], []
    for p in g_spec.placements:
        if issubclass(type(p), Shard) and p.dim < nidx and not scale_grad_by_freq:
            g_placements.append(p), i_placements.append(p), w_placements.append(SUM)
        elif issubclass(type(p), Shard) and p.dim == nidx:
            g_placements.append(p), i_placements.append(Replicate()), w_placements.append(Shard(1))
        elif p == SUM:
            g_placements.append(p), i_placements.append(Replicate()), w_placements.append(p)
        else:
            g_placements.append(Replicate()), i_placements.append(Replicate()), w_placements.append(Replicate())
    g_target = relayout_spec(g_spec, g_placements)
    i_target = indices._spec.with_layout(i_placements, g_target.dim_sizes[:nidx])
    g_local, i_local = to_layout(grad, g_target), to_layout(indices, i_target)
    out = aten.embedding_dense_backward(g_local, i_local, num_weights, padding_idx, scale_grad_by_freq)
    spec = spec_like(g_spec, w_placements, (num_weights, g_spec.global_shape[-1]), (None, g_target.dim_sizes[-1]))
    return wrap(out, spec)


# --------------------------------------------------------------------------- #
# dispatch rules (forward reads reached below autograd, and reads in backward formulas)
# --------------------------------------------------------------------------- #
def _index_rule(func, args, kwargs):
    x, indices = args[0], list(args[1])
    if mask_position(indices) is not None:
        return mask_read(x, indices)[0]
    return read(x, indices)[0]


def _index_select_rule(func, args, kwargs):
    x, dim, index = args
    return read(x, select_indices(x, dim, index), allow_negative=False)[0]


def _gather_rule(func, args, kwargs):
    x, dim, index = args[:3]
    return gather(x, dim, index)[0]


def _embedding_rule(func, args, kwargs):
    weight, indices = args[:2]
    return read(weight, [indices], allow_negative=False)[0]


def _embedding_backward_rule(func, args, kwargs):
    return embedding_dense_backward(*args, **kwargs)


RULES = {
    aten.index.Tensor: _index_rule,
    aten.index_select.default: _index_select_rule,
    aten.gather.default: _gather_rule,
    aten.embedding.default: _embedding_rule,
    aten.embedding_dense_backward.default: _embedding_backward_rule,
}
