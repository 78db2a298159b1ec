"""Rules for PyTorch's fused CPU attention kernel, for composites that reach it below autograd.

``F.scaled_dot_product_attention`` called by user code meets the
function-level handler (:mod:`.sdpa`). Library composites that have no
handler of their own — ``F.multi_head_attention_forward`` inside
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` — run with
subclass torch-function disabled, so their SDPA call arrives at
``__torch_dispatch__`` as ``aten._scaled_dot_product_flash_attention_for_cpu``
(the kernel CPU picks for every dtype and option), and its backward as
``..._backward`` with the saved output and log-sum-exp. Both rules run the
same schedules as the handler (local, kv_sharded or ring, by layout), so those
modules get sequence-sharded and ring attention unmodified. The CUDA fused
kernels (flash, efficient, cuDNN) have other signatures and no rule yet:
there, call ``F.scaled_dot_product_attention`` directly (as hand-written
attention modules do), or give ``nn.MultiheadAttention`` ``need_weights=True``
so it decomposes into generic ops.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate

from .._redistribute import redistribute_local
from ..dispatch.rules._common import shard_tensor_cls, to_layout, wrap
from ..spec import ShardTensorSpec
from . import _heads
from ._common import grouped, local_grad, ungrouped_grads
from .function import SCHEDULES
from .sdpa import plan_call


def _shards(tensors):
    """Plain tensors among ``tensors`` as Replicate ShardTensors on the mesh of the first ShardTensor."""
    ShardTensor = shard_tensor_cls()
    mesh = next(t._spec.mesh for t in tensors if isinstance(t, ShardTensor))

    def one(t):
        if t is None or isinstance(t, ShardTensor):
            return t
        spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, t.shape, t.dtype)
        return wrap(t, spec)

    return [one(t) for t in tensors]


def _canonical(tensors, specs):
    return [None if t is None else redistribute_local(t._local_tensor, t._spec, s) for t, s in zip(tensors, specs)]


def _lse_spec(layout):
    out = layout.out
    placements = tuple(Replicate() if p.is_partial() else p for p in out.placements)
    return type(out).from_sizes(out.mesh, placements, out.global_shape[:-1], torch.float32, out.dim_sizes[:-1])


def _plan(q, k, v, mask, dropout_p, is_causal, scale):
    q, k, v, mask = _shards([q, k, v, mask])
    layout, options = plan_call(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa=True)
    g = grouped(*_canonical((q, k, v, mask), (layout.q, layout.k, layout.v, layout.mask)), options)
    return g, layout, options


def flash_forward(func, args, kwargs):
    q, k, v, dropout_p, is_causal, mask, scale = _bind_forward(*args, **kwargs)
    g, layout, options = _plan(q, k, v, mask, dropout_p, is_causal, scale)
    out, lse = SCHEDULES[layout.kind][0](g, layout, options)
    return wrap(g.output(out), layout.out), wrap(_heads.ungroup_rows(lse, g.ndim), _lse_spec(layout))


def flash_backward(func, args, kwargs):
    grad, q, k, v, out, lse, dropout_p, is_causal, mask, scale = _bind_backward(*args, **kwargs)
    g, layout, options = _plan(q, k, v, mask, dropout_p, is_causal, scale)
    dout = g.queries_like(local_grad(grad, layout.out))
    out = g.queries_like(to_layout(out, layout.out))
    lse = _heads.group_rows(to_layout(lse, _lse_spec(layout)), options.groups).to(g.q.dtype)
    dq, dk, dv = SCHEDULES[layout.kind][1](g, layout, options, dout, out, lse)
    return ungrouped_grads(g, dq, dk, dv, layout)


def _bind_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return query, key, value, dropout_p, is_causal, attn_mask, scale


def _bind_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    return grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale


aten = torch.ops.aten
RULES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_backward,
}
