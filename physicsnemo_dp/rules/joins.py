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

Planning is apart from execution: :func:`propagate`, a pure function of the
op, the operands' specs (size tables included) and the other arguments,
memoised, gives the output specs, the collectives of the list above with their
bytes, and the local slice bounds; each rule looks it up and runs it on the
local tensors, and ``propagation.plan`` answers with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import _intervals, _layout, collectives
from .._redistribute import redistribute_local
from .._reshape import nested_chunks
from .._torch_compat import SubclassFunction, once_differentiable, plain_eager, torch_function_disabled
from ..propagation import OpPlan, cached, collective_step, freeze, moves, redistribution_steps, replicated
from ..rule_kit import normalize_dim, plain_gradient, shard_tensor_cls, unshard_target, wrap
from ..spec import ShardTensorSpec
from .views import derived_spec, with_new_dim, without_dim

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


def _meta(value):
    """A meta tensor of a spec's global shape (other arguments as they are, lists of specs element-wise)."""
    if isinstance(value, ShardTensorSpec):
        return torch.empty(value.global_shape, dtype=value.tensor_meta.dtype, device="meta")
    if isinstance(value, tuple):
        return [_meta(v) for v in value]
    return value


@dataclass(frozen=True)
class JoinPlan:
    """A join or split decided from metadata: the layouts, the collectives, and what each rank does locally.

    Attributes:
        plan: output specs and collectives (:class:`~physicsnemo_dp.propagation.OpPlan`; its
            ``operand_specs`` are the layouts the operands are brought to, None: as they are).
        local: op-specific local arguments (slice bounds, the owner of a selected index, the
            operands a ``cat`` keeps, ...), read by the op's executor below.
    """

    plan: OpPlan
    local: tuple = ()


@lru_cache(maxsize=4096)
def propagate(func, args: tuple, kwargs: tuple) -> JoinPlan:
    """The pure half of a join: memoised on the op and its frozen arguments (tensors as their specs).

    Bad arguments raise torch's own error, from the op run on meta tensors of
    the global shapes, on every rank alike; errors are not memoised.
    """
    bound = _arguments(func, args, dict(kwargs))
    return _PLANNERS[func](func, *bound)


def _plan_of(func, args, kwargs) -> JoinPlan:
    return cached(propagate, func, freeze(args), tuple(sorted((k, freeze(v)) for k, v in kwargs.items())))


def _propagate_entry(func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for the joins."""
    return _plan_of(func, args, kwargs).plan


# --------------------------------------------------------------------------- #
# slice / split / narrow_copy
# --------------------------------------------------------------------------- #
def _slice_layout(spec, dim: int, start, end, step: int = 1):
    """``(output spec, local slice args)`` of ``x[..., start:end:step, ...]`` along ``dim``: no communication."""
    start, end, step = _intervals.normalize_slice(spec.global_shape[dim], start, end, step)
    table = spec.dim_sizes[dim]
    if table is None:
        tables = spec.dim_sizes
        extent = len(range(start, end, step))
        local = (dim, start, end, step)
    else:
        per_shard = _intervals.slice_table(table, start, end, step)
        first, count = per_shard[_flat_index(spec, dim)]
        local = (dim, first, first + (count - 1) * step + 1 if count else first, step)
        new_table = tuple(c for _, c in per_shard)
        tables = _replace(spec.dim_sizes, dim, new_table)
        extent = sum(new_table)
    shape = _replace(spec.global_shape, dim, extent)
    return derived_spec(spec, spec.placements, shape, tables), local


def _plan_slice(func, spec, dim, start, end, step):
    func(_meta(spec), dim, start, end, step)
    out, local = _slice_layout(spec, normalize_dim(dim, len(spec.global_shape)), start, end, step)
    return JoinPlan(OpPlan((out,)), local)


def _plan_narrow_copy(func, spec, dim, start, length):
    func(_meta(spec), dim, start, length)
    d = normalize_dim(dim, len(spec.global_shape))
    start = start + spec.global_shape[d] if start < 0 else start
    out, local = _slice_layout(spec, d, start, start + length)
    return JoinPlan(OpPlan((out,)), local)


def _plan_split(func, spec, size_arg, dim):
    pieces = func(_meta(spec), size_arg, dim)
    d = normalize_dim(dim, len(spec.global_shape))
    outs, locals_, start = [], [], 0
    for piece in pieces:
        out, local = _slice_layout(spec, d, start, start + piece.shape[d])
        outs.append(out)
        locals_.append(local)
        start += piece.shape[d]
    return JoinPlan(OpPlan(tuple(outs)), tuple(locals_))


def _slice(func, args, kwargs):
    x = args[0] if args else kwargs["self"]
    jp = _plan_of(func, args, kwargs)
    return wrap(aten.slice.Tensor(x._local_tensor, *jp.local), jp.plan.output_specs[0])


def _narrow_copy(func, args, kwargs):
    x = args[0] if args else kwargs["self"]
    jp = _plan_of(func, args, kwargs)
    return wrap(aten.slice.Tensor(x._local_tensor, *jp.local).clone(), jp.plan.output_specs[0])


def _split(func, args, kwargs):
    x = args[0] if args else kwargs["self"]
    jp = _plan_of(func, args, kwargs)
    return [wrap(aten.slice.Tensor(x._local_tensor, *local), out) for local, out in zip(jp.local, jp.plan.output_specs)]


# --------------------------------------------------------------------------- #
# select / unbind
# --------------------------------------------------------------------------- #
def _plan_select(func, spec, dim, index):
    func(_meta(spec), dim, index)
    d = normalize_dim(dim, len(spec.global_shape))
    index = index + spec.global_shape[d] if index < 0 else index
    table = spec.dim_sizes[d]
    mesh_dims = _layout.sharding_mesh_dims(spec.placements, d)
    replicated = tuple(Replicate() if m in mesh_dims else p for m, p in enumerate(spec.placements))
    placements, tables = without_dim(replicated, spec.dim_sizes, d)
    shape = spec.global_shape[:d] + spec.global_shape[d + 1 :]
    out = derived_spec(spec, placements, shape, tables)
    if table is None:
        return JoinPlan(OpPlan((out,)), (d, index, ()))
    k = _intervals.owner(table, index)
    local_index = index - sum(table[:k]) if k == _flat_index(spec, d) else None
    # Unravel the owner's flat position into its coordinates on those mesh dims;
    # broadcast along the innermost first so the owner's row reaches every group.
    coords = {}
    for m in reversed(mesh_dims):
        coords[m], k = k % spec.mesh_shape[m], k // spec.mesh_shape[m]
    sources = tuple((m, coords[m]) for m in reversed(mesh_dims) if spec.mesh_shape[m] > 1)
    numel, itemsize = prod(out.local_shape), spec.tensor_meta.dtype.itemsize
    steps = tuple(
        collective_step("broadcast", m, numel, itemsize, spec.mesh_shape[m], sender=spec.coordinate[m] == src)
        for m, src in sources
    )
    return JoinPlan(OpPlan((out,), steps), (d, local_index, sources))


def _select(func, args, kwargs):
    x = args[0] if args else kwargs["self"]
    jp = _plan_of(func, args, kwargs)
    d, index, sources = jp.local
    local = x._local_tensor
    out = local.select(d, index) if index is not None else local.new_empty(local.shape[:d] + local.shape[d + 1 :])
    for m, src in sources:
        out = collectives.broadcast(out, src, x._spec.mesh, m)
    return wrap(out, jp.plan.output_specs[0])


def _plan_unbind(func, spec, dim):
    pieces = func(_meta(spec), dim)
    d = normalize_dim(dim, len(spec.global_shape))
    moved = unshard_target(spec, (d,), keep_partial=True) if spec.dim_sizes[d] is not None else spec
    placements, tables = without_dim(moved.placements, moved.dim_sizes, d)
    shape = spec.global_shape[:d] + spec.global_shape[d + 1 :]
    out = derived_spec(moved, placements, shape, tables)
    moved = None if moved is spec else moved
    steps = () if moved is None else redistribution_steps(spec, moved, 0)
    return JoinPlan(OpPlan((out,) * len(pieces), steps, (moved,)), (d,))


def _unbind(func, args, kwargs):
    x = args[0] if args else kwargs["self"]
    jp = _plan_of(func, args, kwargs)
    (moved,) = jp.plan.operand_specs
    local = x._local_tensor if moved is None else redistribute_local(x._local_tensor, x._spec, moved)
    return [wrap(t, out) for t, out in zip(local.unbind(jp.local[0]), jp.plan.output_specs)]


# --------------------------------------------------------------------------- #
# cat / stack
# --------------------------------------------------------------------------- #
def _operand_specs(tensors) -> tuple:
    """Every operand's spec; a plain tensor's is Replicate on the mesh of the ShardTensor operands."""
    ShardTensor = shard_tensor_cls()
    mesh = next(t for t in tensors if isinstance(t, ShardTensor))._spec.mesh
    return tuple(t._spec if isinstance(t, ShardTensor) else replicated(mesh, t.shape, t.dtype) for t in tensors)


def _reference(specs):
    """The operand layout the output takes: the first sharded one, else the first."""
    return next((s for s in specs if _layout.is_sharded(s.placements)), specs[0])


def _cat_tables(specs, spec, d):
    """Each operand's size table along ``d`` in the output's layout (``spec``'s), and the output's."""
    mesh_dims = _layout.sharding_mesh_dims(spec.placements, d)
    if not mesh_dims:
        return [None] * len(specs), None
    pieces = []
    for x in specs:
        own = _layout.sharding_mesh_dims(x.placements, d)
        if own == mesh_dims:
            pieces.append(x.dim_sizes[d])
        elif all(not issubclass(type(x.placements[m]), Shard) and not issubclass(type(x.placements[m]), Partial) for m in mesh_dims):
            pieces.append(x.global_shape[d])
        else:
            pieces = None
            break
    shards = len(spec.dim_sizes[d])
    tables = _intervals.tiles(pieces, shards) if pieces is not None else None
    if tables is None:
        extents = [x.global_shape[d] for x in specs]
        total = nested_chunks(sum(extents), [spec.mesh_shape[m] for m in mesh_dims])
        starts = [sum(extents[:i]) for i in range(len(extents))]
        tables = [_intervals.intersect(total, s, s + n) for s, n in zip(starts, extents)]
    return tables, tuple(sum(column) for column in zip(*tables))


def _target(src, placements, tables):
    """The layout ``src`` is brought to (None when it already has it)."""
    if src.placements == placements and src.dim_sizes == tables:
        return None
    return src.with_layout(placements, tables)


def _plan_cat(func, specs, dim):
    out_meta = func(_meta(specs), dim)
    ndim = out_meta.ndim
    # torch.cat skips legacy 1-D empty operands when joining tensors of more dims.
    kept = tuple(i for i, s in enumerate(specs) if not (ndim != 1 and tuple(s.global_shape) == (0,)))
    operands = [specs[i] for i in kept]
    spec = _reference(operands)
    d = normalize_dim(dim, ndim)
    tables, out_table = _cat_tables(operands, spec, d)
    targets = [None] * len(specs)
    for i, table in zip(kept, tables):
        targets[i] = _target(specs[i], spec.placements, _replace(spec.dim_sizes, d, table))
    out = derived_spec(spec, spec.placements, tuple(out_meta.shape), _replace(spec.dim_sizes, d, out_table))
    return JoinPlan(OpPlan((out,), moves(specs, targets), tuple(targets)), (kept, d))


def _plan_stack(func, specs, dim):
    out_meta = func(_meta(specs), dim)
    spec = _reference(specs)
    targets = tuple(_target(s, spec.placements, spec.dim_sizes) for s in specs)
    d = normalize_dim(dim, out_meta.ndim)
    placements, tables = with_new_dim(spec.placements, spec.dim_sizes, d)
    out = derived_spec(spec, placements, tuple(out_meta.shape), tables)
    return JoinPlan(OpPlan((out,), moves(specs, targets), targets), (tuple(range(len(specs))), d))


def _joined(func, args, kwargs):
    """The rule of ``cat`` and ``stack``: bring each kept operand to its planned layout, join locally."""
    tensors = list(args[0] if args else kwargs["tensors"])
    specs = _operand_specs(tensors)
    jp = _plan_of(func, (specs, *args[1:]), {k: v for k, v in kwargs.items() if k != "tensors"})
    kept, d = jp.local
    locals_ = []
    for i in kept:
        t, target = tensors[i], jp.plan.operand_specs[i]
        local = t._local_tensor if isinstance(t, shard_tensor_cls()) else t
        locals_.append(local if target is None else redistribute_local(local, specs[i], target))
    return wrap(func(locals_, d), jp.plan.output_specs[0])


# --------------------------------------------------------------------------- #
# backward ops
# --------------------------------------------------------------------------- #
def _plan_slice_backward(func, spec, input_sizes, dim, start, end, step):
    d = normalize_dim(dim, len(input_sizes))
    size = input_sizes[d]
    start, end, step = _intervals.normalize_slice(size, start, end, step)
    local_shape = spec.local_shape
    table = spec.dim_sizes[d]
    if table is None:
        local = (_replace(local_shape, d, size), d, start, end, step)
        new_table = None
    else:
        mesh_dims = _layout.sharding_mesh_dims(spec.placements, d)
        split_rule = nested_chunks(size, [spec.mesh_shape[m] for m in mesh_dims])
        scattered = _intervals.scatter_table(table, size, start, step, preferred=split_rule)
        me = _flat_index(spec, d)
        if scattered is None:  # the slice was empty: zeros in the split rule's layout
            new_table, first = split_rule, 0
        else:
            new_table, starts = scattered
            first = starts[me]
        count = table[me]
        end = first + (count - 1) * step + 1 if count else first
        local = (_replace(local_shape, d, new_table[me]), d, first, end, step)
    out = derived_spec(spec, spec.placements, tuple(input_sizes), _replace(spec.dim_sizes, d, new_table))
    return JoinPlan(OpPlan((out,)), local)


def _plan_select_backward(func, spec, input_sizes, dim, index):
    d = normalize_dim(dim, len(input_sizes))
    placements, tables = with_new_dim(spec.placements, spec.dim_sizes, d)
    local_shape = spec.local_shape
    local = (local_shape[:d] + (input_sizes[d],) + local_shape[d:], d, index)
    return JoinPlan(OpPlan((derived_spec(spec, placements, tuple(input_sizes), tables),)), local)


def _scattered(func, args, kwargs):
    """The rule of ``slice_backward``/``select_backward``: the local op into the planned slab."""
    grad = args[0] if args else kwargs["grad_output"]
    jp = _plan_of(func, args, kwargs)
    return wrap(func(grad._local_tensor, *jp.local), jp.plan.output_specs[0])


_PLANNERS = {
    aten.slice.Tensor: _plan_slice,
    aten.narrow_copy.default: _plan_narrow_copy,
    aten.split.Tensor: _plan_split,
    aten.split_with_sizes.default: _plan_split,
    aten.select.int: _plan_select,
    aten.unbind.int: _plan_unbind,
    aten.cat.default: _plan_cat,
    aten.stack.default: _plan_stack,
    aten.slice_backward.default: _plan_slice_backward,
    aten.select_backward.default: _plan_select_backward,
}

RULES: dict = {
    aten.slice.Tensor: _slice,
    aten.narrow_copy.default: _narrow_copy,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.select.int: _select,
    aten.unbind.int: _unbind,
    aten.cat.default: _joined,
    aten.stack.default: _joined,
    aten.slice_backward.default: _scattered,
    aten.select_backward.default: _scattered,
}


def _tensor_split(func, types, args, kwargs):
    """``tensor_split`` with a tensor of indices or sections: read it as Python ints, then split.

    ATen's composite reads the index tensor's data; once promoted to a
    ShardTensor (it met a ShardTensor) it has no data of its own. The values
    are read with ``tolist()`` (local for a plain or replicated tensor), torch's
    checks kept, and the call is repeated with ints: slices of the input.
    """
    args, kwargs = list(args), dict(kwargs)
    key = next((k for k in ("tensor_indices_or_sections", "indices", "sections") if k in kwargs), None)
    value = kwargs[key] if key is not None else args[1] if len(args) > 1 else None
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.long:
            raise RuntimeError(
                f"tensor_split expected tensor_indices_or_sections to have dtype of long, but got {value.dtype}"
            )
        if value.ndim > 1:
            raise RuntimeError(
                "tensor_split expected tensor_indices_or_sections to be a zero-dimensional or one-dimensional "
                f"tensor, but got a tensor with {value.ndim} dims"
            )
        value = value.tolist()
        if key is not None:
            del kwargs[key]
        args[1:2] = [value]
    with torch_function_disabled():
        return func(*args, **kwargs)


FUNCTIONS: dict = {torch.tensor_split: _tensor_split, torch.Tensor.tensor_split: _tensor_split}

#: ``propagation.plan`` entries: every op of this family plans apart from execution.
PROPAGATORS: dict = dict.fromkeys(_PLANNERS, _propagate_entry)


# --------------------------------------------------------------------------- #
# cat of same-layout operands along an unsharded dim (function level, above autograd)
# --------------------------------------------------------------------------- #
#: (dim, operand specs' ids) -> (operand specs (kept alive: the ids stay theirs), output spec, sizes along dim)
_SAME_CAT: dict = {}


def _same_cat_plan(specs: tuple, d: int):
    """Output spec and sizes of a cat of operands of layouts ``specs`` along their unsharded dim ``d``, else None."""
    key = (d, *map(id, specs))
    hit = _SAME_CAT.get(key)
    if hit is not None:
        return hit[1], hit[2]
    first = specs[0]
    shape = first.global_shape
    if first.has_partial or d >= len(shape) or first.dim_sizes[d] is not None:
        return None
    rest = shape[:d] + shape[d + 1 :]
    for s in specs[1:]:
        if (s.mesh is not first.mesh or s.placements != first.placements or s.dim_sizes != first.dim_sizes
                or s.tensor_meta.dtype != first.tensor_meta.dtype or len(s.global_shape) != len(shape)
                or s.global_shape[:d] + s.global_shape[d + 1 :] != rest):  # fmt: skip
            return None
    sizes = tuple(s.global_shape[d] for s in specs)
    out_shape = shape[:d] + (sum(sizes),) + shape[d + 1 :]
    out = ShardTensorSpec.from_sizes(first.mesh, first.placements, out_shape, first.tensor_meta.dtype, first.dim_sizes)
    if len(_SAME_CAT) >= 1024:
        _SAME_CAT.clear()
    _SAME_CAT[key] = (specs, out, sizes)
    return out, sizes


def cat_same_layout(tensors, dim):
    """``torch.cat(tensors, dim)`` of ShardTensors of one layout along a dim none of them shards, else None.

    The local tensors are joined as they are (the global join of same-layout
    slabs along an unsharded dim is the join of the slabs); one autograd node
    whose backward splits the local gradient once. Declines (None) for
    anything else: mixed layouts or dtypes, a sharded or pending dim, plain
    operands, and while torch.compile traces or a dispatch mode or functorch
    transform is active (the generic rule serves those).
    """
    ShardTensor = shard_tensor_cls()
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or not isinstance(dim, int):
        return None
    for t in tensors:
        if type(t) is not ShardTensor:
            return None
    specs = tuple(t._spec for t in tensors)
    ndim = len(specs[0].global_shape)
    if ndim == 0 or not -ndim <= dim < ndim:
        return None
    plan = _same_cat_plan(specs, dim + ndim if dim < 0 else dim)
    if plan is None:
        return None
    if not plain_eager():
        return None
    out_spec, sizes = plan
    d = dim + ndim if dim < 0 else dim
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return wrap(torch.cat([t._local_tensor for t in tensors], d), out_spec)
    return _SameCat.apply(d, out_spec, sizes, specs, *tensors)


class _SameCat(SubclassFunction):
    """:func:`cat_same_layout` as one autograd node: the local join, its backward one split of the local gradient."""

    @staticmethod
    def forward(ctx, d, out_spec, sizes, specs, *tensors):
        ctx.d, ctx.out_spec, ctx.sizes, ctx.specs = d, out_spec, sizes, specs
        ctx.set_materialize_grads(False)
        return wrap(torch.cat([t._local_tensor for t in tensors], d), out_spec)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        n = len(ctx.specs)
        if grad is None:
            return (None,) * (4 + n)
        if type(grad) is not shard_tensor_cls():  # a plain gradient of the global shape
            grad = plain_gradient(grad, ctx.out_spec)
        out = ctx.out_spec
        if grad._spec.placements != out.placements or grad._spec.dim_sizes != out.dim_sizes:
            # another layout (e.g. pending): the slices torch's own backward of cat takes, through the generic rule
            offsets = [0]
            for s in ctx.sizes:
                offsets.append(offsets[-1] + s)
            return (None,) * 4 + tuple(
                grad.narrow(ctx.d, o, s) if need else None
                for o, s, need in zip(offsets, ctx.sizes, ctx.needs_input_grad[4:])
            )
        needs = ctx.needs_input_grad
        pieces = grad._local_tensor.split_with_sizes(ctx.sizes, ctx.d)  # torch.split, two Python frames less
        return (None,) * 4 + tuple(
            wrap(p, s) if needs[4 + i] else None for i, (p, s) in enumerate(zip(pieces, ctx.specs))
        )
