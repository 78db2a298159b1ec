"""The autograd Function around the attention schedules, and the ring's compile-excluded entry.

One Function serves the three layouts: its forward runs the layout's
schedule, as the call's :class:`~._propagate.AttentionPlan` lays it out, on
the grouped local tensors and saves the output and the log-sum-exp; its backward is the schedule's flash-style recomputation. Gradients
come back as ShardTensors in the layout's gradient specs (Partial where a rank
holds only a share of the sum).
"""

from __future__ import annotations

import torch

from .._torch_compat import Function, non_differentiable
from ..rule_kit import wrap
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
    return SDPAFunction.apply(q, k, v, mask, ap)[0]
