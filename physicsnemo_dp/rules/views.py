"""View and shape ops: the shard dim moves with the data.

``view``/``_unsafe_view`` (what ``reshape``, ``flatten``, ``unflatten`` and
``view_as`` become), ``unsqueeze``, ``squeeze`` (all overloads), ``permute``
(also ``movedim``), ``transpose``/``t`` and ``expand`` (also ``expand_as``,
``broadcast_to``). Global shape arguments are evaluated on a meta tensor of
the global shape, so ``-1`` inference and error messages are torch's own, and
then translated to this rank's local shape.

Communication, per op:

* ``permute``/``transpose``/``t``/``unsqueeze``: none; shard dims are renumbered.
* ``view``: none when every sharded dim is the outermost dim of its reshape
  group and the shard sizes divide into whole output rows (merging always,
  splitting when every shard divides by the inner product; see
  :mod:`physicsnemo_dp._reshape`). Otherwise one all-to-all first moves the
  offending shard to a dim that can carry it (its group's head, rebalanced
  into whole units, or another group's head), and only when no dim can does
  it gather (all-gather-v).
* ``squeeze``: none, unless a dropped size-1 dim is sharded; that shard moves
  to the largest free dim first (all-to-all; gather if there is none).
* ``expand``: none; a Replicate tensor stays a stride-0 view. Expanding a
  sharded size-1 dim first moves its shard elsewhere like ``squeeze``.

* ``view(dtype)``: none; each shard is reinterpreted on its own. Different
  element sizes scale the last dim, so a sharded last dim needs every shard's
  extent to divide into whole elements of the wider dtype (else PlacementError).

* ``view_as_real`` / ``view_as_complex``: none; they add / remove a trailing
  dim of 2 (real and imaginary part), which is never sharded:
  ``view_as_complex`` of a tensor whose last dim is sharded raises
  PlacementError on every rank (a pair split between ranks is no number).

Planning is apart from execution for the view ops above (not ``view(dtype)``,
``view_as_real``/``view_as_complex``): :func:`propagate`, a pure function of
the op, the input's spec and the other arguments, memoised, gives the layout
the input must take first (if any), the output spec and the local op; the rule
runs that on the local tensor (``propagation.plan`` asks the same function).

Pending reductions (``Partial``) pass through all of them: views are linear
(``view_as_real``/``view_as_complex`` too: complex sums are componentwise).
``view(dtype)`` is the exception: the bits of a sum are not the sum of the
bits, so a Partial input is reduced first (one all-reduce).

Local tensors never carry torch's lazy conjugate/negative bit (ShardTensor's
constructor resolves it, see :mod:`.pointwise`), so ``view(dtype)`` and
``view_as_real`` reinterpret memory that holds the values it shows.
``as_strided`` is refused with an error: strides of the global tensor do not
describe any rank's local memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from .._redistribute import redistribute_local
from .._reshape import compatible_layout, output_layout
from ..errors import PlacementError
from ..propagation import OpPlan, redistribution_steps
from .._torch_compat import TensorBase, torch_function_disabled
from ..rule_kit import normalize_dim, resolve_partial, shard_tensor_cls, unshard_target, wrap

aten = torch.ops.aten


# --------------------------------------------------------------------------- #
# Helpers shared with the join/split rules
# --------------------------------------------------------------------------- #
def meta_like(x) -> torch.Tensor:
    """A meta tensor with ``x``'s global shape and dtype (for torch's own shape checks)."""
    spec = x._spec
    return torch.empty(spec.global_shape, dtype=spec.tensor_meta.dtype, device="meta")


def derived_spec(spec, placements, global_shape, dim_sizes):
    """Spec on ``spec``'s mesh with ``spec``'s dtype and a new shape and layout."""
    return type(spec).from_sizes(spec.mesh, placements, global_shape, spec.tensor_meta.dtype, dim_sizes)


def renumber(placements, mapping):
    """Placements with each ``Shard(d)`` moved to ``Shard(mapping[d])``."""
    return tuple(Shard(mapping[p.dim]) if issubclass(type(p), Shard) else p for p in placements)


def without_dim(placements, dim_sizes, dim: int):
    """Placements and tables after dropping unsharded tensor dim ``dim``."""
    ndim = len(dim_sizes)
    mapping = {d: d - (d > dim) for d in range(ndim) if d != dim}
    return renumber(placements, mapping), dim_sizes[:dim] + dim_sizes[dim + 1 :]


def with_new_dim(placements, dim_sizes, dim: int):
    """Placements and tables after inserting an unsharded tensor dim at ``dim``."""
    mapping = {d: d + (d >= dim) for d in range(len(dim_sizes))}
    return renumber(placements, mapping), dim_sizes[:dim] + (None,) + dim_sizes[dim:]


def ndim_of(x) -> int:
    """Number of dims of ShardTensor ``x`` (read from its spec, not through torch-function)."""
    return len(x._spec.global_shape)


def _sharded(spec, dims) -> list[int]:
    return [d for d in dims if spec.dim_sizes[d] is not None]


# --------------------------------------------------------------------------- #
# view / _unsafe_view
# --------------------------------------------------------------------------- #
def _plan_view(func, spec, size):
    out_shape = tuple(func(_meta(spec), size).shape)
    in_shape = spec.global_shape
    moved = None
    layout = output_layout(in_shape, out_shape, spec.placements, spec.dim_sizes)
    if layout is None:
        placements, tables = compatible_layout(in_shape, out_shape, spec.placements, spec.dim_sizes, spec.mesh_shape)
        moved = spec = spec.with_layout(placements, tables)
        layout = output_layout(in_shape, out_shape, spec.placements, spec.dim_sizes)
    out = derived_spec(spec, layout[0], out_shape, layout[1])
    # reshape aliases whenever a view is possible, like the global op.
    return moved, out, torch.Tensor.reshape, (tuple(out.local_shape),)


# --------------------------------------------------------------------------- #
# view(dtype)
# --------------------------------------------------------------------------- #
def _dim_sizes_as(spec, dtype, old_size: int, new_size: int):
    """Size tables after viewing ``spec``'s elements as ``dtype``: only the last dim's scale.

    Only metadata every rank holds decides, so a refusal is the same on every rank.
    """
    if old_size == new_size or spec.dim_sizes[-1] is None:
        return spec.dim_sizes
    table = spec.dim_sizes[-1]
    if old_size > new_size:
        return spec.dim_sizes[:-1] + (tuple(n * (old_size // new_size) for n in table),)
    ratio = new_size // old_size
    if any(n % ratio for n in table):
        raise PlacementError(
            f"view(dtype={dtype}) packs {ratio} {spec.tensor_meta.dtype} elements into one along the "
            f"last dim, which is sharded with shard sizes {list(table)}: each must be a multiple of "
            f"{ratio}. Redistribute first (x.redistribute(placements=...)) so that the last dim is "
            f"not sharded or is split in multiples of {ratio}."
        )
    return spec.dim_sizes[:-1] + (tuple(n // ratio for n in table),)


def _reinterpretable(local, dtype, old_size: int, new_size: int) -> bool:
    """Whether this rank's memory allows ``local.view(dtype)`` (torch's own conditions).

    The global tensor is contiguous, but a local piece can be a strided view
    (after a transpose or a slice) or an empty shard whose strides torch refuses,
    so this differs between ranks and must not decide anything visible.
    """
    if old_size == new_size:
        return True
    if local.numel() == 0 or local.stride(-1) != 1:
        return False
    ratio = new_size // old_size
    return new_size < old_size or (
        local.storage_offset() % ratio == 0 and all(s % ratio == 0 for s in local.stride()[:-1])
    )


def _view_dtype(func, args, kwargs):
    x, dtype = args
    out_shape = tuple(func(meta_like(x), dtype).shape)  # torch's own checks and messages
    old_size, new_size = x._spec.tensor_meta.dtype.itemsize, dtype.itemsize
    tables = _dim_sizes_as(x._spec, dtype, old_size, new_size)
    local, spec = resolve_partial(x) if dtype != x._spec.tensor_meta.dtype else (x._local_tensor, x._spec)
    out_spec = type(spec).from_sizes(spec.mesh, spec.placements, out_shape, dtype, tables)
    if _reinterpretable(local, dtype, old_size, new_size):
        return wrap(func(local, dtype), out_spec)
    if local.numel() == 0:
        return wrap(local.new_empty(tuple(out_spec.local_shape), dtype=dtype), out_spec)
    # Like reshape: a copy where this rank's memory cannot be viewed, an alias elsewhere.
    return wrap(func(local.clone(memory_format=torch.contiguous_format), dtype), out_spec)


# --------------------------------------------------------------------------- #
# view_as_real / view_as_complex
# --------------------------------------------------------------------------- #
def _linear_local(x):
    """Local tensor and spec of ``x`` with only pending sums/averages kept (reinterpretations are linear in them)."""
    keep = {m for m, p in enumerate(x._spec.placements) if not issubclass(type(p), Partial) or p.reduce_op in ("sum", "avg")}
    others = [m for m in range(len(x._spec.placements)) if m not in keep]
    return resolve_partial(x, others) if others else (x._local_tensor, x._spec)


def _view_as_real(func, args, kwargs):
    (x,) = args
    out_shape = tuple(func(meta_like(x)).shape)  # torch's own check and message (complex input)
    local, spec = _linear_local(x)
    out = func(local)
    tables = spec.dim_sizes + (None,)
    return wrap(out, type(spec).from_sizes(spec.mesh, spec.placements, out_shape, out.dtype, tables))


def _complex_viewable(local: torch.Tensor) -> bool:
    """torch's conditions for ``view_as_complex``: unit last stride, even strides and offset.

    A local piece can be strided differently from the global tensor (a slice,
    a transpose, an empty shard), so this differs between ranks and only
    decides whether this rank copies, never anything visible.
    """
    return (
        local.stride(-1) == 1
        and local.storage_offset() % 2 == 0
        and all(s % 2 == 0 for s in local.stride()[:-1])
    )


def _view_as_complex(func, args, kwargs):
    (x,) = args
    out_shape = tuple(func(meta_like(x)).shape)  # torch's own checks (float dtype, last dim of size 2)
    spec = x._spec
    last = len(spec.global_shape) - 1
    if spec.dim_sizes[last] is not None:
        mesh_dims = [m for m, p in enumerate(spec.placements) if issubclass(type(p), Shard) and p.dim == last]
        raise PlacementError(
            f"view_as_complex: the last dim (the real and imaginary parts, size 2) is sharded over mesh "
            f"dim(s) {mesh_dims} with shard sizes {list(spec.dim_sizes[last])}, so a number's two parts "
            f"live on different ranks. Redistribute first so that the last dim is whole on every rank, "
            f"e.g. x.redistribute(placements=...) sharding another dim or Replicate()."
        )
    local, spec = _linear_local(x)
    if not _complex_viewable(local):
        local = local.clone(memory_format=torch.contiguous_format)  # this rank's memory cannot be viewed
    out = func(local)
    return wrap(out, type(spec).from_sizes(spec.mesh, spec.placements, out_shape, out.dtype, spec.dim_sizes[:-1]))


# --------------------------------------------------------------------------- #
# permute / transpose / t
# --------------------------------------------------------------------------- #
def _permuted(spec, perm):
    inverse = {d: i for i, d in enumerate(perm)}
    placements = renumber(spec.placements, inverse)
    tables = tuple(spec.dim_sizes[d] for d in perm)
    shape = tuple(spec.global_shape[d] for d in perm)
    return derived_spec(spec, placements, shape, tables)


def _plan_permute(func, spec, dims):
    func(_meta(spec), dims)
    perm = [normalize_dim(d, len(spec.global_shape)) for d in dims]
    return None, _permuted(spec, perm), func, (dims,)


def _plan_transpose(func, spec, *dims):
    func(_meta(spec), *dims)
    perm = list(range(len(spec.global_shape)))
    if func is aten.t.default:
        perm.reverse()
    else:
        a, b = (normalize_dim(d, len(perm)) for d in dims)
        if perm:
            perm[a], perm[b] = perm[b], perm[a]
    return None, _permuted(spec, perm), func, dims


# --------------------------------------------------------------------------- #
# unsqueeze / squeeze
# --------------------------------------------------------------------------- #
def _plan_unsqueeze(func, spec, dim):
    func(_meta(spec), dim)
    d = normalize_dim(dim, len(spec.global_shape) + 1)
    placements, tables = with_new_dim(spec.placements, spec.dim_sizes, d)
    shape = spec.global_shape[:d] + (1,) + spec.global_shape[d:]
    return None, derived_spec(spec, placements, shape, tables), torch.Tensor.unsqueeze, (d,)


def _plan_squeeze(func, spec, *dims):
    func(_meta(spec), *dims)
    ndim = len(spec.global_shape)
    if not dims:
        dims = range(ndim)
    elif isinstance(dims[0], int):
        dims = dims[:1]
    else:
        dims = dims[0]
    drop = sorted({normalize_dim(d, ndim) for d in dims} if ndim else ())
    drop = [d for d in drop if spec.global_shape[d] == 1]
    moved = None
    if _sharded(spec, drop):
        moved = spec = unshard_target(spec, tuple(drop), keep_partial=True)
    keep = [d for d in range(ndim) if d not in drop]
    mapping = {d: i for i, d in enumerate(keep)}
    placements = renumber(spec.placements, mapping)
    tables = tuple(spec.dim_sizes[d] for d in keep)
    shape = tuple(spec.global_shape[d] for d in keep)
    return moved, derived_spec(spec, placements, shape, tables), torch.Tensor.squeeze, (tuple(drop),)


# --------------------------------------------------------------------------- #
# expand
# --------------------------------------------------------------------------- #
def _plan_expand(func, spec, size, *rest, **kwargs):
    out_shape = tuple(func(_meta(spec), size, *rest, **kwargs).shape)
    ndim = len(spec.global_shape)
    lead = len(out_shape) - ndim
    grown = [d for d in range(ndim) if spec.global_shape[d] != out_shape[lead + d]]
    moved = None
    if _sharded(spec, grown):
        moved = spec = unshard_target(spec, tuple(grown), keep_partial=True)
    local_shape = spec.local_shape
    local_size = tuple(out_shape[:lead]) + tuple(
        out_shape[lead + d] if d in grown else local_shape[d] for d in range(ndim)
    )
    placements = renumber(spec.placements, {d: d + lead for d in range(ndim)})
    tables = (None,) * lead + tuple(spec.dim_sizes)
    return moved, derived_spec(spec, placements, out_shape, tables), func, (local_size, *rest)


# --------------------------------------------------------------------------- #
# Propagation apart from execution
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class ViewPlan:
    """A view op decided from metadata: the input's layout before the local op, the output, the local op.

    ``moved`` is None when the input stays as it is; ``local_op(local,
    *local_args, **dict(local_kwargs))`` makes this rank's output.
    """

    moved: object
    out: object
    local_op: object
    local_args: tuple
    local_kwargs: tuple
    plan: OpPlan


_PLANNERS = {}  # filled below RULES: ATen op -> its planner


@lru_cache(maxsize=4096)
def propagate(func, spec, args: tuple, kwargs: tuple) -> ViewPlan:
    """The pure half of a view op: memoised on the op, the input spec and the (frozen) other arguments.

    Bad arguments raise torch's own error (checked on a meta tensor of the
    global shape), on every rank alike; errors are not memoised.
    """
    moved, out, local_op, local_args = _PLANNERS[func](func, spec, *args, **dict(kwargs))
    steps = () if moved is None else redistribution_steps(spec, moved, 0)
    local_kwargs = kwargs if local_op is func else ()
    return ViewPlan(moved, out, local_op, local_args, local_kwargs, OpPlan((out,), steps, (moved,)))


def _freeze(a):
    """A hashable stand-in for an argument (lists of sizes become tuples)."""
    return tuple(_freeze(v) for v in a) if isinstance(a, (list, tuple)) else a


def _own_shape(size, spec) -> bool:
    """Whether ``size`` (a view's argument) is the global shape of ``spec`` itself, as plain ints."""
    shape = spec.global_shape
    if len(size) != len(shape):
        return False
    for s, g in zip(size, shape):
        if type(s) is not int or s != g:  # symbolic sizes and -1 take the planned path
            return False
    return True


def _same_shape_view(x):
    """``view``/``_unsafe_view`` to the tensor's own shape (what AOTAutograd runs on every compiled output).

    The output has the input's spec, and its local tensor is the local
    tensor's view to its own shape, as the planned path computes it
    (``reshape`` to an unchanged shape is a view): no plan lookup.
    """
    local = x._local_tensor
    return wrap(local.view_as(local), x._spec)  # view_as: ~0.7 us, view(local.shape) ~2.5 (its size argument's parsing)


def _planned(func, args, kwargs):
    """The rule of every planned view op: look the plan up, run it on the local tensor."""
    x = args[0]
    if func in _SHAPE_VIEWS and not kwargs and len(args) == 2 and _own_shape(args[1], x._spec):
        return _same_shape_view(x)
    key = (func, x._spec, _freeze(args[1:]), tuple(sorted(kwargs.items())))
    try:
        vp = propagate(*key)
    except TypeError as unhashable:  # e.g. symbolic sizes: planned, not memoised
        if "unhashable" not in str(unhashable):
            raise
        vp = propagate.__wrapped__(*key)
    local = x._local_tensor if vp.moved is None else redistribute_local(x._local_tensor, x._spec, vp.moved)
    return wrap(vp.local_op(local, *vp.local_args, **dict(vp.local_kwargs)), vp.out)


def _propagate_entry(func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for this family (the input given by its spec)."""
    return propagate(func, args[0], _freeze(args[1:]), tuple(sorted(kwargs.items()))).plan


def _meta(spec) -> torch.Tensor:
    return torch.empty(spec.global_shape, dtype=spec.tensor_meta.dtype, device="meta")


def _as_strided(func, args, kwargs):
    raise NotImplementedError(
        f"ShardTensor does not support {func}: strides of the global tensor do not describe "
        "any rank's local memory. Use view/reshape/permute/narrow (which ShardTensor translates), "
        "or gather first with x.full_tensor()."
    )


_SHAPE_VIEWS = frozenset((aten.view.default, aten._unsafe_view.default))

_REQUIRES_GRAD = TensorBase.requires_grad.__get__


def _unsafe_view_unrecorded(func, types, args, kwargs):
    """``aten._unsafe_view(x, x.shape)`` that autograd does not record, served above the dispatcher.

    AOTAutograd runs it on every output of a compiled region that aliases
    another output (``q, k, v = proj(x).chunk(3)``), with grad mode off, to hide
    the aliasing from autograd. ``_unsafe_view`` is no view to autograd (its
    output shares no version counter or base with ``x``) and nothing is
    recorded, so the result is what the dispatcher path computes (a new
    wrapper around the local tensor viewed to its own shape, same spec:
    :func:`_same_shape_view`) without the trip through it (~10 us a call).
    Anything else declines and takes the ordinary path.
    """
    if kwargs or len(args) != 2 or type(args[0]) is not shard_tensor_cls():
        return NotImplemented
    x = args[0]
    if not _own_shape(args[1], x._spec):
        return NotImplemented
    if torch.is_grad_enabled():
        with torch_function_disabled():
            if _REQUIRES_GRAD(x):
                return NotImplemented
    return _same_shape_view(x)


def _ordinary(func, types, args, kwargs):
    """The call as the hook runs an op without a handler (promoted arguments, to the dispatcher)."""
    with torch_function_disabled():
        return func(*args, **kwargs)


_ordinary.before_promotion = _unsafe_view_unrecorded

_PLANNERS.update({
    aten.view.default: _plan_view,
    aten._unsafe_view.default: _plan_view,
    aten.permute.default: _plan_permute,
    aten.transpose.int: _plan_transpose,
    aten.t.default: _plan_transpose,
    aten.unsqueeze.default: _plan_unsqueeze,
    aten.squeeze.default: _plan_squeeze,
    aten.squeeze.dim: _plan_squeeze,
    aten.squeeze.dims: _plan_squeeze,
    aten.expand.default: _plan_expand,
})

RULES: dict = {
    **{op: _planned for op in _PLANNERS},
    aten.view.dtype: _view_dtype,
    aten.view_as_real.default: _view_as_real,
    aten.view_as_complex.default: _view_as_complex,
    aten.as_strided.default: _as_strided,
    aten.as_strided_.default: _as_strided,
}
#: AOTAutograd calls the packet (``torch.ops.aten._unsafe_view(o, o.shape)``), which reaches the hook as the
#: packet and then as its default overload.
FUNCTIONS: dict = {aten._unsafe_view: _ordinary, aten._unsafe_view.default: _ordinary}

#: ``propagation.plan`` entries of this family (the ops planned apart from execution).
PROPAGATORS: dict = {op: _propagate_entry for op in _PLANNERS}
