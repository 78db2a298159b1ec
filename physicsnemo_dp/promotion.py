"""What happens when a plain ``torch.Tensor`` (or a DTensor) meets a ShardTensor.

A plain tensor in an op with sharded data is almost always a model weight
(replicated by DDP, all-gathered by FSDP2). *Promotion* treats it as
``Replicate`` on the ShardTensor's mesh and, in backward, sums its gradient
over that mesh so it equals the single-process gradient. DTensors are
converted with ``ShardTensor.from_dtensor`` and keep their own gradient
convention.

The step is the differentiable :class:`Promote`; :func:`promote_args` applies
it to an op's arguments. The ``__torch_function__`` hook calls it before every
op, and rules that build a replicated operand themselves (``matmul``) use
:func:`promote` directly. The plain tensors of one call (a layer's weight and
bias) are promoted by one node, whose backward sums all their gradients in one
collective: a collective's fixed cost (a launch on GPUs, several messages and
the transport threads' wake-ups with gloo) is paid once per layer, not once
per parameter, for the same bytes.

The mode is explicit, resettable state: :func:`set_promotion_mode` and the
:func:`promotion_mode` context manager (which always restores the previous
mode) — tests can change it without leaking into each other.

Repeated promotion costs close to nothing (:func:`promote`): a model applies
the same weights on every call, so the promoted view of a plain tensor is
kept and handed out again while the tensor is the same object with the same
version counter and storage (an optimizer step or any in-place write bumps
the version, and the next call promotes afresh). Reusing it is exact: the
view aliases the weight's memory, and every use within a step feeds one
``Promote`` node, whose backward then all-reduces the summed gradient once.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
import weakref
from collections import OrderedDict
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from . import _gathers
from ._redistribute import redistribute_local
from ._torch_compat import Function, dynamo_frame_hook_active, eval_frame_callback, pytree, storage_key
from .errors import PlacementError, PromotionError
from .rule_kit import shard_tensor_cls
from .spec import ShardTensorSpec

__all__ = [
    "TensorPromotionMode", "set_promotion_mode", "get_promotion_mode", "promotion_mode", "promote", "promote_together",
    "bucket_gradients", "clear_gradient_buckets",
]


class TensorPromotionMode(enum.Enum):
    """How a plain tensor meeting a ShardTensor is handled."""

    #: No promotion: a plain tensor meeting sharded data raises, unless it is a
    #: 0-dim tensor without grad (a scalar; a scalar parameter's gradient needs promotion).
    DISABLED = "disabled"
    #: Promote to Replicate and warn on every promotion (to find where it happens).
    WARN = "warn"
    #: Promote to Replicate silently. The default.
    SILENT = "silent"


_mode = TensorPromotionMode.SILENT


def _coerce(mode) -> TensorPromotionMode:
    if isinstance(mode, TensorPromotionMode):
        return mode
    if isinstance(mode, str):
        try:
            return TensorPromotionMode(mode.lower())
        except ValueError:
            pass
    choices = ", ".join(repr(m.value) for m in TensorPromotionMode)
    raise ValueError(f"mode must be a TensorPromotionMode or one of {choices}, got {mode!r}")


def set_promotion_mode(mode) -> None:
    """Set the promotion mode (enum or ``"disabled"`` / ``"warn"`` / ``"silent"``)."""
    global _mode
    _mode = _coerce(mode)


def get_promotion_mode() -> TensorPromotionMode:
    """The active promotion mode (``SILENT`` unless changed)."""
    return _mode


@contextlib.contextmanager
def promotion_mode(mode) -> Iterator[TensorPromotionMode]:
    """Use ``mode`` inside the block; the previous mode returns on exit, also on errors."""
    previous = get_promotion_mode()
    set_promotion_mode(mode)
    try:
        yield get_promotion_mode()
    finally:
        set_promotion_mode(previous)


# --------------------------------------------------------------------------- #
# The promotion step
# --------------------------------------------------------------------------- #
def _is_dtensor(x) -> bool:
    return isinstance(x, DTensor)


def _needs_promotion(x, ShardTensor) -> bool:
    """Plain tensors and DTensors, except plain 0-dim tensors that need no gradient (scalars).

    A 0-dim DTensor left as it is reaches DTensor's dispatch, which refuses the
    ShardTensor beside it; a 0-dim plain tensor that requires grad (a scalar
    parameter) would get the unreduced, per-rank gradient as a ShardTensor.
    """
    return (
        isinstance(x, torch.Tensor) and not isinstance(x, ShardTensor)
        and (x.ndim > 0 or x.requires_grad or _is_dtensor(x))
    )


class Promote(Function):
    """Plain tensors of one call -> Replicate ShardTensors; their gradients summed over the mesh together.

    ``Promote.apply(mesh, *plains)`` returns one view per tensor (the view
    itself for one tensor). Backward reduces every gradient that is a pending
    sum of the same kind in one collective over their concatenation
    (:func:`_summed`): the bytes of separate reductions, in fewer messages.
    """

    @staticmethod
    def forward(mesh, *plains):
        views = tuple(_replicated_view(p, mesh) for p in plains)
        return views[0] if len(views) == 1 else views

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.specs = (output._spec,) if isinstance(output, torch.Tensor) else tuple(o._spec for o in output)
        ctx.set_materialize_grads(False)  # a view whose gradient never came needs no zeros

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_summed(grads, ctx.specs))


def _replicated_view(plain, mesh):
    """``plain`` as a Replicate ShardTensor (aliasing its memory; no autograd node)."""
    return shard_tensor_cls()(plain.detach(), _replicated_spec(mesh, plain), requires_grad=False)


def _summed(grads, specs) -> list:
    """Each gradient of :class:`Promote`'s views as a plain tensor in the view's layout (whole on every rank).

    Gradients that are pending sums with the same placements (the usual case:
    a layer's weight and bias after a contraction over sharded rows) are
    concatenated and reduced in one collective, in the order of the views, so
    every rank issues the same collectives; any other layout is moved alone,
    and so is every gradient where the sum is over one rank (nothing moves,
    and packing would only copy).
    """
    ShardTensor = shard_tensor_cls()
    if len(grads) == 1:  # one tensor promoted (``x @ w``): nothing to pool
        return [_whole(grads[0], specs[0]) if isinstance(grads[0], ShardTensor) else grads[0]]
    out = list(grads)
    pools: dict = {}
    mesh = specs[0].mesh  # one Promote call, one mesh
    alone = tuple(mesh.size(m) == 1 for m in range(mesh.ndim))
    for i, g in enumerate(grads):
        if not isinstance(g, ShardTensor):
            continue  # no gradient, or a plain one (already whole)
        placements = g._spec.placements
        pooled = False  # a pending sum over more than one rank, of Replicate/Partial placements only
        if not _same_placements(placements, specs[i].placements):
            for m, p in enumerate(placements):
                kind = type(p)
                if issubclass(kind, Partial):
                    pooled = pooled or not alone[m]
                elif not issubclass(kind, Replicate):
                    pooled = False
                    break
        if pooled:  # else: already whole, another layout, or a sum over one rank (nothing to pack): moved alone
            pools.setdefault((placements, g._local_tensor.dtype), []).append(i)
        else:
            out[i] = _whole(g, specs[i])
    for (placements, dtype), members in pools.items():
        if len(members) == 1:  # one tensor: no buffer to pack
            out[members[0]] = _whole(grads[members[0]], specs[members[0]])
            continue
        flat = torch.cat([grads[i]._local_tensor.reshape(-1) for i in members])
        whole = redistribute_local(flat, *_flat_specs(mesh, placements, flat.numel(), dtype), implicit=False)
        for i, part in zip(members, whole.split_with_sizes([grads[i]._local_tensor.numel() for i in members])):
            out[i] = part.view(grads[i]._local_tensor.shape)
    return out


def _same_placements(a, b) -> bool:
    """``a == b`` for placement tuples, without torch's Python ``__eq__`` where the kinds or objects decide (~5 us)."""
    if a is b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is not y and (type(x) is not type(y) or x != y):
            return False
    return True


def _whole(grad, spec) -> torch.Tensor:
    """The local tensor of the ShardTensor ``grad`` moved to ``spec``'s layout (Replicate: the whole value)."""
    # a plain tensor's gradient is whole: not an implicit gather
    return redistribute_local(grad._local_tensor, grad._spec, spec, implicit=False)


def _flat_specs(mesh, placements, numel: int, dtype) -> tuple:
    """Specs of a 1-D buffer of ``numel`` elements: with ``placements`` (pending sums) and replicated (memoised)."""
    key = (id(mesh), placements, numel, dtype)
    hit = _SPECS.get(key)
    if hit is not None and hit[0].mesh is mesh:
        return hit
    specs = tuple(ShardTensorSpec.chunked(mesh, p, (numel,), dtype) for p in (placements, (Replicate(),) * mesh.ndim))
    if len(_SPECS) >= _CACHE_SIZE:
        _SPECS.clear()
    _SPECS[key] = specs
    return specs


_SPECS: dict = {}


def _replicated_spec(mesh, plain) -> ShardTensorSpec:
    """The Replicate spec of ``plain`` on ``mesh`` (memoised on the mesh object, shape and dtype)."""
    key = (id(mesh), tuple(plain.shape), plain.dtype)
    hit = _SPECS.get(key)
    if hit is not None and hit.mesh is mesh:
        return hit
    spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, key[1], plain.dtype)
    if len(_SPECS) >= _CACHE_SIZE:
        _SPECS.clear()
    _SPECS[key] = spec
    return spec


#: id(plain) -> (weak reference to plain, version, (storage identity, offset), mesh, promoted view).
#: The storage *identity* (not its data pointer) decides, so that a hit or a
#: miss is the same on every rank: FSDP2 frees and re-allocates an unsharded
#: parameter's storage in place (same storage object, new address, version
#: kept), and a per-rank address would let one rank reuse the previous step's
#: autograd node while another makes a new one. The engine orders nodes by
#: creation, so the ranks would then issue the gradient all-reduces in
#: different orders: a crash, or gradients summed with another weight's.
#: A ``.data`` swap or ``set_`` gives a new storage object, hence a miss.
_PROMOTED: OrderedDict = OrderedDict()
#: At most this many promoted views are kept (oldest first out). A kept view's
#: autograd node references its weight, so the bound is also what a deleted
#: model's weights can outlive it by; :func:`clear_promotion_cache` drops all.
_CACHE_SIZE = 1024


def clear_promotion_cache() -> None:
    """Forget every kept promoted view (they are rebuilt on the next call); buckets stay, their views go."""
    _PROMOTED.clear()
    _SPECS.clear()
    for _, bucket in _BUCKETS.values():
        bucket.mesh, bucket.views = None, None


def _forget(key, ref) -> None:
    entry = _PROMOTED.get(key)
    if entry is not None and entry[0] is ref:
        del _PROMOTED[key]


def promote(plain: torch.Tensor, mesh) -> "torch.Tensor":
    """``plain`` as a Replicate ShardTensor on ``mesh`` whose gradient is summed over the mesh.

    Without a gradient to track it is a plain wrap (no autograd node). With
    one, the :class:`Promote` view is kept and returned again while ``plain``
    is unchanged (same object, version counter and storage; same mesh
    object) and until a backward pass runs its node: a weight used by every
    layer call of a forward is promoted once per forward instead of once per
    use, and its gradient is reduced once. A node from an earlier forward is
    never reused: the engine orders nodes by creation, and an old node would
    run out of place in the new graph (after FSDP2's post-backward hook had
    already reduced and freed the parameter's gradient, say). Only leaves (parameters) are
    kept: a kept view of an intermediate result would keep its whole
    autograd graph alive. Traced code (``torch.compile``) and tensors
    without a version counter (inference mode) are never cached.
    """
    if not (plain.requires_grad and torch.is_grad_enabled()):
        return _replicated_view(plain, mesh)
    if _BUCKETS:
        view = _bucket_view(plain, mesh)
        if view is not None:
            return view
    key = id(plain)
    entry = _PROMOTED.get(key)
    # A kept entry's tensor passed the checks below when it was kept (leaf, type and inference mode do not change).
    if (
        entry is not None and entry[0]() is plain and entry[3] is mesh and entry[1] == plain._version
        and entry[2] == (storage_key(plain), plain.storage_offset()) and eval_frame_callback() is None
    ):
        return entry[4]
    if not _keepable(plain):
        return Promote.apply(mesh, plain)
    version, where = plain._version, (storage_key(plain), plain.storage_offset())
    out = Promote.apply(mesh, plain)
    ref = weakref.ref(plain, lambda ref, key=key: _forget(key, ref))
    _keep(key, (ref, version, where, mesh, out), out.grad_fn, ref)
    return out


def _keepable(plain) -> bool:
    """Whether a promoted view of ``plain`` may be kept (see :func:`promote`)."""
    return (
        plain.is_leaf and type(plain) in (torch.Tensor, torch.nn.Parameter)
        and not plain.is_inference() and not dynamo_frame_hook_active()
    )


def _keep(key, entry, node, ref) -> None:
    """Keep ``entry`` under ``key`` until the backward pass reaches ``node`` (the next forward makes a new one,
    so the engine runs it where it belongs in the new graph), or until ``ref``'s tensor dies."""
    node.register_prehook(lambda grad_outputs, key=key, ref=ref: _forget(key, ref))
    _PROMOTED[key] = entry
    _PROMOTED.move_to_end(key)
    while len(_PROMOTED) > _CACHE_SIZE:
        _PROMOTED.popitem(last=False)


def promote_together(plains, mesh) -> tuple:
    """:func:`promote` for the plain tensors of one call: one node, one reduction of their gradients.

    Kept and handed out again like a single promoted view, while every tensor
    is unchanged and the call passes the same tensors in the same order (a
    tensor given twice gets two views of one node; autograd sums their
    gradients). Tensors without a gradient to track are wrapped alone; under
    ``torch.compile`` each tensor gets its own node (what Dynamo traces is the
    single-tensor step).
    """
    key = tuple(map(id, plains))
    entry = _PROMOTED.get(key)
    if entry is not None and entry[3] is mesh and _unchanged(entry, plains) and eval_frame_callback() is None:
        return entry[4]
    if not torch.is_grad_enabled() or dynamo_frame_hook_active():
        return tuple(promote(p, mesh) for p in plains)
    if _BUCKETS and any(id(p) in _BUCKETS for p in plains):  # bucketed: the bucket's node, not one per call
        return tuple(promote(p, mesh) for p in plains)
    tracked = tuple(p for p in plains if p.requires_grad)
    if len(tracked) < 2:
        return tuple(promote(p, mesh) for p in plains)
    if len(tracked) < len(plains):
        views = iter(promote_together(tracked, mesh))
        return tuple(next(views) if p.requires_grad else _replicated_view(p, mesh) for p in plains)
    stamps = tuple(_stamp(p) for p in plains)
    views = Promote.apply(mesh, *plains)
    if all(_keepable(p) for p in plains):
        ref = weakref.ref(plains[0], lambda ref, key=key: _forget(key, ref))
        others = tuple(weakref.ref(p, lambda _, key=key, ref=ref: _forget(key, ref)) for p in plains[1:])
        _keep(key, (ref, others, stamps, mesh, views), views[0].grad_fn, ref)
    return views


def _stamp(plain) -> tuple:
    """What identifies ``plain``'s current values: version counter and storage (see :data:`_PROMOTED`)."""
    return plain._version, storage_key(plain), plain.storage_offset()


def _unchanged(entry, plains) -> bool:
    """Whether the tensors of a kept :func:`promote_together` entry are ``plains``, unchanged."""
    if entry[0]() is not plains[0]:
        return False
    for ref, p in zip(entry[1], plains[1:]):
        if ref() is not p:
            return False
    for stamp, p in zip(entry[2], plains):
        if stamp != (p._version, storage_key(p), p.storage_offset()):
            return False
    return True


# --------------------------------------------------------------------------- #
# Gradient buckets (opt-in): one node, and one reduction, for many layers
# --------------------------------------------------------------------------- #
class _Bucket:
    """Parameters promoted together on the first use of any of them in a forward.

    ``views`` holds the current forward's promoted views (``id -> (stamp,
    view)``) on ``mesh``; the node's backward reduces the gradients of all of
    them at once, when the last one has arrived.
    """

    def __init__(self, params):
        self.refs = tuple(weakref.ref(p) for p in params)
        self.mesh = None
        self.views: dict | None = None


#: id(parameter) -> (weak reference to it, its bucket); see :func:`bucket_gradients`.
_BUCKETS: dict = {}


def bucket_gradients(params, cap_mb: float | None = 25.0) -> int:
    """Reduce the promoted gradients of ``params`` in buckets, not one collective per layer call.

    ``params`` is a module (its parameters) or an iterable of parameters.
    They are cut into buckets of at most ``cap_mb`` MiB (None: one bucket),
    in reverse order, as DDP does (the last layers' gradients come first in
    backward). On the first use of any parameter of a bucket in a forward,
    the whole bucket is promoted by one :class:`Promote` node; its backward
    runs once the gradients of every parameter of the bucket used in that
    forward have arrived, and sums them over the mesh in one collective per
    layout and dtype (:func:`_summed`).

    Why: each collective has a fixed cost. With gloo on 4 ranks sharing 2
    cores the five all-reduces of a transformer block's parameter gradients
    cost 6-7 ms of the transport threads' CPU per rank and step, one
    all-reduce of the same values concatenated a fraction of that; on GPUs
    each is a launch. The price: a bucket's gradients are reduced, and
    written to ``.grad``, only when its last gradient is ready, so a
    reduction overlaps less of the backward (smaller buckets overlap more).
    ``.grad`` still holds the summed gradient when autograd accumulates it,
    so optimizers, DDP, gradient accumulation and checkpointing see what they
    see without buckets.

    A parameter used on another mesh than the bucket's current one, or
    changed in place since the bucket was promoted in this forward, makes the
    whole bucket promote afresh: a second node, and each node reduces the
    gradients that reached it (exact, one collective more). Under
    ``torch.compile``, and where a view of a parameter (``w.t()``) rather than
    the parameter itself meets the sharded data, promotion stays per call.
    Calling it again regroups the given parameters;
    :func:`clear_gradient_buckets` removes every bucket. The buckets decide
    the collectives, so every rank of a mesh must register the same
    parameters in the same order, as it builds the same model. Returns the
    number of buckets.
    """
    params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
    for p in params:
        if not isinstance(p, torch.Tensor) or type(p) not in (torch.Tensor, torch.nn.Parameter) or not p.is_leaf:
            what = type(p).__name__ if not isinstance(p, torch.Tensor) or p.is_leaf else f"{type(p).__name__} that is not a leaf"
            raise TypeError(
                f"bucket_gradients takes a module or plain leaf tensors (its parameters), got {what}; "
                "pass the model, or the parameters themselves rather than results computed from them"
            )
    if cap_mb is not None and not cap_mb > 0:
        raise ValueError(f"cap_mb must be positive or None (one bucket), got {cap_mb!r}")
    unique = list({id(p): p for p in params if p.requires_grad}.values())
    buckets, current, size = [], [], 0
    for p in reversed(unique):
        nbytes = p.numel() * p.element_size()
        if current and cap_mb is not None and size + nbytes > cap_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    _PROMOTED.clear()  # views kept per call before: the next forward promotes by bucket
    for members in buckets:
        bucket = _Bucket(members)
        for p in members:
            _BUCKETS[id(p)] = (weakref.ref(p, lambda ref, key=id(p): _unbucket(key, ref)), bucket)
    return len(buckets)


def clear_gradient_buckets() -> None:
    """Forget every bucket of :func:`bucket_gradients` (promotion goes back to one node per call)."""
    _BUCKETS.clear()
    _PROMOTED.clear()


def _unbucket(key, ref) -> None:
    entry = _BUCKETS.get(key)
    if entry is not None and entry[0] is ref:
        del _BUCKETS[key]


def _bucket_view(plain, mesh):
    """``plain``'s view from its bucket (promoting the bucket whole on its first use), or None: promote per call."""
    entry = _BUCKETS.get(id(plain))
    if entry is None or entry[0]() is not plain or not _keepable(plain) or eval_frame_callback() is not None:
        return None
    bucket = entry[1]
    views = bucket.views
    if views is not None and bucket.mesh is mesh:
        hit = views.get(id(plain))
        if hit is not None and hit[0] == _stamp(plain):
            return hit[1]
    members = [p for p in (ref() for ref in bucket.refs) if p is not None and p.requires_grad and _keepable(p)]
    promoted = Promote.apply(mesh, *members)
    promoted = (promoted,) if len(members) == 1 else promoted
    views = {id(p): (_stamp(p), v) for p, v in zip(members, promoted)}
    bucket.mesh, bucket.views = mesh, views

    def forget(grad_outputs, bucket=bucket, views=views):
        if bucket.views is views:  # backward reached this forward's node: the next forward promotes afresh
            bucket.mesh, bucket.views = None, None

    promoted[0].grad_fn.register_prehook(forget)
    return views[id(plain)][1]


def _top_level(func, args, kwargs, ShardTensor):
    """``(args, kwargs)`` promoted for the common call, or None for the general path.

    The common call has its tensors at top level, ShardTensors on one mesh
    object and, besides them, only plain tensors (no DTensors) under the
    SILENT mode that are not the destination of an in-place write. Scalars
    (0-dim plain tensors without grad) are left alone, as everywhere.
    """
    mesh, plain = None, 0
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) is ShardTensor:
            if mesh is None:
                mesh = a._spec.mesh
            elif a._spec.mesh is not mesh:
                return None
        elif isinstance(a, torch.Tensor):
            if isinstance(a, DTensor):
                return None
            if a.ndim > 0 or a.requires_grad:
                plain += 1
        elif isinstance(a, (list, tuple)):
            # A shape or a dim list (no tensors), or torch.cat's operands all ShardTensors: nothing inside to
            # promote, so no pytree walk. Anything else in a sequence takes the general path.
            for v in a:
                if type(v) is ShardTensor:
                    if mesh is None:
                        mesh = v._spec.mesh
                    elif v._spec.mesh is not mesh:
                        return None
                elif isinstance(v, (torch.Tensor, list, tuple, dict)):
                    return None
        elif isinstance(a, dict):
            return None
    if not plain:
        return args, kwargs
    if mesh is None or _mode is not TensorPromotionMode.SILENT or (
        args and type(args[0]) is not ShardTensor and _writes_into_plain(func, args, ShardTensor)
    ):
        return None
    if plain > 1:  # a layer's weight and bias: promoted together
        if not kwargs:
            return tuple(_promote_all(args, mesh, ShardTensor)), kwargs
        values = _promote_all((*args, *kwargs.values()), mesh, ShardTensor)
        return tuple(values[: len(args)]), dict(zip(kwargs, values[len(args) :]))
    # A list, not a generator, and the test of _promoted inlined: this runs on every op with a plain weight.
    args = tuple([
        promote(a, mesh) if type(a) is not ShardTensor and isinstance(a, torch.Tensor) and (a.ndim > 0 or a.requires_grad)
        else a
        for a in args
    ])
    if kwargs:
        kwargs = {k: _promoted(a, mesh, ShardTensor) for k, a in kwargs.items()}
    return args, kwargs


def _promoted(a, mesh, ShardTensor):
    """``a`` promoted if it is a plain tensor that needs it (see :func:`_needs_promotion`), else as it is."""
    if isinstance(a, torch.Tensor) and type(a) is not ShardTensor and (a.ndim > 0 or a.requires_grad):
        return promote(a, mesh)
    return a


def _promote_all(values, mesh, ShardTensor) -> list:
    """``values`` with every plain tensor that needs it promoted, all of them by one :func:`promote_together`."""
    plains = tuple(
        a for a in values
        if isinstance(a, torch.Tensor) and not isinstance(a, ShardTensor) and (a.ndim > 0 or a.requires_grad)
    )
    views = iter(promote_together(plains, mesh))
    return [
        next(views) if isinstance(a, torch.Tensor) and not isinstance(a, ShardTensor) and (a.ndim > 0 or a.requires_grad)
        else a
        for a in values
    ]


def promote_args(func, args, kwargs):
    """Promote plain non-scalar tensors and DTensors among ``args``/``kwargs``.

    Honours the promotion mode; raises ``PromotionError`` in DISABLED mode and
    ``PlacementError`` when ShardTensors on different meshes meet.
    """
    ShardTensor = shard_tensor_cls()
    fast = _top_level(func, args, kwargs, ShardTensor)
    if fast is not None:
        return fast
    flat, spec = pytree.tree_flatten((args, kwargs))
    meshes = []
    for x in flat:
        if isinstance(x, ShardTensor) and not any(x.device_mesh == m for m in meshes):
            meshes.append(x.device_mesh)
    if len(meshes) > 1:
        raise PlacementError(
            f"{_name(func)}: ShardTensor arguments live on different device meshes; "
            "redistribute them onto one mesh first"
        )
    if not meshes or not any(_needs_promotion(x, ShardTensor) for x in flat):
        return args, kwargs
    mesh = meshes[0]
    mode = get_promotion_mode()
    if mode is not TensorPromotionMode.DISABLED and _writes_into_plain(func, args, ShardTensor):
        return _gathered_operands(func, flat, spec, ShardTensor, mode)
    out = []
    for x in flat:
        if not _needs_promotion(x, ShardTensor):
            out.append(x)
        elif _is_dtensor(x):
            out.append(ShardTensor.from_dtensor(x))
        elif mode is TensorPromotionMode.DISABLED:
            raise PromotionError(
                f"{_name(func)}: a plain tensor of shape {tuple(x.shape)} meets a ShardTensor "
                "while promotion is DISABLED; make it distributed first (scatter_tensor, "
                "ShardTensor.from_local(..., placements=[Replicate()])) or enable promotion "
                "with set_promotion_mode('silent')"
            )
        else:
            if mode is TensorPromotionMode.WARN:
                warnings.warn(
                    f"{_name(func)}: promoting a plain tensor of shape {tuple(x.shape)} to "
                    "Replicate on the ShardTensor's mesh",
                    stacklevel=4,
                )
            out.append(x)
    return pytree.tree_unflatten(_promote_all(out, mesh, ShardTensor), spec)


def _writes_into_plain(func, args, ShardTensor) -> bool:
    """Whether ``func`` writes in place into a plain tensor (``plain[idx] = sharded``, ``plain.add_(sharded)``).

    Promoting that destination would write into a detached alias: the values
    land in the plain tensor's memory but autograd never learns of the write,
    so gradients to the sharded operands are silently lost.
    """
    name = getattr(func, "__name__", "")
    in_place = name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__")
    )
    return in_place and bool(args) and _needs_promotion(args[0], ShardTensor) and not _is_dtensor(args[0])


def _gathered_operands(func, flat, spec, ShardTensor, mode):
    """Operands of an in-place op on a plain destination: ShardTensors become their whole values.

    A plain tensor stands for the same value on every rank, so what is
    written into it must be whole: each sharded operand is gathered
    (``full_tensor()``, differentiable) and the op runs on plain tensors,
    recorded by autograd as usual. This is the pattern of public FNO code
    (``out_ft = torch.zeros(...)``, ``out_ft[..., :m1, :m2] = modes``): only
    the written values move, and everything after runs replicated; create
    the destination from a ShardTensor (``x.new_zeros``, ``zeros_like``) to
    keep it sharded.
    """
    if mode is TensorPromotionMode.WARN:
        warnings.warn(
            f"{_name(func)}: writing ShardTensor values into a plain tensor gathers them; "
            "create the destination with x.new_zeros(...) to keep it sharded",
            stacklevel=4,
        )
    with _gathers.attributed("sharded values written into a plain tensor", _gathers.FIX_PLAIN_BUFFER):
        out = [x.full_tensor() if isinstance(x, ShardTensor) else x for x in flat]
    return pytree.tree_unflatten(out, spec)


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)
