"""Rules for PyTorch's fused attention kernels, for composites that reach them below autograd.

``F.scaled_dot_product_attention`` called by user code meets the
function-level handler (:mod:`.sdpa`). Library composites that have no
handler of their own — ``F.multi_head_attention_forward`` inside
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` — run with
subclass torch-function disabled, so their SDPA call arrives at
``__torch_dispatch__`` as the fused kernel that ``aten::scaled_dot_product_attention``
picks for the device, and its backward (autograd's formula for the kernel,
registered for every device) as the kernel's ``_backward`` op with the saved
output and log-sum-exp. Every rule runs the same schedules as the handler
(local, kv_sharded or ring, by layout), so those modules get sequence-sharded
and ring attention unmodified, on CPU and on CUDA.

Each forward rule returns every output of its op's schema, shaped as the
op's meta function says for the global shapes; the output and the
log-sum-exp ``lse`` are ShardTensors (``lse`` split like the output's rows),
the rest plain tensors, ints or None:

* ``_scaled_dot_product_flash_attention_for_cpu`` (CPU): ``(out, lse)``,
  ``lse`` of shape ``(*B, H, L)``.
* ``_scaled_dot_product_flash_attention`` (CUDA flash): ``(out, lse (B, H, L),
  cum_seq_q=None, cum_seq_k=None, max_q=L, max_k=S, rng_state, unused,
  debug_attn_mask)``; ``rng_state`` ``(2,)`` and ``unused`` ``()`` uint64,
  ``debug_attn_mask`` empty.
* ``_scaled_dot_product_efficient_attention`` (CUDA memory-efficient):
  ``(out, lse, philox_seed, philox_offset)``; ``lse`` is ``(B, H, L')`` with
  ``L'`` the query count rounded up to a multiple of 32 (the padding, on the
  last shard of the rows, holds ``inf`` as the kernel's does), or 0 without
  ``compute_log_sumexp``; seed and offset int64 ``()``.
* ``_scaled_dot_product_cudnn_attention`` (CUDA cuDNN): ``(out, lse (B, H, L, 1),
  None, None, L, S, philox_seed, philox_offset, None)``, seed and offset int64
  ``()``.
* ``_scaled_dot_product_fused_attention_overrideable`` (out-of-tree backends):
  as cuDNN, with ``lse`` ``(B, H, L)`` (``(1, H, L)`` for a 3-D query).

The random-number state is an uninitialised placeholder on the query's
device (as the meta functions allocate it), never read because there is no
dropout (``dropout_p != 0`` raises the handler's ValueError, in forward and
backward); a debug attention mask (``return_debug_mask=True``) is refused.
``lse`` is in the computation dtype: float32 for every dtype the CUDA kernels
accept, float64 for float64 inputs. Backward rules accept ``lse`` as their
forward stored it (padding included) and return ``(dq, dk, dv)``, plus None
for the bias gradient where the op's schema has one (efficient, overrideable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._redistribute import grad_layout, redistribute_local
from .._torch_compat import efficient_lse_rows
from ..propagation import OpPlan, cached, freeze, redistribution_steps
from ..rule_kit import shard_tensor_cls, to_layout, wrap
from ..spec import ShardTensorSpec
from . import _heads
from ._blocks import compute_dtype
from ._common import grouped, local_grad, ungrouped_grads
from ._propagate import propagate
from .function import SCHEDULES
from .sdpa import plan_call
from .zigzag import zigzag_active


@dataclass(frozen=True)
class _Lse:
    """How a kernel stores the log-sum-exp of the output rows ``(*B, H, L)``.

    ``lead`` unit dims in front, ``rows`` entries along the row dim (None: L;
    more: padded with ``inf`` at the end; 0: not computed), ``trail`` unit dims behind.
    """

    lead: int = 0
    rows: int | None = None
    trail: int = 0


@dataclass(frozen=True)
class _Call:
    """An attention call, whichever kernel's argument order it came in."""

    q: Any
    k: Any
    v: Any
    mask: Any
    dropout_p: float
    is_causal: bool
    scale: float | None
    lse: _Lse = _Lse()


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
    """The log-sum-exp rows ``(*B, H, L)``: split like the output's rows, in the computation dtype."""
    out = layout.out
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in out.placements)
    dtype = compute_dtype(layout.q.tensor_meta.dtype)
    return type(out).from_sizes(out.mesh, placements, out.global_shape[:-1], dtype, out.dim_sizes[:-1])


def _stored_spec(rows: ShardTensorSpec, fmt: _Lse) -> ShardTensorSpec:
    """The spec of the log-sum-exp as ``fmt`` stores it: padding goes to the last shard of the rows."""
    *batch, n = rows.global_shape
    count = n if fmt.rows is None else fmt.rows
    if count and count < n:
        raise ValueError(f"a log-sum-exp of {count} rows does not fit {n} queries")
    table = rows.dim_sizes[-1]
    if table is not None:
        table = (*table[:-1], table[-1] + count - n) if count else (0,) * len(table)
    placements = tuple(Shard(p.dim + fmt.lead) if issubclass(type(p), Shard) else p for p in rows.placements)
    return type(rows).from_sizes(
        rows.mesh,
        placements,
        (1,) * fmt.lead + (*batch, count) + (1,) * fmt.trail,
        rows.tensor_meta.dtype,
        (None,) * fmt.lead + (*rows.dim_sizes[:-1], table) + (None,) * fmt.trail,
    )


def _store(lse: torch.Tensor, rows: ShardTensorSpec, fmt: _Lse):
    """Local log-sum-exp rows (layout ``rows``) as the ShardTensor ``fmt`` stores (padded with ``inf`` or cut)."""
    stored = _stored_spec(rows, fmt)
    shape = stored.local_shape
    want = shape[-1 - fmt.trail]
    if want > lse.shape[-1]:
        lse = torch.cat([lse, lse.new_full((*lse.shape[:-1], want - lse.shape[-1]), math.inf)], -1)
    return wrap(lse[..., :want].reshape(shape), stored)


def _load(lse, rows: ShardTensorSpec, fmt: _Lse) -> torch.Tensor:
    """Inverse of :func:`_store`: this rank's log-sum-exp rows in layout ``rows`` (padding dropped)."""
    stored = _stored_spec(rows, fmt)
    if stored.global_shape[-1 - fmt.trail] == 0 < rows.global_shape[-1]:
        raise ValueError(
            "the fused attention backward needs the log-sum-exp, but the forward did not compute it "
            "(compute_log_sumexp=False)"
        )
    local = to_layout(lse, stored)
    local = local.reshape(local.shape[fmt.lead : local.ndim - fmt.trail])
    return local[..., : rows.local_shape[-1]]


def _spec(t):
    return None if t is None else t._spec


def _plan(call: _Call, *extra):
    """The call's plan and grouped local inputs; ``extra`` tensors come back as ShardTensors."""
    q, k, v, mask, *extra = _shards([call.q, call.k, call.v, call.mask, *extra])
    ap = plan_call(_spec(q), _spec(k), _spec(v), _spec(mask), call.dropout_p, call.is_causal, call.scale, True)
    layout = ap.layout
    g = grouped(*_canonical((q, k, v, mask), (layout.q, layout.k, layout.v, layout.mask)), ap.options)
    return g, ap, extra


@dataclass(frozen=True)
class _Kernel:
    """One fused kernel: how its forward and backward ops bind, and what its forward returns."""

    bind_forward: Callable[..., _Call]
    outputs: Callable  # (call, out, lse) -> the forward op's outputs
    bind_backward: Callable  # (*args, **kwargs) -> (grad_out, call, out, lse)
    grads: int = 3  # outputs of the backward op: dq, dk, dv (and None for the bias)


def _forward(kernel: _Kernel, func, args, kwargs):
    call = kernel.bind_forward(*args, **kwargs)
    g, ap, _ = _plan(call)
    out, lse = SCHEDULES[ap.layout.kind][0](g, ap)
    lse = _store(_heads.ungroup_rows(lse, g.ndim), _lse_spec(ap.layout), call.lse)
    return kernel.outputs(call, wrap(g.output(out), ap.plan.output_specs[0]), lse)


def _backward(kernel: _Kernel, func, args, kwargs):
    grad, call, out, lse = kernel.bind_backward(*args, **kwargs)
    g, ap, (out, lse) = _plan(call, out, lse)
    layout = ap.layout
    dout = g.queries_like(local_grad(grad, layout.out))
    out = g.queries_like(to_layout(out, layout.out))
    lse = _heads.group_rows(_load(lse, _lse_spec(layout), call.lse), ap.options.groups).to(g.q.dtype)
    dq, dk, dv = SCHEDULES[layout.kind][1](g, ap, dout, out, lse)
    return (*ungrouped_grads(g, dq, dk, dv, layout), None)[: kernel.grads]


# ---------------------------------------------------------------- plans from specs (propagation.plan)


def _operands(args, kwargs) -> list:
    """The specs among an op's arguments, in call order (its tensor arguments, as ``CommStep.operand`` counts)."""
    return [a for a in (*args, *(v for _, v in kwargs)) if isinstance(a, ShardTensorSpec)]


@lru_cache(maxsize=512)
def _fused_plan(kernel: _Kernel, backward: bool, args: tuple, kwargs: tuple, zigzag: bool) -> OpPlan:
    """The plan of a fused kernel's forward or backward op on specs (memoised; ``zigzag``: zig-zag order active).

    Forward: the output and the log-sum-exp as the kernel stores it (its other outputs are
    plain), the inputs' moves to the canonical layout and the schedule's forward. Backward:
    ``dq, dk, dv``, the inputs' moves, then the gradient, the saved output and log-sum-exp
    brought to the layouts the schedule reads, then the schedule's backward.
    """
    bind = kernel.bind_backward if backward else kernel.bind_forward
    bound = bind(*args, **dict(kwargs))
    grad, call, out, lse = bound if backward else (None, bound, None, None)
    ap = propagate(call.q, call.k, call.v, call.mask, call.dropout_p, call.is_causal, call.scale, True, zigzag)
    layout = ap.layout
    stored = _stored_spec(_lse_spec(layout), call.lse)
    if not backward:
        return OpPlan((layout.out, stored), ap.plan.steps, ap.plan.operand_specs)
    # (tensor, layout the rule brings it to) in the order the rule moves them
    inputs = zip((call.q, call.k, call.v, call.mask), ap.plan.operand_specs)
    moved = [*inputs, (grad, grad_layout(layout.out)), (out, layout.out), (lse, stored)]
    operands, taken, steps = _operands(args, kwargs), set(), ()
    for src, dst in moved:
        # the operand's position among the op's tensors (a spec object may recur: take the first not yet taken)
        k = next((i for i, o in enumerate(operands) if o is src and i not in taken), None)
        taken.add(k)
        if dst is not None and (src.placements, src.dim_sizes) != (dst.placements, dst.dim_sizes):
            steps += redistribution_steps(src, dst, k)
    return OpPlan((layout.q_grad, layout.k_grad, layout.v_grad), steps + ap.backward)


def _propagate_entry(kernel: _Kernel, backward: bool, func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for a fused kernel's forward or backward op."""
    return cached(_fused_plan, kernel, backward, freeze(args), tuple((k, freeze(v)) for k, v in kwargs.items()), zigzag_active())


# ---------------------------------------------------------------- the kernels' argument orders and outputs


def _no_debug_mask(return_debug_mask):
    if return_debug_mask:
        raise ValueError(
            "fused attention on ShardTensors cannot return the debug attention mask (return_debug_mask=True): "
            "sharded attention never holds the whole attention matrix; compute it from the full tensors"
        )


def _lengths(call):
    """``max_q`` and ``max_k``: the global sequence lengths."""
    return call.q.shape[-2], call.k.shape[-2]


def _rng(call, seed_shape, dtype):
    """The dropout random-number state: placeholders never read (there is no dropout), allocated like the meta's."""
    seed, offset = (torch.empty(shape, dtype=dtype, device=call.q.device) for shape in (seed_shape, ()))
    return seed, offset


def _for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return _Call(query, key, value, attn_mask, dropout_p, is_causal, scale)


def _for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    return grad_out, _for_cpu(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale), out, logsumexp


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _no_debug_mask(return_debug_mask)
    return _Call(query, key, value, None, dropout_p, is_causal, scale)


def _flash_outputs(call, out, lse):
    debug_mask = torch.empty(0, dtype=call.q.dtype, device=call.q.device)
    return out, lse, None, None, *_lengths(call), *_rng(call, (2,), torch.uint64), debug_mask


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, philox_seed, philox_offset, *, scale=None):  # fmt: skip
    return grad_out, _flash(query, key, value, dropout_p, is_causal, scale=scale), out, logsumexp


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    rows = efficient_lse_rows(query.shape[-2]) if compute_log_sumexp else 0
    return _Call(query, key, value, attn_bias, dropout_p, is_causal, scale, _Lse(rows=rows))


def _efficient_outputs(call, out, lse):
    return out, lse, *_rng(call, (), torch.int64)


def _efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                        dropout_p, grad_input_mask, is_causal=False, *, scale=None):  # fmt: skip
    # the log-sum-exp as the forward stored it: padded, or not computed (an error in _load)
    call = _Call(query, key, value, attn_bias, dropout_p, is_causal, scale, _Lse(rows=logsumexp.shape[-1]))
    return grad_out_, call, out, logsumexp


def _cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
           return_debug_mask=False, *, scale=None):  # fmt: skip
    _no_debug_mask(return_debug_mask)
    return _Call(query, key, value, attn_bias, dropout_p, is_causal, scale, _Lse(trail=1))


def _cudnn_outputs(call, out, lse):
    """cuDNN's and the overrideable kernel's outputs: no sequence offsets, no debug mask."""
    return out, lse, None, None, *_lengths(call), *_rng(call, (), torch.int64), None


def _cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                    cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):  # fmt: skip
    return grad_out, _cudnn(query, key, value, attn_bias, True, dropout_p, is_causal, scale=scale), out, logsumexp


def _overrideable(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                  scale=None):  # fmt: skip
    _no_debug_mask(return_debug_mask)
    # a 3-D (H, L, E) query gets a log-sum-exp (1, H, L)
    return _Call(query, key, value, attn_bias, dropout_p, is_causal, scale, _Lse(lead=int(query.ndim == 3)))


def _overrideable_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                           cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                           scale=None):  # fmt: skip
    return grad_out, _overrideable(query, key, value, attn_bias, dropout_p, is_causal, scale=scale), out, logsumexp


aten = torch.ops.aten
#: (forward op, backward op) -> the kernel's bindings
_KERNELS = {
    (aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward):
        _Kernel(_for_cpu, lambda call, out, lse: (out, lse), _for_cpu_backward),
    (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward):
        _Kernel(_flash, _flash_outputs, _flash_backward),
    (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward):
        _Kernel(_efficient, _efficient_outputs, _efficient_backward, grads=4),
    (aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward):
        _Kernel(_cudnn, _cudnn_outputs, _cudnn_backward),
    (aten._scaled_dot_product_fused_attention_overrideable,
     aten._scaled_dot_product_fused_attention_overrideable_backward):
        _Kernel(_overrideable, _cudnn_outputs, _overrideable_backward, grads=4),
}  # fmt: skip

RULES = {}
PROPAGATORS = {}
for (_fwd, _bwd), _kernel in _KERNELS.items():
    RULES[_fwd.default] = partial(_forward, _kernel)
    RULES[_bwd.default] = partial(_backward, _kernel)
    PROPAGATORS[_fwd.default] = partial(_propagate_entry, _kernel, False)
    PROPAGATORS[_bwd.default] = partial(_propagate_entry, _kernel, True)
