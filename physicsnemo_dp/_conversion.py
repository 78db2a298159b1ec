"""Differentiable moves between plain tensors and ShardTensors, and between layouts.

Autograd tracks the ShardTensor *wrapper*; the local tensor inside never
requires grad. These Functions are the only places where a gradient changes
kind or layout, and each backward is the mirror of its forward:

* ``FromLocal``: plain -> ShardTensor. Backward hands the local part of the
  gradient back, after bringing it to the forward layout (Partial read as
  Replicate: the gradient of a pending sum is the same for every contribution).
* ``ToLocal``: ShardTensor -> plain. Backward wraps the plain gradient with the
  given ``grad_placements`` (default: the forward layout, Partial -> Replicate).
* ``Redistribute``: layout A -> layout B. Backward redistributes the gradient
  from B's layout back to A's.
* ``Contiguous``: the same layout with the local tensor copied into another
  memory format. Backward passes the gradient through unchanged.

They use the ``forward`` + ``setup_context`` style that ``torch.compile`` needs.
"""

from __future__ import annotations


from ._torch_compat import Function
from ._redistribute import grad_layout, grad_of_contribution, redistribute_local
from .rule_kit import shard_tensor_cls


def _as_layout(grad, spec):
    """Local tensor of ``grad`` brought to the layout of ``spec`` (gradient convention)."""
    ShardTensor = shard_tensor_cls()
    target = grad_layout(spec)
    if isinstance(grad, ShardTensor):
        grad = redistribute_local(grad._local_tensor, grad._spec, target, implicit=False)
    return grad_of_contribution(grad, spec)


class FromLocal(Function):
    @staticmethod
    def forward(local, spec):
        return shard_tensor_cls()(local.detach(), spec, requires_grad=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _as_layout(grad, ctx.spec), None


class ToLocal(Function):
    @staticmethod
    def forward(tensor, grad_spec):
        return tensor._local_tensor.view_as(tensor._local_tensor)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.grad_spec = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return shard_tensor_cls()(grad.contiguous(), ctx.grad_spec, requires_grad=False), None


class Redistribute(Function):
    @staticmethod
    def forward(tensor, dst_spec):
        local = redistribute_local(tensor._local_tensor, tensor._spec, dst_spec)
        return shard_tensor_cls()(local, dst_spec, requires_grad=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.src_spec = inputs[0]._spec

    @staticmethod
    def backward(ctx, grad):
        target = grad_layout(ctx.src_spec)
        # the mirror of the forward move: a gradient in its input's layout is never an implicit gather
        local = redistribute_local(grad._local_tensor, grad._spec, target, implicit=False)
        local = grad_of_contribution(local, ctx.src_spec)
        return shard_tensor_cls()(local, target, requires_grad=False), None


class Contiguous(Function):
    """The local tensor in ``memory_format``, same spec: memory layout is a per-rank property of the local tensor."""

    @staticmethod
    def forward(tensor, memory_format):
        local = tensor._local_tensor.contiguous(memory_format=memory_format)
        return shard_tensor_cls()(local, tensor._spec, requires_grad=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None
