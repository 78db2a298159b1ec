"""Row-local modules: a whole MLP as one autograd node on the local rows (:func:`physicsnemo_dp.rowwise`).

An MLP of ``nn.Linear`` layers, elementwise activations and ``nn.LayerNorm``
over the trailing (feature) dims computes every row of its output from the
same row of its input. On a ShardTensor whose feature dims are whole on every
rank the local rows of the output are then the module applied to the local
rows of the input, whatever the layout of the other dims. ``rowwise(module)``
makes the module's calls on such ShardTensors run that way: torch runs the
module's layers on the local tensor inside one autograd Function (torch's own
local autograd inside, as :mod:`physicsnemo_dp.rules._local` does for one
call), the output is wrapped once, and the parameters' gradients leave it as
pending sums over the mesh dims that shard the rows, reduced once by the
promotion step (per layer call, or per bucket with
:func:`~physicsnemo_dp.bucket_gradients`). Where every mesh dim that shards
the rows has one rank (P = 1, or a one-rank "domain" under DDP) there is no
sum to take: torch's autograd then records the layers on the local rows with
the real parameters, between one entry node (ShardTensor -> local rows) and
one exit node (local output -> ShardTensor), so the parameters' gradients
accumulate natively (DDP's hooks fire on them as on any parameter's) and
backward needs no nested engine call. That replaces, per layer, the library's
dispatch, autograd Function and wrap in forward and backward by one of each
per module call (see docs/performance.md, "Row-local modules").

Nothing is taken on trust from names: the module tree is read on every call
(no memo is sound: a layer replaced in place, a new parameter, a hook, a
training flag or a class change all leave the containers' identities and
lengths as they were; the walk costs ~2 us for a four-layer MLP) and only
these exact classes (not subclasses, which may override
``forward``) are fused: ``nn.Sequential`` (or a subclass that keeps
``Sequential.forward``), ``nn.Linear``, ``nn.LayerNorm``, ``nn.Identity``,
``nn.Dropout`` and the elementwise activations of :data:`ACTIVATIONS`. A
submodule of another kind, or one with buffers, is refused with a
``TypeError`` naming it. The call takes the module's own forward (each op
through the library's rules, the same values) where fusing could change what
runs: a plain-tensor input, a dropout in training mode with ``p > 0`` (its
mask comes from the library's decomposition-invariant random numbers there),
hooks on a submodule or global module hooks, autocast, a dispatch mode, a
torch.func transform, promotion not in the SILENT mode, parameters that are
not plain tensors (DTensors under FSDP2 before unsharding), ``torch.compile``
(the compiled graph holds no library Python anyway). An input with a feature
dim (one ``nn.LayerNorm`` normalizes, at least the last) sharded is refused
with a :class:`~physicsnemo_dp.PlacementError`: the module is not row-local
on that layout. Double backward through a fused call is not supported
(``once_differentiable``); activation checkpointing is.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ._torch_compat import (
    Function,
    SubclassFunction,
    any_autocast_enabled,
    dispatch_mode_active,
    eval_frame_callback,
    functorch_transforms_active,
    global_module_hooks,
    module_hooks,
    once_differentiable,
    run_autograd_engine,
)
from .errors import PlacementError
from .promotion import TensorPromotionMode, get_promotion_mode, promote_together
from .rule_kit import (
    grad_like,
    grad_like_is_identity,
    plain_gradient,
    shard_tensor_cls,
    to_layout,
    unshard_target,
    wrap,
)

__all__ = ["rowwise", "rowwise_all", "is_rowwise", "ACTIVATIONS"]

#: Elementwise activations fused by :func:`rowwise` (exact classes; their own ``forward`` runs on the local rows).
ACTIVATIONS = frozenset(
    {
        nn.ReLU,
        nn.ReLU6,
        nn.LeakyReLU,
        nn.ELU,
        nn.SELU,
        nn.CELU,
        nn.GELU,
        nn.SiLU,
        nn.Mish,
        nn.Sigmoid,
        nn.Tanh,
        nn.Softplus,
        nn.Softsign,
        nn.Hardtanh,
        nn.Hardswish,
        nn.Hardsigmoid,
        nn.Tanhshrink,
        nn.LogSigmoid,
    }
)

_LINEAR, _NORM, _ACT = 0, 1, 2

#: Norms whose statistics are taken over rows (or over a sample's positions): named in the refusal.
_STATISTICS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)  # fmt: skip


class _General(Exception):
    """The call cannot be fused as it stands: the module's own forward runs (raised while reading the tree)."""


def _steps(module, path, steps, params, top) -> int:
    """Append ``module``'s layers to ``steps`` and their parameters to ``params``; the trailing dims LayerNorms
    normalize (at least 1: Linear reads the last). Raises TypeError for what is not row-local, _General for what
    is but cannot be fused now. ``path`` (the module's qualified name, for the error) is None on the first
    reading: :func:`_read` reads again with names only to raise (building every name costs ~1 us a module)."""
    kind = type(module)
    if not top and module_hooks(module):
        raise _General
    if module._buffers and next(iter(module._buffers.values()), None) is not None:
        if path is None:
            raise _Named
        raise TypeError(
            f"rowwise: {path or 'the module'} ({kind.__name__}) holds buffers; a module whose state changes "
            "as it runs (batch statistics, counters) is not row-local: leave it out of rowwise()"
        )
    if kind is nn.Linear:
        _linear_step(module, steps, params)
        return 1
    if kind in ACTIVATIONS:
        steps.append((_ACT, module))
        return 1
    if kind is nn.LayerNorm:
        own = module._parameters
        w, b = (own["weight"], own["bias"]) if "weight" in own and "bias" in own else (module.weight, module.bias)
        if w is not None:
            params.append(w)
        if b is not None:
            params.append(b)
        steps.append((_NORM, module.normalized_shape, module.eps, w is not None, b is not None))
        return len(module.normalized_shape)
    if isinstance(module, nn.Sequential) and kind.forward is nn.Sequential.forward:
        feature = 1
        for name, child in module._modules.items():
            if child is not None:
                if path is None and not child._buffers and not module_hooks(child):
                    # a Linear or an activation read here, as the call below would read it (one frame less each)
                    ck = type(child)
                    if ck is nn.Linear:
                        _linear_step(child, steps, params)
                        continue
                    if ck in ACTIVATIONS:
                        steps.append((_ACT, child))
                        continue
                inner = None if path is None else f"{path}.{name}" if path else name
                f = _steps(child, inner, steps, params, False)
                if f > feature:
                    feature = f
        return feature
    if kind is nn.Identity:
        return 1
    if kind is nn.Dropout:
        if module.training and module.p > 0:
            raise _General  # the library's dropout rule draws the mask from global indices
        return 1
    if path is None:
        raise _Named
    why = "its forward is not known to be row-local"
    if isinstance(module, _STATISTICS):
        why = "its statistics are taken over rows"
    elif isinstance(module, (nn.Linear, nn.LayerNorm, nn.Sequential, nn.Dropout)) or kind.__mro__[1] in ACTIVATIONS:
        why = "a subclass may compute something else than its base class"
    raise TypeError(
        f"rowwise: {path or 'the module'} is a {kind.__name__}, which rowwise() does not fuse ({why}); it fuses "
        "nn.Sequential of nn.Linear, nn.LayerNorm, nn.Identity, nn.Dropout and elementwise activations "
        "(physicsnemo_dp.fusion.ACTIVATIONS): wrap only such MLPs"
    )


def _linear_step(module, steps, params) -> None:
    """Append an ``nn.Linear``'s step and parameters (see :func:`_steps`)."""
    own = module._parameters
    w, b = (own["weight"], own["bias"]) if "weight" in own and "bias" in own else (module.weight, module.bias)
    params.append(w)
    if b is None:
        steps.append((_LINEAR, 1, module.out_features))
    else:
        params.append(b)
        steps.append((_LINEAR, 2, module.out_features))


class _Named(Exception):
    """A module is refused: :func:`_read` reads the tree again with qualified names, for the TypeError."""


def _read(module):
    """``(steps, params, feature dims)`` of ``module`` (raises TypeError / _General, see :func:`_steps`).

    The tree is read on every call (nothing cheaper is sound: a layer replaced in
    place, ``lin.weight = Parameter(...)``, a hook, ``.train()`` or a class
    change all leave the containers' identities and lengths as they were)."""
    steps, params = [], []
    try:
        feature = _steps(module, None, steps, params, True)
    except _Named:
        _steps(module, "", [], [], True)  # raises the TypeError naming the module
        raise AssertionError("unreachable") from None
    return steps, params, feature


def _run(steps, h, params):
    """The layers on plain tensors: ``h`` the local rows, ``params`` in the order :func:`_steps` listed them."""
    k = 0
    for step in steps:
        kind = step[0]
        if kind is _LINEAR:
            if step[1] == 2:
                h = F.linear(h, params[k], params[k + 1])
                k += 2
            else:
                h = F.linear(h, params[k])
                k += 1
        elif kind is _NORM:
            _, shape, eps, has_w, has_b = step
            w = b = None
            if has_w:
                w, k = params[k], k + 1
            if has_b:
                b, k = params[k], k + 1
            h = F.layer_norm(h, shape, w, b, eps)
        else:
            m = step[1]
            h = type(m).forward(m, h)
    return h


# --------------------------------------------------------------------------- #
# Layouts (memoised on the identity of the input's spec)
# --------------------------------------------------------------------------- #
_OUT: dict = {}
_GRAD: dict = {}
_CACHE_SIZE = 1024


def _layouts(spec, out_features, dtype, feature):
    """``(input layout computed in, output layout, whether the rows' mesh dims all have one rank, whether an input
    gradient in the first layout is in the input's gradient layout already)`` for an input of layout ``spec``;
    PlacementError if a feature dim is sharded."""
    key = (id(spec), out_features, dtype, feature)
    hit = _OUT.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1], hit[2], hit[3], hit[4]
    ndim = len(spec.global_shape)
    for m, p in enumerate(spec.placements):
        if issubclass(type(p), Shard) and p.dim % max(ndim, 1) >= ndim - feature:
            raise PlacementError(
                f"rowwise: the input is sharded on dim {p.dim % ndim} (mesh dim {m}), one of the {feature} "
                f"trailing feature dim(s) the module reads whole per row, so the module is not row-local on "
                "this layout; redistribute the input so its trailing dims are whole (Shard a leading dim or "
                "Replicate), or call the module without rowwise()"
            )
    in_spec = unshard_target(spec, ())  # pending sums resolved: the module is not linear
    shape = tuple(spec.global_shape[:-1]) + (out_features,)
    out_spec = type(spec).from_sizes(
        spec.mesh, in_spec.placements, shape, dtype, tuple(in_spec.dim_sizes[:-1]) + (None,)
    )
    if len(_OUT) >= _CACHE_SIZE:
        _OUT.clear()
    alone, same = _alone(in_spec), grad_like_is_identity(in_spec, spec)
    _OUT[key] = (spec, in_spec, out_spec, alone, same)
    return in_spec, out_spec, alone, same


def _param_grad_spec(in_spec, view_spec):
    """The layout of a parameter's local gradient: a pending sum over the mesh dims (of more than one rank) that
    shard the rows, whole elsewhere."""
    key = (id(in_spec), id(view_spec))
    hit = _GRAD.get(key)
    if hit is not None and hit[0] is in_spec and hit[1] is view_spec:
        return hit[2]
    mesh = in_spec.mesh
    placements = tuple(
        Partial() if issubclass(type(p), Shard) and mesh.size(m) > 1 else Replicate()
        for m, p in enumerate(in_spec.placements)
    )
    shape = tuple(view_spec.global_shape)
    spec = type(view_spec).from_sizes(mesh, placements, shape, view_spec.tensor_meta.dtype, (None,) * len(shape))
    if len(_GRAD) >= _CACHE_SIZE:
        _GRAD.clear()
    _GRAD[key] = (in_spec, view_spec, spec)
    return spec


class _Enter(SubclassFunction):
    """A ShardTensor -> its local rows in ``in_spec`` (a plain tensor torch's autograd records the layers on)."""

    @staticmethod
    def forward(ctx, x, in_spec, same):
        ctx.in_spec, ctx.spec, ctx.same = in_spec, x._spec, same
        ctx.set_materialize_grads(False)
        return to_layout(x, in_spec).detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        result = wrap(grad, ctx.in_spec)
        return (result if ctx.same else grad_like(result, ctx.spec)), None, None


class _Leave(Function):
    """The local rows of the module's output -> a ShardTensor of layout ``out_spec``."""

    @staticmethod
    def forward(ctx, out, out_spec):
        ctx.out_spec = out_spec
        ctx.set_materialize_grads(False)
        return wrap(out.detach(), out_spec)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is None:
            return None, None
        if type(grad) is shard_tensor_cls():
            return to_layout(grad, ctx.out_spec), None
        return to_layout(plain_gradient(grad, ctx.out_spec), ctx.out_spec), None


def _alone(spec) -> bool:
    """Whether every mesh dim that shards the rows of ``spec`` has one rank: the parameters' gradients are then
    whole where they are computed (no pending sum for promotion to reduce)."""
    mesh = spec.mesh
    for m, p in enumerate(spec.placements):
        if not issubclass(type(p), Replicate) and mesh.size(m) > 1:
            return False
    return True


class _Fused(SubclassFunction):
    """The module's layers on the local rows, recorded as one node; backward is torch's, on the local graph."""

    @staticmethod
    def forward(ctx, steps, in_spec, out_spec, x, *views):
        local = to_layout(x, in_spec)
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            xl = local.detach().requires_grad_() if needs[3] else local
            ps = [
                v._local_tensor.detach().requires_grad_() if needs[i + 4] else v._local_tensor
                for i, v in enumerate(views)
            ]
            out = _run(steps, xl, ps)
        ctx.leaves, ctx.out = (xl, *ps), out
        ctx.in_spec, ctx.out_spec = in_spec, out_spec
        ctx.specs = (x._spec, *(v._spec for v in views))
        ctx.set_materialize_grads(False)
        return wrap(out.detach(), out_spec)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        n = len(ctx.leaves)
        if grad is None:
            return (None,) * (n + 3)
        if type(grad) is shard_tensor_cls():
            g = to_layout(grad, ctx.out_spec)
        else:  # a plain gradient of the global shape (a factory in a backward formula)
            g = to_layout(plain_gradient(grad, ctx.out_spec), ctx.out_spec)
        needs = ctx.needs_input_grad
        wanted = [i for i in range(n) if needs[i + 3]]
        grads = run_autograd_engine(
            (ctx.out,),
            (g,),
            retain_graph=False,
            create_graph=False,
            inputs=[ctx.leaves[i] for i in wanted],
            accumulate_grad=False,
            made=True,
        )
        result = [None] * n
        for i, gi in zip(wanted, grads):
            if gi is None:
                gi = torch.zeros_like(ctx.leaves[i])
            if i == 0:
                result[0] = grad_like(wrap(gi, ctx.in_spec), ctx.specs[0])
            else:
                result[i] = wrap(gi, _param_grad_spec(ctx.in_spec, ctx.specs[i]))
        ctx.leaves = ctx.out = None
        return (None, None, None, *result)


def _fused_forward(self, *args, **kwargs):
    """The forward :func:`rowwise` installs: fused on a ShardTensor where it can be, the module's own otherwise."""
    if torch.compiler.is_compiling():  # first: Dynamo folds it to a constant, and traces the module's own forward
        return type(self).forward(self, *args, **kwargs)
    x = args[0] if len(args) == 1 and not kwargs else None
    if type(x) is not shard_tensor_cls() or eval_frame_callback() is not None:
        return type(self).forward(self, *args, **kwargs)
    try:
        steps, params, feature = _read(self)
    except _General:
        return type(self).forward(self, x)
    if (
        global_module_hooks()
        or any_autocast_enabled()
        or dispatch_mode_active()
        or functorch_transforms_active()
        or get_promotion_mode() is not TensorPromotionMode.SILENT
    ):
        return type(self).forward(self, x)
    grad = False
    for p in params:
        kind = type(p)
        if kind is not nn.Parameter and kind is not torch.Tensor:
            return type(self).forward(self, x)
        grad = grad or p.requires_grad
    spec = x._spec
    shape = spec.global_shape
    if not shape:
        return type(self).forward(self, x)  # torch's own error
    out_features = shape[-1]
    for step in reversed(steps):
        if step[0] is _LINEAR:
            out_features = step[2]
            break
    in_spec, out_spec, alone, same = _layouts(spec, out_features, spec.tensor_meta.dtype, feature)
    if not torch.is_grad_enabled() or not (grad or x.requires_grad):
        return wrap(_run(steps, to_layout(x, in_spec), [p.detach() for p in params]), out_spec)
    if alone and not (steps and steps[0][0] is _ACT and getattr(steps[0][1], "inplace", False)):
        # nothing to reduce: torch's autograd records the layers with the real parameters (an in-place activation
        # first would write through the entry node's output into the input's local tensor unseen by autograd: the
        # one-node path detaches a leaf there, whose in-place write torch refuses)
        return _Leave.apply(_run(steps, _Enter.apply(x, in_spec, same), params), out_spec)
    views = promote_together(tuple(params), spec.mesh) if params else ()
    return _Fused.apply(steps, in_spec, out_spec, x, *views)


def rowwise(module: nn.Module) -> nn.Module:
    """Run ``module`` (an MLP) as one fused call on ShardTensors whose feature dims are whole; returns ``module``.

    ``module`` is an ``nn.Sequential`` (or a subclass keeping its ``forward``)
    of ``nn.Linear``, ``nn.LayerNorm`` (over trailing dims), ``nn.Identity``,
    ``nn.Dropout`` and elementwise activations (:data:`ACTIVATIONS`), nested
    freely, or a single such layer. Its output, input gradient and parameter
    gradients are those of the unfused module (the same local ops, so at one
    rank the same bits as plain torch); the parameters' gradients are summed
    over the ranks that share the rows' sharding once per call, or per bucket
    with :func:`~physicsnemo_dp.bucket_gradients` (where those mesh dims have
    one rank each, torch's autograd accumulates them directly). Plain-tensor calls, and
    the cases listed in :mod:`physicsnemo_dp.fusion`, run the module's own
    forward. The module's state dict, parameters and class are unchanged (the
    fused forward is an instance attribute: ``del module.forward`` undoes it;
    ``copy.deepcopy`` keeps it). Raises ``TypeError`` naming the first
    submodule that is not row-local. Typical use::

        for m in model.modules():
            if isinstance(m, MLP):
                physicsnemo_dp.rowwise(m)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"rowwise takes an nn.Module (an MLP), got {type(module).__name__}")
    try:
        _read(module)
    except _General:
        pass  # row-local, but not fusable as it stands (hooks, training dropout): decided again at every call
    module.forward = types.MethodType(_fused_forward, module)
    return module


def is_rowwise(module: nn.Module) -> bool:
    """Whether :func:`rowwise` was applied to ``module`` (and not undone)."""
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, types.MethodType) and fwd.__func__ is _fused_forward


def rowwise_all(model: nn.Module) -> list[str]:
    """:func:`rowwise` on every ``nn.Sequential`` of ``model`` it can fuse, outermost first; their names.

    A Sequential is taken when every module in it is one :func:`rowwise`
    fuses (the check :func:`rowwise` makes), and none inside a taken one is
    marked again. Layers outside any such Sequential (a lone ``nn.Linear``)
    are left alone: one layer is one op either way. Returns the qualified
    names of the marked modules (``""`` for ``model`` itself), so that a
    script can print or assert what was fused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"rowwise_all takes an nn.Module, got {type(model).__name__}")
    marked: list[str] = []
    for name, module in model.named_modules():
        if any(name == m or name.startswith(m + ".") for m in marked if m) or (marked and marked[0] == ""):
            continue
        if not (isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward):
            continue
        try:
            _read(module)
        except TypeError:
            continue
        except _General:
            pass
        rowwise(module)
        marked.append(name)
    return marked
