"""Writes through indices: ``index_put_`` (``x[idx] = v``), ``index_add``, ``scatter*``.

The written tensor keeps its layout (pending sums are resolved first: a
write into one contribution would not write into the sum). Every rank must
apply every write that lands in its box, so:

* index tensors are replicated (all-gathered where they are sharded: integers);
* values / sources are brought to the layout of the part of ``x`` they
  land in: sharded like ``x`` along dims that map one-to-one onto ``x``'s
  (no communication when they already are, e.g. a gradient), replicated
  along the indexed dim;
* where ``x`` is sharded along the indexed dim, each rank applies only the
  entries it owns; where it is replicated, every rank applies all of them.

``scatter``/``scatter_add``/``scatter_reduce`` along a sharded dim compact the
owned entries into a flat list and scatter into the flattened local box, so
every reduction (``sum``, ``prod``, ``mean``, ``amax``, ``amin``, with or
without ``include_self``) sees exactly the entries that land in the box.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from ...rule_kit import broadcast_shape, normalize_dim, replicated_to_box, resolve_partial, shard_tensor_cls, to_layout, wrap
from ._common import (
    as_shard,
    box,
    clip_sizes,
    check_range,
    localize,
    mesh_of,
    replicated_local,
    result_shape,
    sharded_dims,
    spec_like,
)
from .masks import mask_position, mask_put_
from .read import put_local

aten = torch.ops.aten


def _target(x, in_place: bool):
    """The tensor written into: ``x`` itself (pending sums resolved in place) or a copy."""
    local, spec = resolve_partial(x)
    if in_place:
        x._local_tensor, x._spec = local, spec
        return x
    return wrap(local.clone(), spec)


def _values_local(values, spec):
    """``values`` (ShardTensor, plain tensor or 0-d) as this rank's part of layout ``spec``."""
    if isinstance(values, shard_tensor_cls()):
        if tuple(values.shape) == spec.global_shape:
            return to_layout(values, spec)
        values = replicated_local(values)
    return replicated_to_box(values, spec) if values.ndim else values


# --------------------------------------------------------------------------- #
# index_put
# --------------------------------------------------------------------------- #
def index_put(x, indices, values, accumulate: bool = False, *, in_place: bool):
    target = _target(as_shard(x, mesh_of(x, values, *[t for t in indices if t is not None])), in_place)
    spec, mesh = target._spec, target._spec.mesh
    indices = list(indices)
    p = mask_position(indices)
    if p is not None:
        mask_put_(target, p, indices[p], values, accumulate)
        return target
    positions = [d for d, t in enumerate(indices) if t is not None]
    owned = None
    idx = [None] * (positions[-1] + 1)
    for d in positions:
        loc = replicated_local(as_shard(indices[d], mesh))
        if d in sharded_dims(spec):
            size = spec.global_shape[d]
            check_range(loc, size, True, "index_put_", d)
            offset, extent = box(spec, d)
            loc, mine = localize(loc, size, offset, extent, True)
            owned = mine if owned is None else owned & mine
        idx[d] = loc
    bshape = broadcast_shape(*(tuple(indices[d].shape) for d in positions))
    shape, _, where = result_shape(spec.global_shape, positions, bshape)
    placements = [Shard(where[q.dim]) if issubclass(type(q), Shard) and q.dim not in positions else Replicate() for q in spec.placements]
    tables = [None] * len(shape)
    for q in spec.placements:
        if issubclass(type(q), Shard) and q.dim not in positions:
            tables[where[q.dim]] = spec.dim_sizes[q.dim]
    v_spec = spec_like(spec, placements, shape, tables)
    put_local(target._local_tensor, idx, _values_local(values, v_spec), owned, accumulate)
    return target


def _aligned_spec(t, spec, dim: int):
    """Layout for an index/source written into ``spec`` along ``dim``: like ``x`` off ``dim``, clipped to ``t``."""
    placements = [q if issubclass(type(q), Shard) and q.dim != dim else Replicate() for q in spec.placements]
    tables = [None] * t.ndim
    for q in placements:
        if issubclass(type(q), Shard):
            tables[q.dim] = clip_sizes(spec.dim_sizes[q.dim], t.shape[q.dim])
    return t._spec.with_layout(placements, tables)


# --------------------------------------------------------------------------- #
# index_add
# --------------------------------------------------------------------------- #
def index_add(x, dim: int, index, source, alpha=1, *, in_place: bool):
    mesh = mesh_of(x, index, source)
    target = _target(as_shard(x, mesh), in_place)
    spec = target._spec
    dim = normalize_dim(dim, len(spec.global_shape))
    source = as_shard(source, mesh)
    idx = replicated_local(as_shard(index, mesh)).reshape(-1)
    src = to_layout(source, _aligned_spec(source, spec, dim))
    local = target._local_tensor
    if dim in sharded_dims(spec):
        size = spec.global_shape[dim]
        check_range(idx, size, False, "index_add", dim)
        offset, extent = box(spec, dim)
        idx, owned = localize(idx, size, offset, extent, False)
        sel = owned.nonzero().squeeze(1)
        idx, src = idx.index_select(0, sel), src.index_select(dim, sel)
    local.index_add_(dim, idx, src, alpha=alpha)
    return target


# --------------------------------------------------------------------------- #
# scatter, scatter_add, scatter_reduce
# --------------------------------------------------------------------------- #
def _flat_offsets(local_index, dim: int, strides):
    """Offset in the flattened target of every entry of a local scatter index."""
    offsets = local_index * strides[dim]
    for d, n in enumerate(local_index.shape):
        if d != dim:
            shape = [1] * local_index.ndim
            shape[d] = n
            offsets = offsets + torch.arange(n, device=local_index.device).reshape(shape) * strides[d]
    return offsets


def scatter(x, dim: int, index, src, kind: str, reduce=None, include_self=True, *, in_place: bool):
    """``kind``: ``"scatter"`` (overwrite), ``"add"`` or ``"reduce"`` (with ``reduce``)."""
    tensor_src = isinstance(src, torch.Tensor)
    mesh = mesh_of(x, index, *([src] if tensor_src else []))
    target = _target(as_shard(x, mesh), in_place)
    spec = target._spec
    dim = normalize_dim(dim, len(spec.global_shape))
    index = as_shard(index, mesh)
    idx = to_layout(index, _aligned_spec(index, spec, dim))
    if tensor_src:
        src = as_shard(src, mesh)
        src = to_layout(src, _aligned_spec(src, spec, dim))
    local = target._local_tensor
    if dim not in sharded_dims(spec):
        _apply(local, dim, idx, src, kind, reduce, include_self)
        return target
    size = spec.global_shape[dim]
    check_range(idx, size, False, "scatter", dim)
    offset, extent = box(spec, dim)
    loc, owned = localize(idx, size, offset, extent, False)
    work = local if local.is_contiguous() else local.contiguous()
    sel = owned.reshape(-1).nonzero().squeeze(1)
    flat = _flat_offsets(loc, dim, work.stride()).reshape(-1).index_select(0, sel)
    if tensor_src:
        src = src[tuple(slice(0, n) for n in idx.shape)].reshape(-1).index_select(0, sel)
    _apply(work.view(-1), 0, flat, src, kind, reduce, include_self)
    if work is not local:
        local.copy_(work)
    return target


def _apply(local, dim, idx, src, kind, reduce, include_self):
    if kind == "scatter":
        local.scatter_(dim, idx, src)
    elif kind == "add":
        local.scatter_add_(dim, idx, src)
    else:
        local.scatter_reduce_(dim, idx, src, reduce, include_self=include_self)


# --------------------------------------------------------------------------- #
# dispatch rules
# --------------------------------------------------------------------------- #
def _index_put_rule(in_place):
    def rule(func, args, kwargs):
        x, indices, values, *rest = args
        accumulate = rest[0] if rest else kwargs.get("accumulate", False)
        return index_put(x, indices, values, accumulate, in_place=in_place)

    return rule


def _index_add_rule(in_place):
    def rule(func, args, kwargs):
        x, dim, index, source, *rest = args
        alpha = rest[0] if rest else kwargs.get("alpha", 1)
        return index_add(x, dim, index, source, alpha, in_place=in_place)

    return rule


def _scatter_rule(kind, in_place):
    def rule(func, args, kwargs):
        x, dim, index, src, *rest = args
        if kind == "reduce":
            reduce = rest[0] if rest else kwargs["reduce"]
            include_self = rest[1] if len(rest) > 1 else kwargs.get("include_self", True)
            return scatter(x, dim, index, src, kind, reduce, include_self, in_place=in_place)
        return scatter(x, dim, index, src, kind, in_place=in_place)

    return rule


RULES = {
    aten.index_put_.default: _index_put_rule(True),
    aten.index_put.default: _index_put_rule(False),
    aten.index_add_.default: _index_add_rule(True),
    aten.index_add.default: _index_add_rule(False),
    aten.scatter_.src: _scatter_rule("scatter", True),
    aten.scatter_.value: _scatter_rule("scatter", True),
    aten.scatter.src: _scatter_rule("scatter", False),
    aten.scatter.value: _scatter_rule("scatter", False),
    aten.scatter_add_.default: _scatter_rule("add", True),
    aten.scatter_add.default: _scatter_rule("add", False),
    aten.scatter_reduce_.two: _scatter_rule("reduce", True),
    aten.scatter_reduce.two: _scatter_rule("reduce", False),
}
