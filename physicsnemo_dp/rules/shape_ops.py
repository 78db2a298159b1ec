"""Shape ops beyond views: triangles, repeats, rotations, diagonals, in-place squeeze.

Communication, per op:

* ``tril``/``triu`` (and in place): none, exact on any layout. Element
  ``(i, j)`` is kept where ``j - i <= k`` (``tril``); on a shard starting at
  global row ``r0`` and column ``c0`` that is the local ``tril(k + r0 - c0)``.
* ``repeat`` (``tile`` decomposes into it): none along dims repeated once or not
  sharded. A sharded dim repeated more than once is a **redistribution**: its
  shard first moves to a dim that is not repeated (one all-to-all; a gather
  when there is none, see ``rule_kit.unshard_dims``), the repeat runs locally,
  and the result **stays in that layout** (sharded along the other dim). A
  repeat of 0 is such a dim too. The backward (ATen's reshape and sum) is then
  local along the repeated dim.
* ``rot90``: ``flip`` and ``transpose`` (torch's own composition): a sharded
  dim that is flipped costs one all-to-all (``dim_ops/reorder.py``), a
  transpose only renumbers the shard.
* ``diagonal(offset, dim1, dim2)`` (and ``diagonal_copy``, which ``torch.diag`` uses): none when at most one of the two dims is
  sharded. The rows (or columns) of a shard meet one contiguous run of the
  diagonal, so the output's diagonal dim is sharded like that dim, each
  rank's extent being the length of its run (exact, uneven, empty runs
  allowed). With both dims sharded, ``dim2``'s shard first moves elsewhere
  (one all-to-all, ``unshard_dims``).
* ``diag_embed`` and ``diagonal_backward`` (one operation: a diagonal written
  into zeros): a sharded diagonal dim becomes a sharding of ``dim1`` whose
  rows hold each rank's run of the diagonal (the first shard also takes the
  rows above the diagonal's start, the last those after its end); ``dim2``
  is whole. No communication.
* ``diagonal_scatter`` (what ``eigh``'s backward writes its diagonal with): none
  when neither dim is sharded, else their shards move first (``unshard_dims``,
  one all-to-all); ``src`` is cut to the matching box. The result stays there.
* ``trace``: the sum of ``diagonal`` (``FUNCTIONS``; ATen's backward of
  ``trace`` fills a plain full-size tensor, the diagonal's does not).
* ``squeeze_``/``unsqueeze_``: the ``squeeze``/``unsqueeze`` of ``views.py``
  (a sharded size-1 dim that is squeezed moves first), then the ShardTensor
  itself takes the new local tensor, spec and global shape.

All of them are linear: a pending sum (``Partial``) stays pending.
"""

from __future__ import annotations

import torch

from .._torch_compat import python_dispatch_excluded
from ..rule_kit import (
    bind_args, meta_output, normalize_dim, replicated_to_box, shard_tensor_cls, to_layout, unshard_dims, wrap,
)
from ..split import offsets_from_sizes
from . import views
from .views import derived_spec, renumber

aten = torch.ops.aten


def _offset(spec, d: int) -> int:
    return spec.local_offsets()[d] if spec.dim_sizes[d] is not None else 0


# --------------------------------------------------------------------------- #
# tril / triu
# --------------------------------------------------------------------------- #
def _triangle(func, args, kwargs):
    x = args[0]
    meta_output(func, args, kwargs)  # torch's checks (at least 2 dims), alike on every rank
    diagonal = bind_args(func, args, kwargs)["diagonal"]
    spec = x._spec
    ndim = len(spec.global_shape)
    shift = _offset(spec, ndim - 2) - _offset(spec, ndim - 1)
    local = func(x._local_tensor, diagonal + shift)
    if func._schema.is_mutable:
        return x
    return wrap(local, spec)


# --------------------------------------------------------------------------- #
# repeat (tile)
# --------------------------------------------------------------------------- #
def _repeat(func, args, kwargs):
    x, repeats = args[0], tuple(bind_args(func, args, kwargs)["repeats"])
    out_shape = tuple(meta_output(func, args, kwargs).shape)
    ndim = len(x._spec.global_shape)
    lead = len(repeats) - ndim
    grown = [d for d in range(ndim) if repeats[lead + d] != 1]
    local, spec = unshard_dims(x, grown, keep_partial=True)
    placements = renumber(spec.placements, {d: d + lead for d in range(ndim)})
    tables = (None,) * lead + tuple(spec.dim_sizes)
    return wrap(local.repeat(repeats), derived_spec(spec, placements, out_shape, tables))


# --------------------------------------------------------------------------- #
# rot90
# --------------------------------------------------------------------------- #
def _rot90(func, args, kwargs):
    x = args[0]
    meta_output(func, args, kwargs)  # torch's checks of k and dims
    bound = bind_args(func, args, kwargs)
    k, dims = bound["k"], list(bound["dims"])
    ndim = len(x._spec.global_shape)
    d0, d1 = (normalize_dim(d, ndim) for d in dims)
    k %= 4
    if k == 1:
        return aten.transpose.int(aten.flip.default(x, [d1]), d0, d1)
    if k == 2:
        return aten.flip.default(x, [d0, d1])
    if k == 3:
        return aten.transpose.int(aten.flip.default(x, [d0]), d0, d1)
    return aten.clone.default(x)


# --------------------------------------------------------------------------- #
# diagonal / diag_embed / diagonal_backward
# --------------------------------------------------------------------------- #
def _diagonal_range(rows: int, cols: int, offset: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` that meet the diagonal ``offset`` of a ``rows x cols`` matrix."""
    lo = max(0, -offset)
    return lo, max(lo, min(rows, cols - offset))


def _runs(table, lo: int, hi: int) -> tuple:
    """Per shard of a dim with size ``table``: how many of positions ``[lo, hi)`` it holds."""
    return tuple(max(0, min(o + n, hi) - max(o, lo)) for o, n in zip(offsets_from_sizes(table), table))


def _diagonal(func, args, kwargs):
    x = args[0]
    out_shape = tuple(meta_output(func, args, kwargs).shape)
    ndim = len(x._spec.global_shape)
    bound = bind_args(func, args, kwargs)
    offset, d1, d2 = bound["offset"], normalize_dim(bound["dim1"], ndim), normalize_dim(bound["dim2"], ndim)
    local, spec = x._local_tensor, x._spec
    if spec.dim_sizes[d1] is not None and spec.dim_sizes[d2] is not None:
        local, spec = unshard_dims(wrap(local, spec), [d2], keep_partial=True)
    keep = [d for d in range(ndim) if d not in (d1, d2)]
    mapping = {d: i for i, d in enumerate(keep)}
    table = None
    if spec.dim_sizes[d1] is not None:  # rows sharded: a shard from row r0 holds the local diagonal offset + r0
        lo, hi = _diagonal_range(spec.global_shape[d1], spec.global_shape[d2], offset)
        table, sharded, local_offset = _runs(spec.dim_sizes[d1], lo, hi), d1, offset + _offset(spec, d1)
    elif spec.dim_sizes[d2] is not None:  # columns sharded: from column c0, the local diagonal offset - c0
        lo, hi = _diagonal_range(spec.global_shape[d2], spec.global_shape[d1], -offset)
        table, sharded, local_offset = _runs(spec.dim_sizes[d2], lo, hi), d2, offset - _offset(spec, d2)
    else:
        local_offset = offset
    if table is not None:
        mapping[sharded] = len(keep)
    placements = renumber(spec.placements, mapping)
    tables = tuple(spec.dim_sizes[d] for d in keep) + (table,)
    out = local.diagonal(local_offset, d1, d2)
    if func is aten.diagonal_copy.default:
        out = out.clone(memory_format=torch.contiguous_format)
    return wrap(out, derived_spec(spec, placements, out_shape, tables))


def _embed(x, out_shape, offset: int, d1: int, d2: int):
    """``x``'s last dim written as diagonal ``offset`` of dims ``d1``/``d2`` of zeros of ``out_shape``.

    The rest of ``x``'s dims map, in order, to the other dims of the output.
    """
    spec, ndim = x._spec, len(out_shape)
    rest = [d for d in range(ndim) if d not in (d1, d2)]
    last = len(spec.global_shape) - 1
    mapping = dict(zip(range(last), rest))
    tables = [None] * ndim
    for e, d in mapping.items():
        tables[d] = spec.dim_sizes[e]
    local_offset = offset
    if spec.dim_sizes[last] is not None:
        mapping[last] = d1
        runs = list(spec.dim_sizes[last])
        lo, hi = _diagonal_range(out_shape[d1], out_shape[d2], offset)
        runs[0] += lo
        runs[-1] += out_shape[d1] - hi
        tables[d1] = tuple(runs)
    out_spec = derived_spec(spec, renumber(spec.placements, mapping), out_shape, tuple(tables))
    if spec.dim_sizes[last] is not None:
        local_offset = offset + _offset(out_spec, d1)
    local = x._local_tensor.new_zeros(out_spec.local_shape)
    local.diagonal(local_offset, d1, d2).copy_(x._local_tensor)
    return wrap(local, out_spec)


def _diag_embed(func, args, kwargs):
    x = args[0]
    out_shape = tuple(meta_output(func, args, kwargs).shape)
    ndim = len(out_shape)
    bound = bind_args(func, args, kwargs)
    return _embed(x, out_shape, bound["offset"], normalize_dim(bound["dim1"], ndim), normalize_dim(bound["dim2"], ndim))


def _diagonal_backward(func, args, kwargs):
    meta_output(func, args, kwargs)
    bound = bind_args(func, args, kwargs)
    sizes = tuple(bound["input_sizes"])
    d1, d2 = normalize_dim(bound["dim1"], len(sizes)), normalize_dim(bound["dim2"], len(sizes))
    return _embed(args[0], sizes, bound["offset"], d1, d2)


def _diagonal_scatter(func, args, kwargs):
    """``src`` written onto diagonal ``offset`` of ``dim1``/``dim2`` of a copy of ``self``.

    Local once neither dim is sharded (their shards move first, ``unshard_dims``); ``src`` is cut to the
    matching box (its leading dims are ``self``'s other dims, its last the whole diagonal). The result
    stays in that layout.
    """
    meta_output(func, args, kwargs)  # torch's checks of src's shape, alike on every rank
    bound = bind_args(func, args, kwargs)
    x, src = bound["self"], bound["src"]
    ndim = len(x._spec.global_shape)
    d1, d2 = normalize_dim(bound["dim1"], ndim), normalize_dim(bound["dim2"], ndim)
    local, spec = unshard_dims(x, [d1, d2])
    keep = [d for d in range(ndim) if d not in (d1, d2)]
    src_spec = derived_spec(
        spec, renumber(spec.placements, {d: i for i, d in enumerate(keep)}), tuple(src.shape),
        tuple(spec.dim_sizes[d] for d in keep) + (None,),
    )
    src_local = to_layout(src, src_spec) if isinstance(src, shard_tensor_cls()) else replicated_to_box(src, src_spec)
    return wrap(local.diagonal_scatter(src_local, bound["offset"], d1, d2), spec)


def _trace(func, types, args, kwargs):
    """``trace`` as the sum of the diagonal: a pending or reduced 0-d result, gradients laid out like the input."""
    x = args[0]
    if x.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {x.ndim}")
    return torch.diagonal(x).sum()  # torch-function on: sum's handler gives a gradient in the diagonal's layout


def _trace_rule(func, args, kwargs):
    return aten.sum.default(_diagonal(aten.diagonal.default, (args[0],), {}))


# --------------------------------------------------------------------------- #
# squeeze_ / unsqueeze_
# --------------------------------------------------------------------------- #
_OUT_OF_PLACE = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
}


def _in_place_view(func, args, kwargs):
    x = args[0]
    if not isinstance(x, shard_tensor_cls()):
        raise RuntimeError(f"{func}: the tensor changed in place must be a ShardTensor here")
    out = views.RULES[_OUT_OF_PLACE[func]](_OUT_OF_PLACE[func], args, kwargs)
    x._local_tensor, x._spec = out._local_tensor, out._spec
    with python_dispatch_excluded():  # the wrapper's own sizes and strides: the new global shape
        func(x, *args[1:], **kwargs)
    return x


RULES: dict = {
    aten.tril.default: _triangle,
    aten.triu.default: _triangle,
    aten.tril_.default: _triangle,
    aten.triu_.default: _triangle,
    aten.repeat.default: _repeat,
    aten.rot90.default: _rot90,
    aten.diagonal.default: _diagonal,
    aten.diagonal_copy.default: _diagonal,
    aten.diag_embed.default: _diag_embed,
    aten.diagonal_backward.default: _diagonal_backward,
    aten.diagonal_scatter.default: _diagonal_scatter,
    aten.trace.default: _trace_rule,
    **dict.fromkeys(_OUT_OF_PLACE, _in_place_view),
}
FUNCTIONS: dict = {torch.trace: _trace, torch.Tensor.trace: _trace}
