"""The ``__torch_function__`` layer: function handlers and automatic promotion.

This layer runs *above* autograd, which is why promotion lives here: turning
a plain weight into a Replicate ShardTensor through a differentiable step is
what lets its gradient be summed over the mesh and handed back as a plain
gradient (so DDP, FSDP2 and optimizers see ordinary parameters).

Order for every call that involves a ShardTensor:

1. a function handler registered by the user for ``func`` (or its custom-op
   name), then the library's own (``rules.FUNCTIONS``);
2. otherwise, if plain tensors (other than 0-dim ones without grad) or
   DTensors are mixed in, promote them and call ``func`` again with subclass
   torch-function disabled, which sends it to ``__torch_dispatch__``;
3. otherwise call ``func`` directly (same as 2 without promotion).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .. import promotion
from ..errors import PlacementError, PromotionError
from .._torch_compat import Function, run_autograd_engine, torch_function_disabled
from .registry import function_handlers, named_function_handlers

__all__ = ["handle_torch_function", "promote_args"]

_PATCHES = {"enabled": False}


def set_patches_enabled(enabled: bool) -> None:
    """Turn function-level handlers on or off (dispatch-level handlers are unaffected)."""
    _PATCHES["enabled"] = bool(enabled)


def patches_enabled() -> bool:
    """Whether function-level handlers are consulted (on once a ShardTensor exists)."""
    return _PATCHES["enabled"]


_CLASSES: dict = {}


def _shard_tensor_cls():
    """ShardTensor, imported on first use (the class module imports this one)."""
    cls = _CLASSES.get("ShardTensor")
    if cls is None:
        from ..shard_tensor import ShardTensor as cls

        _CLASSES["ShardTensor"] = cls
    return cls


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
    """Plain tensor -> Replicate ShardTensor; gradient summed over the mesh."""

    @staticmethod
    def forward(plain, mesh):
        ShardTensor = _shard_tensor_cls()
        from ..spec import ShardTensorSpec
        from torch.distributed.tensor.placement_types import Replicate

        spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, plain.shape, plain.dtype)
        return ShardTensor(plain.detach(), spec, requires_grad=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = output._spec

    @staticmethod
    def backward(ctx, grad):
        ShardTensor = _shard_tensor_cls()
        if not isinstance(grad, ShardTensor):
            return grad, None
        from .._redistribute import redistribute_local

        return redistribute_local(grad._local_tensor, grad._spec, ctx.spec), None


def _needs_no_promotion(args, kwargs, ShardTensor) -> bool:
    """Fast check for the common call: tensors at top level, all ShardTensors on one mesh object.

    Anything else (containers, plain tensors other than scalars without grad,
    DTensors of any ndim, several mesh objects) takes the general path of
    :func:`promote_args`.
    """
    mesh = None
    for a in (*args, *kwargs.values()):
        if type(a) is ShardTensor:
            if mesh is None:
                mesh = a._spec.mesh
            elif a._spec.mesh is not mesh:
                return False
        elif isinstance(a, torch.Tensor):
            if a.ndim > 0 or a.requires_grad or _is_dtensor(a):
                return False
        elif isinstance(a, (list, tuple, dict)):
            return False
    return True


def promote_args(func, args, kwargs):
    """Promote plain non-scalar tensors and DTensors among ``args``/``kwargs``.

    Honours the promotion mode; raises ``PromotionError`` in DISABLED mode and
    ``PlacementError`` when ShardTensors on different meshes meet.
    """
    ShardTensor = _shard_tensor_cls()
    if _needs_no_promotion(args, kwargs, ShardTensor):
        return args, kwargs
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
    mode = promotion.get_promotion_mode()
    out = []
    for x in flat:
        if not _needs_promotion(x, ShardTensor):
            out.append(x)
        elif _is_dtensor(x):
            out.append(ShardTensor.from_dtensor(x))
        elif mode is promotion.TensorPromotionMode.DISABLED:
            raise PromotionError(
                f"{_name(func)}: a plain tensor of shape {tuple(x.shape)} meets a ShardTensor "
                "while promotion is DISABLED; make it distributed first (scatter_tensor, "
                "ShardTensor.from_local(..., placements=[Replicate()])) or enable promotion "
                "with set_promotion_mode('silent')"
            )
        else:
            if mode is promotion.TensorPromotionMode.WARN:
                warnings.warn(
                    f"{_name(func)}: promoting a plain tensor of shape {tuple(x.shape)} to "
                    "Replicate on the ShardTensor's mesh",
                    stacklevel=4,
                )
            out.append(Promote.apply(x, mesh))
    return pytree.tree_unflatten(out, spec)


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _lookup(func):
    handler = function_handlers.get(func)
    if handler is None and len(named_function_handlers) and isinstance(func, torch._ops.OpOverload):
        handler = named_function_handlers.get(str(func))
    if handler is None:
        handler = _library_functions().get(func)
    return handler


def _library_functions() -> dict:
    table = _CLASSES.get("FUNCTIONS")
    if table is None:
        from .rules import FUNCTIONS as table

        _CLASSES["FUNCTIONS"] = table
    return table


def _as_output_grads(outputs, grads):
    """A plain gradient given for a ShardTensor output is the full gradient on every rank: Replicate."""
    ShardTensor = _shard_tensor_cls()
    from torch.distributed.tensor.placement_types import Replicate

    from ..spec import ShardTensorSpec

    out = []
    for t, g in zip(outputs, grads):
        if isinstance(t, ShardTensor) and isinstance(g, torch.Tensor) and not isinstance(g, ShardTensor):
            mesh = t._spec.mesh
            spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, tuple(g.shape), g.dtype)
            g = ShardTensor(g, spec, requires_grad=False)
        out.append(g)
    return tuple(out)


def _backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        grad_tensors = (grad_tensors,) * len(tensors) if grad_tensors is None else (grad_tensors,)
    grad_tensors = _as_output_grads(tensors, grad_tensors)
    run_autograd_engine(
        tensors, grad_tensors, retain_graph=retain_graph, create_graph=create_graph,
        inputs=inputs or (), accumulate_grad=True,
    )


def _tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    _backward(self, gradient, retain_graph, create_graph, inputs)


def _grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
          allow_unused=None, is_grads_batched=False, materialize_grads=False):
    if is_grads_batched:
        raise NotImplementedError("torch.autograd.grad(is_grads_batched=True) is not supported for ShardTensors")
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if grad_outputs is None or isinstance(grad_outputs, torch.Tensor):
        grad_outputs = (grad_outputs,) * len(outputs) if grad_outputs is None else (grad_outputs,)
    grad_outputs = _as_output_grads(outputs, grad_outputs)
    result = run_autograd_engine(
        outputs, grad_outputs, retain_graph=retain_graph, create_graph=create_graph,
        inputs=inputs, accumulate_grad=False, allow_unused=bool(allow_unused or materialize_grads),
    )
    if materialize_grads:
        result = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(result, inputs))
    return result


#: Autograd entry points re-implemented so the backward pass keeps torch-function enabled.
_AUTOGRAD_ENTRIES = {
    torch.autograd.backward: _backward,
    torch.Tensor.backward: _tensor_backward,
    torch.autograd.grad: _grad,
}


def handle_torch_function(func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    entry = _AUTOGRAD_ENTRIES.get(func)
    if entry is not None:
        return entry(*args, **kwargs)
    handler = _lookup(func) if patches_enabled() else None
    args, kwargs = promote_args(func, args, kwargs)
    if handler is not None:
        return handler(func, types, args, kwargs)
    with torch_function_disabled():
        return func(*args, **kwargs)
