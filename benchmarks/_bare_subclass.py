"""A tensor subclass that does nothing: what torch's subclass machinery alone costs a compiled training step.

:class:`Bare` wraps one tensor. It has no ``__torch_function__`` (no hook runs
above autograd), its ``__torch_dispatch__`` unwraps the arguments, runs the op
and wraps the results, and its ``__tensor_flatten__``/``__tensor_unflatten__``
are the least torch.compile accepts. :class:`BareAttention` is its attention:
one autograd Function on the inner tensors running torch's fused CPU kernel and
its backward, as ShardTensor's one-rank path runs them.

The ``compiled`` suite runs the regionally compiled transformer block on it at
P = 1, next to ShardTensor, from the same weights and in the same run. Every
cost of that step over the plain step belongs to torch: the regions' guards on
a subclass input, unwrapping and wrapping at each region's boundary, the
regeneration of aliased outputs (``q, k, v`` of one projection), the tangents'
coercion in backward, and the subclass's dispatch. It is the floor under
ShardTensor's figure on the installed torch, not a target.
"""

from __future__ import annotations

import torch

from physicsnemo_dp._torch_compat import disabled_torch_function, make_wrapper_subclass

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _inner(x):
    return x.inner if type(x) is Bare else x


def _wrapped(out):
    if isinstance(out, torch.Tensor):  # also the fake and functional tensors torch.compile traces with
        return Bare(out)
    if type(out) in (tuple, list):
        return type(out)(Bare(t) if isinstance(t, torch.Tensor) else t for t in out)
    return out


class Bare(torch.Tensor):
    """One inner tensor (``inner``) and nothing else: every op runs on it and its result is wrapped again."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = make_wrapper_subclass(
            cls, inner.shape, stride=inner.stride(), dtype=inner.dtype, device=inner.device, requires_grad=False
        )
        out.inner = inner
        return out

    __torch_function__ = disabled_torch_function

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = [type(a)(_inner(t) for t in a) if type(a) in (tuple, list) else _inner(a) for a in args]
        kwargs = {k: _inner(v) for k, v in kwargs.items()} if kwargs else {}
        return _wrapped(func(*args, **kwargs))

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Bare(inner_tensors["inner"])

    def __repr__(self) -> str:
        return f"Bare({self.inner})"


class BareAttention(torch.autograd.Function):
    """``(q, k, v)`` Bare tensors (4-D, CPU) -> their attention, torch's fused kernel on the inner tensors."""

    @staticmethod
    def forward(ctx, q, k, v):
        q, k, v = q.inner, k.inner, v.inner
        out, lse = _FLASH(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return Bare(out)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        return tuple(Bare(g) for g in _FLASH_BACKWARD(grad.inner, q, k, v, out, lse, 0.0, False))
