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

from .._conversion import Redistribute
from .. import rule_kit as _rule_kit
from .._torch_compat import any_autocast_enabled, direct_apply, plain_eager
from ..propagation import OpPlan, cached, freeze
from ..rule_kit import shard_tensor_cls
from . import function
from ._propagate import AttentionPlan, propagate
from .function import attention
from .zigzag import zigzag_active

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


def _check_mask_grad(mask) -> None:
    """Masks get no gradient: refuse one that asks for it (a tensor property, checked before planning)."""
    if mask is not None and mask.requires_grad:
        raise ValueError(
            "scaled_dot_product_attention on ShardTensors gives attn_mask no gradient; "
            "pass attn_mask.detach() (learnable biases are not supported in sharded attention)"
        )


def _to(x, spec):
    """``x`` in the canonical layout ``spec`` (differentiable; pending reductions are done on the way)."""
    if x is None or (x._spec.placements == spec.placements and x._spec.dim_sizes == spec.dim_sizes):
        return x
    return Redistribute.apply(x, spec)


def plan_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> AttentionPlan:
    """The memoised plan of a call on specs (``attn_mask`` None: no mask); reads whether zig-zag order is active."""
    key_ = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, zigzag_active())
    return cached(propagate, *key_)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` for ShardTensors (all tensor arguments ShardTensors on one mesh)."""
    _check_mask_grad(attn_mask)
    mask_spec = attn_mask._spec if attn_mask is not None else None
    ap = plan_call(query._spec, key._spec, value._spec, mask_spec, dropout_p, is_causal, scale, enable_gqa)
    layout = ap.layout
    q, k, v = _to(query, layout.q), _to(key, layout.k), _to(value, layout.v)
    return attention(q, k, v, _to(attn_mask, layout.mask), ap)


def propagate_entry(func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for ``F.scaled_dot_product_attention``: forward only (see ``AttentionPlan.backward``)."""
    bound = {name: freeze(value) for name, value in _bind(args, kwargs).items()}
    return plan_call(*(bound[name] for name in _PARAMS)).plan


#: keyword arguments the one-call fast path takes (scalars; a mask or anything else takes the general path)
_SCALAR_OPTIONS = frozenset(("dropout_p", "is_causal", "scale", "enable_gqa"))

#: (q, k, v specs, keyword options, zig-zag active) -> ``(plan, causal)`` of a call the general path runs as one
#: fused kernel call on the local tensors as given (:class:`~.function.WholeAttention`), or None if it does not.
#: Filled by the general path's own decisions (:func:`_whole_plan`); bounded (cleared when full).
_WHOLE: dict = {}
_WHOLE_LIMIT = 1024


def _whole_plan(query, key, value, kwargs):
    """``(plan, causal)`` when :func:`scaled_dot_product_attention` would run ``WholeAttention`` on these very
    tensors (no redistribution, no mask, one kernel call), else None. Everything it reads is in the key of
    :data:`_WHOLE`: the specs (global and local shapes, dtype, mesh and so device), the options, zig-zag order."""
    b = _bind((query, key, value), kwargs)
    specs = (query._spec, key._spec, value._spec, None)
    # an invalid call raises here (as the general path then does): nothing is memoised
    ap = plan_call(*specs, b["dropout_p"], b["is_causal"], b["scale"], b["enable_gqa"])
    layout = ap.layout
    for x, spec in ((query, layout.q), (key, layout.k), (value, layout.v)):
        if x._spec.placements != spec.placements or x._spec.dim_sizes != spec.dim_sizes:
            return None  # _to would redistribute
    causal = function._whole_call(query, key, value, None, ap)
    return None if causal is None else (ap, causal)


def _memoised_whole(q, k, v, kwargs):
    """``(plan, causal)`` of :data:`_WHOLE` for ShardTensors ``q, k, v`` and scalar options (filled on a miss)."""
    key = (q._spec, k._spec, v._spec, tuple(kwargs.items()) if kwargs else (), zigzag_active())
    try:
        return _WHOLE[key]
    except KeyError:
        if len(_WHOLE) >= _WHOLE_LIMIT:
            _WHOLE.clear()
        hit = _WHOLE[key] = _whole_plan(q, k, v, kwargs)
        return hit
    except TypeError:  # an unhashable option value: the general path
        return None


#: autograd's C++ ``apply`` of :class:`~.function.EagerWholeAttention`, bound once (``direct_apply``): what the
#: memoised paths run (plain eager calls only)
_WHOLE_APPLY = direct_apply(function.EagerWholeAttention, 5)


def _whole_before_promotion(func, types, args, kwargs):
    """The hook's step 0 for ``F.scaled_dot_product_attention``: a memoised whole call (see :func:`sdpa_handler`)
    before promotion, with ``EagerWholeAttention``'s C++ ``apply`` bound once.

    Three ShardTensors and scalar options only, in plain eager mode (no tracer, dispatch mode or torch.func
    transform: :func:`plain_eager`) and without autocast (whose operands the handler's autocast step decides);
    everything else declines (``NotImplemented``) and takes the handler's path. Promotion would change
    nothing here (no plain tensor is mixed in), so the call and its result are the handler's.
    """
    if len(args) != 3 or (kwargs and not _SCALAR_OPTIONS.issuperset(kwargs)):
        return NotImplemented
    q, k, v = args
    cls = _rule_kit._SHARD_TENSOR_CLS
    if type(q) is not cls or type(k) is not cls or type(v) is not cls or any_autocast_enabled() or not plain_eager():
        return NotImplemented
    hit = _memoised_whole(q, k, v, kwargs)
    if hit is None:
        return NotImplemented
    return _WHOLE_APPLY(q, k, v, hit[1], hit[0])[0]


def sdpa_handler(func, types, args, kwargs):
    """Function-level handler for ``F.scaled_dot_product_attention`` (inputs already promoted).

    A call the general path would run as one fused kernel call on the local tensors as they are (whole keys on
    the rank: a one-rank mesh, replicated keys; see :func:`~.function._whole_call`), seen before with the same
    specs and options, goes straight to :class:`~.function.EagerWholeAttention` (``WholeAttention``'s forward
    and gradients) with the memoised plan, without binding, planning and layout checks on every call. Only
    plain eager calls (a tracer, a dispatch mode or a functorch transform gets the general path). Such a call
    with three ShardTensors and no autocast is served before promotion (:func:`_whole_before_promotion`).
    """
    if len(args) == 3 and (not kwargs or _SCALAR_OPTIONS.issuperset(kwargs)) and plain_eager():
        q, k, v = args
        cls = shard_tensor_cls()
        if type(q) is cls and type(k) is cls and type(v) is cls:
            hit = _memoised_whole(q, k, v, kwargs)
            if hit is not None:
                return _WHOLE_APPLY(q, k, v, hit[1], hit[0])[0]
    return scaled_dot_product_attention(**_bind(args, kwargs))


sdpa_handler.before_promotion = _whole_before_promotion
