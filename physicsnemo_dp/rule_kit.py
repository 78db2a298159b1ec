"""The rule kit: what every op family (``rules/``, ``spatial/``, ``attention/``) builds on.

It sits below the dispatch hooks and the ShardTensor class, so families depend
on it and never on the layers that call them: ``wrap`` a local result in a
spec, move a local tensor to another layout (``to_layout``, ``resolve_partial``,
``unshard_dims``), bring a gradient to its input's layout (``grad_like``), and
ask torch for an op's global output shape on meta tensors (``meta_output``).

The ShardTensor class itself is defined above this module. ``shard_tensor.py``
registers it here once, at import (:func:`_register_shard_tensor_cls`), which
is how code below the class builds instances without importing upward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from . import _gathers
from ._redistribute import grad_layout, redistribute_local
from ._torch_compat import pytree

_SHARD_TENSOR_CLS = None


def _register_shard_tensor_cls(cls) -> None:
    """Called once by ``shard_tensor.py`` when the class is defined."""
    global _SHARD_TENSOR_CLS
    _SHARD_TENSOR_CLS = cls


def shard_tensor_cls():
    """The ShardTensor class (a module-global read: this runs several times per op)."""
    return _SHARD_TENSOR_CLS


# Names of attributes that code below the class keeps on a local tensor's untyped storage and that must
# survive torch.compile's tracing (see :func:`carry_storage_tag`). Filled at import by the modules that own them.
_CARRIED_STORAGE_TAGS: list = []


def carry_storage_tag(name: str) -> None:
    """Make the storage attribute ``name`` travel with a ShardTensor through torch.compile's tracing.

    Eagerly a view of a local tensor shares its storage, so an attribute set on
    ``local.untyped_storage()`` is seen through every view (the graphs find
    their index tensors this way). While torch.compile traces, the local
    tensors are fake or functional stand-ins with storages of their own: the
    ShardTensor's ``__tensor_flatten__`` context carries the attribute's value
    and ``__tensor_unflatten__`` sets it on the stand-in's storage, which the
    stand-in's views share too. The value is compared in Dynamo's guards
    (``==``): keep it small and hashable (e.g. a ``weakref.ref``). Called once
    per name, at import.
    """
    if name not in _CARRIED_STORAGE_TAGS:
        _CARRIED_STORAGE_TAGS.append(name)


def storage_tags(local: torch.Tensor) -> tuple:
    """``((name, value), ...)`` of the carried attributes set on ``local``'s storage (flatten context)."""
    if not _CARRIED_STORAGE_TAGS:
        return ()
    storage = local.untyped_storage()
    tags = ()
    for name in _CARRIED_STORAGE_TAGS:  # a loop, not a generator: this runs for every tensor a compiled region sees
        value = getattr(storage, name, None)
        if value is not None:
            tags += ((name, value),)
    return tags


def restore_storage_tags(local: torch.Tensor, tags: tuple) -> None:
    """Set the carried attributes ``tags`` (from :func:`storage_tags`) on ``local``'s storage."""
    if tags:
        storage = local.untyped_storage()
        for name, value in tags:
            setattr(storage, name, value)


def bind_args(func, args, kwargs) -> dict:
    """Arguments of an ATen call by schema name: positional, then keywords, then defaults (None if none)."""
    try:
        params = _SCHEMA_PARAMS[func]
    except KeyError:  # first call of this op: its schema read once (``_schema.arguments`` builds objects per read)
        params = _SCHEMA_PARAMS[func] = _schema_params(func)
    except TypeError:  # an unhashable callable: read its schema every time
        params = _schema_params(func)
    bound = {}
    n = len(args)
    i = 0
    for name, kwarg_only, default in params:
        if not kwarg_only and i < n:
            bound[name] = args[i]
            i += 1
        elif name in kwargs:
            bound[name] = kwargs[name]
        else:
            bound[name] = list(default) if type(default) is list else default  # a caller may change a list
    return bound


def _schema_params(func) -> tuple:
    """``(name, kwarg_only, default or None)`` of every argument of ``func``'s schema, in order."""
    return tuple(
        (a.name, a.kwarg_only, a.default_value if a.has_default_value() else None) for a in func._schema.arguments
    )


#: op -> :func:`_schema_params` (schemas never change; one entry per op ever bound)
_SCHEMA_PARAMS: dict = {}


def broadcast_shape(*shapes) -> tuple[int, ...]:
    """Broadcast of int shapes (a plain-Python ``torch.broadcast_shapes``, much cheaper)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, ndim - len(shape)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} cannot be broadcast together")
                out[i] = n
    return tuple(out)


def wrap(local: torch.Tensor, spec):
    """A ShardTensor around ``local`` with ``spec`` (dtype taken from ``local``; not requiring grad)."""
    if spec.tensor_meta.dtype != local.dtype:
        spec = type(spec).from_sizes(spec.mesh, spec.placements, spec.global_shape, local.dtype, spec.dim_sizes)
    return _SHARD_TENSOR_CLS._of_local(local, spec)


def to_layout(x, spec, *, implicit: bool = True) -> torch.Tensor:
    """Local tensor of ShardTensor ``x`` in the layout (placements and sizes) of ``spec``.

    ``implicit=False`` where the result must be whole by definition (a Python
    value out of a tensor): a gather is then not reported as implicit
    (:mod:`physicsnemo_dp._gathers`).
    """
    own = x._spec
    if own is spec or (own.placements == spec.placements and own.dim_sizes == spec.dim_sizes):
        return x._local_tensor
    return redistribute_local(x._local_tensor, x._spec, spec, implicit=implicit)


def resolve_partial(x, mesh_dims=None):
    """Local tensor and spec of ``x`` with pending reductions on ``mesh_dims`` done (all if None)."""
    placements = tuple(
        Replicate() if issubclass(type(p), Partial) and (mesh_dims is None or m in mesh_dims) else p
        for m, p in enumerate(x._spec.placements)
    )
    if placements == x._spec.placements:
        return x._local_tensor, x._spec
    spec = x._spec.with_layout(placements, x._spec.dim_sizes)
    return redistribute_local(x._local_tensor, x._spec, spec), spec


def replicated_to_box(t: torch.Tensor, spec) -> torch.Tensor:
    """Slice a tensor that every rank holds in full down to this rank's box of ``spec``.

    ``t`` may have fewer dims than the spec (broadcasting aligns trailing dims)
    and extent 1 along dims it broadcasts; those are left alone.
    """
    offset = len(spec.global_shape) - t.ndim
    offsets = spec.local_offsets()
    local_shape = spec.local_shape
    for d, table in enumerate(spec.dim_sizes):
        td = d - offset
        if table is None or td < 0 or t.shape[td] == 1:
            continue
        t = t.narrow(td, offsets[d], local_shape[d])
    return t


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``[0, ndim)``; raises IndexError like torch for out-of-range dims."""
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim % max(ndim, 1)


def unshard_dims(x, dims, *, keep_partial: bool = False):
    """Local tensor and spec of ``x`` laid out so that none of ``dims`` is sharded.

    Each mesh dim that shards one of ``dims`` moves its shard to the largest
    other tensor dim that is free (one all-to-all, memory stays O(local)); only
    when no dim is free does it gather (Replicate). Pending reductions are
    resolved unless ``keep_partial``. Use it for ops that need a whole dim
    (softmax along the shard dim, cat along it, sort, ...), then bring the
    result back with :func:`to_layout` if the output should keep ``x``'s layout.
    """
    spec = x._spec
    new_spec = unshard_target(spec, tuple(dims), keep_partial)
    if new_spec is spec:
        return x._local_tensor, spec
    return redistribute_local(x._local_tensor, spec, new_spec), new_spec


@functools.lru_cache(maxsize=1024)
def unshard_target(spec, dims: tuple, keep_partial: bool = False):
    """The layout :func:`unshard_dims` moves a tensor of layout ``spec`` to (``spec`` itself if none).

    Pure and memoised on the spec (size tables included) and the dims.
    """
    from torch.distributed.tensor.placement_types import Shard

    from ._redistribute import target_layout

    ndim = len(spec.global_shape)
    dims = {normalize_dim(d, ndim) for d in dims}
    placements = list(spec.placements)
    used = {p.dim for p in placements if issubclass(type(p), Shard) and p.dim not in dims}
    for m, p in enumerate(placements):
        if issubclass(type(p), Shard) and p.dim in dims:
            free = [
                e for e in range(ndim)
                if e not in dims and e not in used and spec.global_shape[e] >= spec.mesh.size(m)
            ]
            if free:
                e = max(free, key=lambda e: spec.global_shape[e])
                placements[m] = Shard(e)
                used.add(e)
            else:
                placements[m] = Replicate()
        elif issubclass(type(p), Partial) and not keep_partial:
            placements[m] = Replicate()
    if tuple(placements) == spec.placements:
        return spec
    layout = target_layout(spec, placements)
    return spec.with_layout(layout.placements, layout.dim_sizes)


def grad_like(result, spec):
    """``result`` redistributed to the gradient layout of an input of layout ``spec``.

    Sharded dims take the input's shard sizes. Where the input is replicated
    (not pending) a pending sum may stay pending: it is reduced by whoever needs
    the value, e.g. once by the promotion step of a plain weight. A result
    already in that layout is returned as is, without building a spec.
    """
    src = result._spec
    target, placements = _grad_like_placements(src, spec)
    if placements == src.placements and target.dim_sizes == src.dim_sizes:
        return result
    dst = target.with_layout(placements, target.dim_sizes)
    # a gradient in its input's layout: where the input is whole, so is its gradient (not an implicit gather)
    return wrap(redistribute_local(result._local_tensor, src, dst, implicit=False), dst)


def _grad_like_placements(src, spec):
    """The gradient layout of an input of spec ``spec`` and the placements :func:`grad_like` gives a result of spec ``src``."""
    target = grad_layout(spec)
    placements = tuple(
        rp if issubclass(type(p), Replicate) and issubclass(type(rp), Partial) and rp.reduce_op in ("sum", "avg") else tp
        for p, tp, rp in zip(spec.placements, target.placements, src.placements)
    )
    return target, placements


def grad_like_is_identity(src, spec) -> bool:
    """Whether :func:`grad_like` returns a result of spec ``src`` as it is, for an input of spec ``spec``.

    Pure in the two specs: a caller that knows its result's spec in advance
    (a memoised plan) decides once.
    """
    target, placements = _grad_like_placements(src, spec)
    return placements == src.placements and target.dim_sizes == src.dim_sizes


def plain_gradient(g: torch.Tensor, spec):
    """A plain tensor that autograd delivers as the gradient of a ShardTensor of layout ``spec``, as a ShardTensor.

    Some backward formulas build their result with a factory that has no
    tensor argument (``at::zeros(self.sizes())``, ``_efficientzerotensor``:
    e.g. ``repeat`` with a zero repeat, ``normal``'s mean), which never reaches
    ``__torch_dispatch__`` and yields a plain tensor of the *global* shape.
    Such a tensor is read as the full gradient held by every rank: this rank's
    box of it, in the gradient layout of ``spec`` (a ZeroTensor becomes local
    zeros; nothing global is allocated). Any other shape is this rank's local
    gradient (a plain tensor assigned to ``.grad`` by hand).
    """
    from ._torch_compat import is_zero_tensor

    target = grad_layout(spec)
    if tuple(g.shape) != tuple(spec.global_shape):
        return wrap(g, target)
    if is_zero_tensor(g):
        return wrap(torch.zeros(target.local_shape, dtype=g.dtype, device=g.device), target)
    if tuple(target.local_shape) != tuple(g.shape):  # torch already built it whole on every rank: say so
        _gathers.note(
            "plain gradient of the global shape",
            f"built by a backward formula ({tuple(g.shape)} {g.dtype})",
            g.numel() * g.element_size(),
            spec.mesh,
            fix="compose the op from ops with sharded rules, or use physicsnemo_dp.fallback('gather') knowingly",
        )
    local = g
    for d, (offset, n) in enumerate(zip(target.local_offsets(), target.local_shape)):
        if n != g.shape[d]:
            local = local.narrow(d, offset, n)
    return wrap(local, target)


# --------------------------------------------------------------------------- #
# Global metadata of a call
# --------------------------------------------------------------------------- #
def meta_output(func, args, kwargs):
    """``func`` run on meta tensors of the global shapes.

    Gives the global output and, for bad arguments, torch's own error, raised
    identically on every rank (it depends only on global metadata) before any
    communication starts. Memoised on the call's metadata: some meta kernels
    are Python decompositions (``layer_norm``'s costs ~2 ms), and a model
    makes the same calls every step. Callers only read the result's shapes.
    """
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    key = tuple(_meta_leaf(a) for a in leaves)
    try:
        return _meta_call(func, tree, key)
    except TypeError as unhashable:  # an argument without a hash: run it uncached
        if "unhashable" not in str(unhashable):
            raise
        return _meta_call.__wrapped__(func, tree, key)


@dataclass(frozen=True)
class _MetaArg:
    """A tensor argument of :func:`meta_output`, by its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _meta_leaf(a):
    if isinstance(a, shard_tensor_cls()):
        return _MetaArg(tuple(a._spec.global_shape), a._local_tensor.dtype)
    if isinstance(a, torch.Tensor):
        return _MetaArg(tuple(a.shape), a.dtype)
    return a


@functools.lru_cache(maxsize=1024)
def _meta_call(func, tree, key):
    leaves = [torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, _MetaArg) else a for a in key]
    margs, mkwargs = pytree.tree_unflatten(leaves, tree)
    return func(*margs, **mkwargs)
