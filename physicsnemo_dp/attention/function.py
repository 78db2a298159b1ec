"""The autograd Function around the attention schedules, and the ring's compile-excluded entry.

One Function serves the three layouts: its forward runs the layout's
schedule, as the call's :class:`~._propagate.AttentionPlan` lays it out, on
the grouped local tensors and saves the output and the log-sum-exp; its backward is the schedule's flash-style recomputation. Gradients
come back as ShardTensors in the layout's gradient specs (Partial where a rank
holds only a share of the sum).
"""

from __future__ import annotations

import torch

from .._torch_compat import (
    Function,
    SubclassFunction,
    check_version,
    fused_attention,
    fused_attention_backward,
    non_differentiable,
    version_witness,
)
from ..rule_kit import wrap
from ._blocks import _kernel_memory, compute_dtype, one_call
from ._common import grouped, local_grad, ungrouped_grads
from ._propagate import AttentionPlan
from .local import kv_sharded_backward, kv_sharded_forward, local_backward, local_forward
from .ring import ring_backward, ring_forward

#: layout kind -> (forward, backward) schedule
SCHEDULES = {
    "local": (local_forward, local_backward),
    "kv_sharded": (kv_sharded_forward, kv_sharded_backward),
    "ring": (ring_forward, ring_backward),
}


def _locals(*tensors):
    return [None if t is None else t._local_tensor for t in tensors]


class SDPAFunction(Function):
    """``(q, k, v, mask)`` ShardTensors in the canonical layout -> ``(output, lse)``; lse is not differentiable."""

    @staticmethod
    def forward(q, k, v, mask, ap: AttentionPlan):
        g = grouped(*_locals(q, k, v, mask), ap.options)
        out, lse = SCHEDULES[ap.layout.kind][0](g, ap)
        return wrap(g.output(out), ap.plan.output_specs[0]), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, ctx.ap = inputs
        ctx.save_for_backward(q, k, v, mask, output[0], output[1])
        non_differentiable(ctx, output[1])

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        if grad is None:
            return None, None, None, None, None
        q, k, v, mask, out, lse = ctx.saved_tensors
        ap = ctx.ap
        g = grouped(*_locals(q, k, v, mask), ap.options)
        dout = g.queries_like(local_grad(grad, ap.layout.out))
        dq, dk, dv = SCHEDULES[ap.layout.kind][1](g, ap, dout, g.queries_like(out._local_tensor), lse)
        return (*ungrouped_grads(g, dq, dk, dv, ap.layout), None, None)


def _whole_call(q, k, v, mask, ap: AttentionPlan):
    """``causal`` (a bool) when the call is one fused kernel call on the local tensors as they are, else None.

    That is: the keys are whole on this rank (the local kind, or a ring of one rank), one tile covers every
    query and key and the kernel computes it in one part (fully visible, or causal from its top-left corner),
    no mask, one query head per key head, 4-D tensors of one dtype that is its own compute dtype, with the
    same batch and head dims. Then :class:`WholeAttention` runs torch's own kernel and its backward on the
    caller's local tensors, as plain torch does.
    """
    kind = ap.layout.kind
    if (
        mask is not None
        or ap.options.groups != 1
        or not (kind == "local" or (kind == "ring" and ap.schedule.size == 1))
    ):
        return None
    ql, kl, vl = q._local_tensor, k._local_tensor, v._local_tensor
    if ql.ndim != 4 or not (ql.dtype == kl.dtype == vl.dtype == compute_dtype(ql.dtype)):
        return None
    if not (ql.shape[:-2] == kl.shape[:-2] == vl.shape[:-2]):
        return None
    call = one_call(ql, kl, vl, None, ap.schedule.blocks[0].tiles)
    return None if call is None else call[1]


class WholeAttention(SubclassFunction):
    """``(q, k, v)`` ShardTensors whose attention is one fused kernel call (:func:`_whole_call`) -> ``(output, lse)``.

    The kernel's output, log-sum-exp and gradients are those of :class:`SDPAFunction`'s one-call path
    (the same kernel per head, without regrouping the heads into the kernel's batch dim), laid out as the
    kernel returns them, which is what plain torch's ``F.scaled_dot_product_attention`` gives.
    ``tests/attention/test_blocks.py`` checks them bit for bit against the merged tiles.
    """

    @staticmethod
    def forward(q, k, v, causal, ap: AttentionPlan):
        out, lse = fused_attention(*(_kernel_memory(t._local_tensor) for t in (q, k, v)), causal, ap.options.scale)
        return wrap(out, ap.plan.output_specs[0]), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.causal, ctx.ap = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1])
        non_differentiable(ctx, output[1])

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        if grad is None:
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        return _whole_backward(ctx, grad, q, k, v, out._local_tensor, lse)


def _whole_backward(ctx, grad, q, k, v, out, lse):
    """:class:`WholeAttention`'s gradients: the kernel's backward on the local tensors (``out`` the local output)."""
    layout = ctx.ap.layout
    dout = _kernel_memory(local_grad(grad, layout.out))
    dq, dk, dv = fused_attention_backward(
        dout, *(_kernel_memory(t._local_tensor) for t in (q, k, v)), out, lse, ctx.causal, ctx.ap.options.scale
    )
    return wrap(dq, layout.q_grad), wrap(dk, layout.k_grad), wrap(dv, layout.v_grad), None, None


class EagerWholeAttention(WholeAttention):
    """:class:`WholeAttention` for plain eager calls (``sdpa``'s memoised fast paths): the same forward and
    gradients; the output is saved as its local tensor with a witness of the ShardTensor's version counter.

    Autograd saves a Function's output through a ``detach`` and restores it through another, each a trip
    through ``__torch_dispatch__`` on a ShardTensor (~20 us a call together, forward and backward). The
    local tensor (the kernel's own output) and :func:`~physicsnemo_dp._torch_compat.version_witness` keep
    what the saved output was for: an in-place change of the output before backward raises autograd's
    error. Not for traced code (the witness is made outside the dispatcher's Python key): tracers,
    dispatch modes and torch.func transforms get :class:`WholeAttention`.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.causal, ctx.ap = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out._local_tensor, lse)
        ctx.out_version = version_witness(out)
        non_differentiable(ctx, lse)

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        if grad is None:
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        check_version(ctx.out_version, "the output of scaled_dot_product_attention (a ShardTensor)")
        return _whole_backward(ctx, grad, q, k, v, out, lse)


@torch.compiler.disable
def ring_attention(q, k, v, mask, ap: AttentionPlan):
    """Ring attention, run eagerly also inside a ``torch.compile``d model (a graph break here)."""
    return SDPAFunction.apply(q, k, v, mask, ap)[0]


def attention(q, k, v, mask, ap: AttentionPlan):
    """The attention output for canonical inputs in the plan's layout; the ring goes through its compile-excluded entry.

    A ring of one rank (the sequence's mesh dim has size 1) sends nothing: it runs the local schedule
    and is traced like it, so a model compiles as one graph on such a mesh (no break at the attention).
    """
    if ap.layout.kind == "ring" and ap.schedule.size > 1:
        return ring_attention(q, k, v, mask, ap)
    causal = _whole_call(q, k, v, mask, ap)
    if causal is not None:  # one kernel call on the local tensors as given: torch's kernel and backward, nothing around
        return WholeAttention.apply(q, k, v, causal, ap)[0]
    return SDPAFunction.apply(q, k, v, mask, ap)[0]
