"""torch's autograd entry points, re-implemented for graphs that hold ShardTensors.

``torch.autograd.backward``, ``Tensor.backward`` and ``torch.autograd.grad``
reach ``__torch_function__`` like any other call. Run as they are, torch would
enter the engine with subclass torch-function disabled, so backward formulas
of ShardTensor ops would skip the function-level handlers (and their
communication-aware gradients). These versions call the engine directly,
with torch-function enabled, after reading a plain gradient given for a
ShardTensor output as the full gradient on every rank (``Replicate``).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from .._torch_compat import run_autograd_engine, torch_function_disabled
from ..rule_kit import plain_gradient, shard_tensor_cls, wrap
from ..spec import ShardTensorSpec

__all__ = ["AUTOGRAD_ENTRIES"]


def _as_output_grads(outputs, grads):
    """A plain gradient given for a ShardTensor output is the full gradient on every rank: Replicate."""
    ShardTensor = shard_tensor_cls()
    out = []
    for t, g in zip(outputs, grads):
        if isinstance(t, ShardTensor) and isinstance(g, torch.Tensor) and not isinstance(g, ShardTensor):
            mesh = t._spec.mesh
            spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, tuple(g.shape), g.dtype)
            g = ShardTensor(g, spec, requires_grad=False)
        out.append(g)
    return tuple(out)


def _implicit_grads(outputs, grads):
    """The gradients ``torch.autograd`` makes for ``loss.backward()`` on scalar ShardTensor losses, or None.

    ``_make_grads`` reads ``requires_grad``, ``numel()``, ``dtype``, ``is_nested`` and
    ``shape`` of each output and calls ``ones_like``: six calls through
    ``__torch_function__`` (~40 us). With no gradient given and every output a
    real floating scalar ShardTensor that requires grad, the result is known:
    ones in the output's layout without pending sums, what the ``ones_like``
    rule gives. Anything else (a gradient given, a non-scalar, an integer loss,
    an output that needs no grad) returns None and takes torch's path, with its checks and messages.
    """
    ShardTensor = shard_tensor_cls()
    made = []
    for t, g in zip(outputs, grads):
        if g is not None or type(t) is not ShardTensor:
            return None
        spec = t._spec
        if math.prod(spec.global_shape) != 1 or not spec.tensor_meta.dtype.is_floating_point:
            return None
        with torch_function_disabled():
            if not t.requires_grad:
                return None
        made.append(wrap(torch.ones_like(t._local_tensor, memory_format=torch.preserve_format), _without_partial(spec)))
    return tuple(made)


def _without_partial(spec):
    """``spec`` with pending sums resolved to Replicate (the layout ``ones_like`` gives)."""
    if not any(issubclass(type(p), Partial) for p in spec.placements):
        return spec
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements)
    return spec.with_layout(placements, spec.dim_sizes)


def _backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        grad_tensors = (grad_tensors,) * len(tensors) if grad_tensors is None else (grad_tensors,)
    made = _implicit_grads(tensors, grad_tensors)
    if made is None and _own_layouts(tensors, grad_tensors):
        made = grad_tensors
    grad_tensors = made if made is not None else _as_output_grads(tensors, grad_tensors)
    run_autograd_engine(
        tensors, grad_tensors, retain_graph=retain_graph, create_graph=create_graph,
        inputs=inputs or (), accumulate_grad=True, made=made is not None,
    )


def _own_layouts(outputs, grads) -> bool:
    """Whether every gradient is a ShardTensor of its output's own spec (``y.backward(torch.ones_like(y))``).

    Then torch's ``_make_grads`` would pass each through unchanged: its checks (same shape, both complex or
    neither) hold by construction, and they cost five trips through ``__torch_function__`` (``dtype``,
    ``is_nested``, ``shape``, ``size()``, ``dtype``).
    """
    ShardTensor = shard_tensor_cls()
    for t, g in zip(outputs, grads):
        if type(t) is not ShardTensor or type(g) is not ShardTensor or g._spec is not t._spec:
            return False
    return True


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
    ShardTensor = shard_tensor_cls()
    result = tuple(
        plain_gradient(g, x._spec) if isinstance(x, ShardTensor) and isinstance(g, torch.Tensor)
        and not isinstance(g, ShardTensor) else g
        for g, x in zip(result, inputs)
    )
    if materialize_grads:
        result = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(result, inputs))
    return result


#: Autograd entry points re-implemented so the backward pass keeps torch-function enabled.
AUTOGRAD_ENTRIES = {
    torch.autograd.backward: _backward,
    torch.Tensor.backward: _tensor_backward,
    torch.autograd.grad: _grad,
}
