"""``F.scaled_dot_product_attention`` on ShardTensors.

The handler validates the call (every check reads metadata all ranks share,
so every rank raises the same error), resolves pending reductions, brings the
inputs to the canonical layout of :mod:`._placement` (differentiably) and runs
the layout's Function: :class:`~.local.LocalAttention`,
:class:`~.local.KVShardedAttention` or ring attention.

Masks: ``attn_mask`` is boolean (True = may attend) or additive, of any shape
broadcastable to ``(*batch, heads, L, S)``, given as a plain tensor of the
global shape (promoted: replicated, sliced per tile, never communicated) or as
a ShardTensor. A sharded mask should be split like the queries along its row
dim (-2) or like the keys along its column dim (-1, for key-padding masks; in
the ring its columns travel with the key blocks); any other layout is
redistributed to one of these. Masks get no gradient.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from .._conversion import Redistribute
from ._common import Options
from ._heads import query_groups
from ._placement import plan_layout
from .function import attention
from .zigzag import zigzag_active, zigzag_sizes

_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bind(args, kwargs) -> dict:
    bound = dict(_DEFAULTS)
    bound.update(zip(_PARAMS, args))
    unknown = set(kwargs) - set(_PARAMS)
    if unknown:
        raise TypeError(f"scaled_dot_product_attention() got unexpected keyword arguments {sorted(unknown)}")
    bound.update(kwargs)
    return bound


def _validate(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> int:
    """Check the call; returns the number of query heads per key/value head."""
    if dropout_p != 0.0:
        raise ValueError(
            f"scaled_dot_product_attention on ShardTensors needs dropout_p=0, got {dropout_p}: "
            "sharded attention has no reproducible dropout; pass dropout_p=0.0 (or put the module "
            "in eval mode) and apply dropout to the attention output instead"
        )
    if not (q.ndim == k.ndim == v.ndim) or q.ndim < 2:
        raise ValueError(
            "scaled_dot_product_attention on ShardTensors needs query, key and value with the same "
            f"number of dims (at least 2), got {q.ndim}, {k.ndim} and {v.ndim}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead."
        )
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise RuntimeError(
            f"scaled_dot_product_attention: query {tuple(q.shape)}, key {tuple(k.shape)} and value "
            f"{tuple(v.shape)} need query.size(-1) == key.size(-1) and key.size(-2) == value.size(-2)"
        )
    for d in range(q.ndim - 3):
        torch.broadcast_shapes((q.shape[d],), (k.shape[d],), (v.shape[d],))
    if q.ndim >= 3:
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        gqa = enable_gqa and hk == hv and hk > 0 and hq % hk == 0
        if not (gqa or {hk, hv} <= {1, hq}):
            raise RuntimeError(
                f"scaled_dot_product_attention: {hq} query heads cannot attend to {hk} key and {hv} "
                "value heads; pass enable_gqa=True with key/value heads dividing the query heads"
            )
    if mask is not None:
        if mask.requires_grad:
            raise ValueError(
                "scaled_dot_product_attention on ShardTensors gives attn_mask no gradient; "
                "pass attn_mask.detach() (learnable biases are not supported in sharded attention)"
            )
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise RuntimeError(f"Expected attn_mask dtype to be bool or float, but got {mask.dtype}")
        if mask.ndim > max(q.ndim, 2):
            raise RuntimeError(f"attn_mask of shape {tuple(mask.shape)} has more dims than the query")
        out_shape = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], k.shape[-2])
        torch.broadcast_shapes(tuple(mask.shape), out_shape)
        if is_causal:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    return query_groups(q.shape[-3], k.shape[-3]) if q.ndim >= 3 else 1


def _check_zigzag(layout) -> None:
    """Under ``zigzag_causal()`` a sharded sequence must have the zig-zag shard sizes."""
    m = layout.seq_mesh_dim
    for name, spec in (("query", layout.q), ("key", layout.k)):
        table = spec.dim_sizes[-2]
        n = spec.global_shape[-2]
        if table is not None and tuple(table) != zigzag_sizes(n, spec.mesh.size(m)):
            raise ValueError(
                f"inside zigzag_causal() the {name} sequence must be laid out by to_zigzag "
                f"(shard sizes {zigzag_sizes(n, spec.mesh.size(m))}), got shard sizes {tuple(table)}"
            )


def _to(x, spec):
    """``x`` in the canonical layout ``spec`` (differentiable; pending reductions are done on the way)."""
    if x is None or (x._spec.placements == spec.placements and x._spec.dim_sizes == spec.dim_sizes):
        return x
    return Redistribute.apply(x, spec)


def _resolved_spec(x):
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x._spec.placements)
    return x._spec.with_layout(placements, x._spec.dim_sizes)


def plan_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Validate a call on ShardTensors; its canonical layout and options (metadata only)."""
    groups = _validate(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    specs = [_resolved_spec(t) for t in (query, key, value)]
    mask_spec = _resolved_spec(attn_mask) if attn_mask is not None else None
    layout = plan_layout(*specs, mask_spec, groups)
    zigzag = bool(is_causal and zigzag_active())
    if zigzag and layout.seq_mesh_dim is not None:
        _check_zigzag(layout)
    options = Options(
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
        causal=bool(is_causal),
        zigzag=zigzag,
        groups=groups,
    )
    return layout, options


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` for ShardTensors (all tensor arguments ShardTensors on one mesh)."""
    layout, options = plan_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    q, k, v = _to(query, layout.q), _to(key, layout.k), _to(value, layout.v)
    return attention(q, k, v, _to(attn_mask, layout.mask), layout, options)


def sdpa_handler(func, types, args, kwargs):
    """Function-level handler for ``F.scaled_dot_product_attention`` (inputs already promoted)."""
    return scaled_dot_product_attention(**_bind(args, kwargs))
