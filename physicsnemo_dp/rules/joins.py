"""Joining and splitting along and across the sharded dim, with their backward ops.

``slice`` (``narrow``, ``x[a:b:s]``, ``tensor_split``), ``split`` /
``split_with_sizes`` (``chunk``), ``select``, ``unbind``, ``cat``, ``stack``,
and the backward ops ``slice_backward`` / ``select_backward`` (``cat``'s
backward is slices, ``split``'s is ``cat``, ``stack``'s is ``select``,
``unbind``'s is ``stack``). Interval arithmetic is in
:mod:`physicsnemo_dp._intervals`.

Communication, per op:

* ``slice``/``split`` along a sharded dim: none. Each output keeps, on every
  rank, the intersection of that rank's slab with the output's range, so its
  shards are as uneven as that makes them (possibly empty). Across other
  dims: local.
* ``select`` along a sharded dim: the owning rank broadcasts the slice over the
  mesh dims that shard the dim (output Replicate there). Across other dims:
  local.
* ``unbind`` along a sharded dim: one all-to-all moves the shard to the largest
  other dim (gather if none is free), then every output is a local view,
  sharded on that dim.
* ``cat`` across the sharded dims and ``stack``: operands are brought to the
  layout of the first sharded operand (nothing moves when they already share
  it); the output keeps it.
* ``cat`` along a sharded dim: none when the operands' slabs already follow
  each other in rank order (pieces cut by ``split``/``slice`` from one tensor,
  so ``split``'s backward is free; a replicated operand such as a class token
  or a boundary row next to a sharded one); the output's shard sizes are the
  sums. A replicated operand goes whole to the neighbouring rank: that rank
  then holds at most one extra copy of data every rank already held.
  Otherwise the output takes the split rule's sizes and each operand moves,
  in one all-to-all, exactly the part of it another rank's output slab covers
  (replicated operands are only sliced).
* ``slice_backward``: none; each rank writes its gradient into zeros of a slab
  that covers it, the slabs as close to the split rule's as that allows (the
  output layout is computed from the gradient's, see
  :func:`physicsnemo_dp._intervals.scatter_table`).
* ``select_backward``: none; the selected dim is inserted unsharded (the
  mirror of the forward's output).

``index_select`` and advanced indexing live in ``indexing.py``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate

from .. import _intervals, _layout, collectives
from .._reshape import nested_chunks
from ..rule_kit import normalize_dim, shard_tensor_cls, to_layout, unshard_dims, wrap
from .views import derived_spec, meta_like, ndim_of, with_new_dim, without_dim

aten = torch.ops.aten


def _arguments(func, args, kwargs) -> list:
    """Positional values of every schema argument, defaults filled in."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out.append(args[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        else:
            out.append(a.default_value)
    return out


def _flat_index(spec, dim: int) -> int:
    """This rank's position in the size table of ``dim``."""
    mesh_dims = _layout.sharding_mesh_dims(spec.placements, dim)
    return _layout.table_index(spec.mesh_shape, mesh_dims, spec.coordinate)


def _replace(seq, i, value):
    return tuple(seq[:i]) + (value,) + tuple(seq[i + 1 :])


# --------------------------------------------------------------------------- #
# slice / split / narrow_copy
# --------------------------------------------------------------------------- #
def sliced(x, dim: int, start, end, step: int = 1):
    """``x[..., start:end:step, ...]`` along ``dim`` without communication (a local view)."""
    spec, local = x._spec, x._local_tensor
    size = spec.global_shape[dim]
    start, end, step = _intervals.normalize_slice(size, start, end, step)
    table = spec.dim_sizes[dim]
    if table is None:
        out_local = aten.slice.Tensor(local, dim, start, end, step)
        tables = spec.dim_sizes
        extent = out_local.shape[dim]
    else:
        per_shard = _intervals.slice_table(table, start, end, step)
        first, count = per_shard[_flat_index(spec, dim)]
        out_local = aten.slice.Tensor(local, dim, first, first + (count - 1) * step + 1 if count else first, step)
        new_table = tuple(c for _, c in per_shard)
        tables = _replace(spec.dim_sizes, dim, new_table)
        extent = sum(new_table)
    shape = _replace(spec.global_shape, dim, extent)
    return wrap(out_local, derived_spec(spec, spec.placements, shape, tables))


def _slice(func, args, kwargs):
    x, dim, start, end, step = _arguments(func, args, kwargs)
    func(meta_like(x), dim, start, end, step)
    return sliced(x, normalize_dim(dim, ndim_of(x)), start, end, step)


def _narrow_copy(func, args, kwargs):
    x, dim, start, length = _arguments(func, args, kwargs)
    func(meta_like(x), dim, start, length)
    d = normalize_dim(dim, ndim_of(x))
    start = start + x._spec.global_shape[d] if start < 0 else start
    out = sliced(x, d, start, start + length)
    return wrap(out._local_tensor.clone(), out._spec)


def _split(func, args, kwargs):
    x, size_arg, dim = _arguments(func, args, kwargs)
    pieces = func(meta_like(x), size_arg, dim)
    d = normalize_dim(dim, ndim_of(x))
    out, start = [], 0
    for piece in pieces:
        out.append(sliced(x, d, start, start + piece.shape[d]))
        start += piece.shape[d]
    return out


# --------------------------------------------------------------------------- #
# select / unbind
# --------------------------------------------------------------------------- #
def _select(func, args, kwargs):
    x, dim, index = _arguments(func, args, kwargs)
    func(meta_like(x), dim, index)
    spec, local = x._spec, x._local_tensor
    d = normalize_dim(dim, ndim_of(x))
    index = index + spec.global_shape[d] if index < 0 else index
    table = spec.dim_sizes[d]
    mesh_dims = _layout.sharding_mesh_dims(spec.placements, d)
    replicated = tuple(Replicate() if m in mesh_dims else p for m, p in enumerate(spec.placements))
    placements, tables = without_dim(replicated, spec.dim_sizes, d)
    shape = spec.global_shape[:d] + spec.global_shape[d + 1 :]
    if table is None:
        return wrap(local.select(d, index), derived_spec(spec, placements, shape, tables))
    k = _intervals.owner(table, index)
    if k == _flat_index(spec, d):
        out = local.select(d, index - sum(table[:k]))
    else:
        out = local.new_empty(local.shape[:d] + local.shape[d + 1 :])
    # Unravel the owner's flat position into its coordinates on those mesh dims;
    # broadcast along the innermost first so the owner's row reaches every group.
    coords = {}
    for m in reversed(mesh_dims):
        coords[m], k = k % spec.mesh.size(m), k // spec.mesh.size(m)
    for m in reversed(mesh_dims):
        if spec.mesh.size(m) > 1:
            out = collectives.broadcast(out, coords[m], spec.mesh, m)
    return wrap(out, derived_spec(spec, placements, shape, tables))


def _unbind(func, args, kwargs):
    x, dim = _arguments(func, args, kwargs)
    func(meta_like(x), dim)
    d = normalize_dim(dim, ndim_of(x))
    local, spec = x._local_tensor, x._spec
    if spec.dim_sizes[d] is not None:
        local, spec = unshard_dims(x, [d], keep_partial=True)
    placements, tables = without_dim(spec.placements, spec.dim_sizes, d)
    shape = spec.global_shape[:d] + spec.global_shape[d + 1 :]
    out_spec = derived_spec(spec, placements, shape, tables)
    return [wrap(t, out_spec) for t in local.unbind(d)]


# --------------------------------------------------------------------------- #
# cat / stack
# --------------------------------------------------------------------------- #
def _meta(t):
    return meta_like(t) if isinstance(t, shard_tensor_cls()) else torch.empty(t.shape, dtype=t.dtype, device="meta")


def _as_shard_tensors(tensors, mesh):
    """ShardTensors for every operand; plain tensors become Replicate (below autograd: no grad)."""
    ShardTensor = shard_tensor_cls()
    from ..spec import ShardTensorSpec

    out = []
    for t in tensors:
        if not isinstance(t, ShardTensor):
            spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, tuple(t.shape), t.dtype)
            t = ShardTensor(t, spec, requires_grad=False)
        out.append(t)
    return out


def _reference(operands):
    """The operand whose layout the output takes: the first sharded one, else the first."""
    return next((x for x in operands if _layout.is_sharded(x._spec.placements)), operands[0])


def _cat_tables(operands, ref, d):
    """Each operand's size table along ``d`` in the output's layout, and the output's."""
    spec = ref._spec
    mesh_dims = _layout.sharding_mesh_dims(spec.placements, d)
    if not mesh_dims:
        return [None] * len(operands), None
    pieces = []
    for x in operands:
        own = _layout.sharding_mesh_dims(x._spec.placements, d)
        if own == mesh_dims:
            pieces.append(x._spec.dim_sizes[d])
        elif all(not x._spec.placements[m].is_shard() and not x._spec.placements[m].is_partial() for m in mesh_dims):
            pieces.append(x._spec.global_shape[d])
        else:
            pieces = None
            break
    shards = len(spec.dim_sizes[d])
    tables = _intervals.tiles(pieces, shards) if pieces is not None else None
    if tables is None:
        extents = [x._spec.global_shape[d] for x in operands]
        total = nested_chunks(sum(extents), [spec.mesh.size(m) for m in mesh_dims])
        starts = [sum(extents[:i]) for i in range(len(extents))]
        tables = [_intervals.intersect(total, s, s + n) for s, n in zip(starts, extents)]
    return tables, tuple(sum(column) for column in zip(*tables))


def _cat(func, args, kwargs):
    tensors, dim = _arguments(func, args, kwargs)
    out_meta = func([_meta(t) for t in tensors], dim)
    ndim = out_meta.ndim
    # torch.cat skips legacy 1-D empty operands when joining tensors of more dims.
    ShardTensor = shard_tensor_cls()
    tensors = [t for t in tensors if not (ndim != 1 and tuple(_meta(t).shape) == (0,))]
    mesh = next(t for t in tensors if isinstance(t, ShardTensor))._spec.mesh
    operands = _as_shard_tensors(tensors, mesh)
    ref = _reference(operands)
    d = normalize_dim(dim, ndim)
    tables, out_table = _cat_tables(operands, ref, d)
    spec = ref._spec
    locals_ = []
    for x, table in zip(operands, tables):
        target = x._spec.with_layout(spec.placements, _replace(spec.dim_sizes, d, table))
        locals_.append(to_layout(x, target))
    out_spec = derived_spec(spec, spec.placements, tuple(out_meta.shape), _replace(spec.dim_sizes, d, out_table))
    return wrap(func(locals_, d), out_spec)


def _stack(func, args, kwargs):
    tensors, dim = _arguments(func, args, kwargs)
    out_meta = func([_meta(t) for t in tensors], dim)
    ShardTensor = shard_tensor_cls()
    mesh = next(t for t in tensors if isinstance(t, ShardTensor))._spec.mesh
    operands = _as_shard_tensors(tensors, mesh)
    spec = _reference(operands)._spec
    locals_ = [to_layout(x, x._spec.with_layout(spec.placements, spec.dim_sizes)) for x in operands]
    d = normalize_dim(dim, out_meta.ndim)
    placements, tables = with_new_dim(spec.placements, spec.dim_sizes, d)
    return wrap(func(locals_, d), derived_spec(spec, placements, tuple(out_meta.shape), tables))


# --------------------------------------------------------------------------- #
# backward ops
# --------------------------------------------------------------------------- #
def _slice_backward(func, args, kwargs):
    grad, input_sizes, dim, start, end, step = _arguments(func, args, kwargs)
    spec, local = grad._spec, grad._local_tensor
    d = normalize_dim(dim, len(input_sizes))
    size = input_sizes[d]
    start, end, step = _intervals.normalize_slice(size, start, end, step)
    table = spec.dim_sizes[d]
    if table is None:
        local_sizes = _replace(tuple(local.shape), d, size)
        out = func(local, local_sizes, d, start, end, step)
        new_table = None
    else:
        mesh_dims = _layout.sharding_mesh_dims(spec.placements, d)
        split_rule = nested_chunks(size, [spec.mesh.size(m) for m in mesh_dims])
        scattered = _intervals.scatter_table(table, size, start, step, preferred=split_rule)
        me = _flat_index(spec, d)
        if scattered is None:  # the slice was empty: zeros in the split rule's layout
            new_table = split_rule
            first = 0
        else:
            new_table, starts = scattered
            first = starts[me]
        count = table[me]
        local_sizes = _replace(tuple(local.shape), d, new_table[me])
        out = func(local, local_sizes, d, first, first + (count - 1) * step + 1 if count else first, step)
    out_spec = derived_spec(spec, spec.placements, tuple(input_sizes), _replace(spec.dim_sizes, d, new_table))
    return wrap(out, out_spec)


def _select_backward(func, args, kwargs):
    grad, input_sizes, dim, index = _arguments(func, args, kwargs)
    spec, local = grad._spec, grad._local_tensor
    d = normalize_dim(dim, len(input_sizes))
    placements, tables = with_new_dim(spec.placements, spec.dim_sizes, d)
    local_sizes = tuple(local.shape[:d]) + (input_sizes[d],) + tuple(local.shape[d:])
    out = func(local, local_sizes, d, index)
    return wrap(out, derived_spec(spec, placements, tuple(input_sizes), tables))


RULES: dict = {
    aten.slice.Tensor: _slice,
    aten.narrow_copy.default: _narrow_copy,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.select.int: _select,
    aten.unbind.int: _unbind,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.slice_backward.default: _slice_backward,
    aten.select_backward.default: _select_backward,
}
FUNCTIONS: dict = {}
