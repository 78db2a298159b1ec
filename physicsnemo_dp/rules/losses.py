"""Loss functions on ShardTensors: the results and gradients of one process.

``F.mse_loss``, ``F.l1_loss``, ``F.huber_loss``, ``F.smooth_l1_loss``,
``F.binary_cross_entropy``, ``F.binary_cross_entropy_with_logits``,
``F.nll_loss`` and ``F.cross_entropy`` (and the ``nn`` loss modules, which call
them) are handled above autograd in two steps:

1. **Per element, locally.** The operands are aligned to one layout (the
   input's, with pending sums resolved; for ``nll_loss``/``cross_entropy`` one
   where the class dim ``1`` is whole: a sharded class dim is moved to another
   dim by one all-to-all, ``rule_kit.unshard_dims``' choice). Inside the autograd
   Function ``_local.LocalCall`` every rank runs torch's own loss with
   ``reduction="none"`` on its local pieces (same kernels, so the same values
   per element) and its backward is torch's own backward of that local call.
   Gradients go back to each operand's layout (``grad_like``). Operands that
   broadcast (a ``pos_weight`` of shape ``(C, 1, 1)``) and class weights are
   read whole on every rank; their gradients are pending sums over the mesh
   dims that shard the loss, reduced by whoever reads them (the promotion step
   of a plain weight: one all-reduce, shared with the other weights).
2. **Reduced with the sharded reductions.** ``"sum"`` is ``loss.sum()`` and
   ``"mean"`` is ``loss.mean()`` (exact on uneven and empty shards: the global
   count divides); weighted means follow torch: ``sum(w * l) / sum(w)`` for
   ``mse_loss``/``l1_loss`` with ``weight``, and for ``nll_loss``/``cross_entropy``
   with class indices ``sum(l) / sum(w[target])`` over the targets that are not
   ``ignore_index`` (both sums global, all-reduced together in one call). The
   result is a 0-dim ShardTensor: a pending sum for ``"sum"`` and plain
   ``"mean"`` (resolved where it is read, e.g. by ``.item()``), replicated for
   a ratio.

Errors are those of one process and the same on every rank: torch's own
argument checks (shapes, dtypes, ``reduction``) run first on meta tensors of the
global shapes; data checks torch makes inside its kernels (a class index out of
range, a ``binary_cross_entropy`` probability outside [0, 1]) count the bad
values locally and add the counts with one all-reduce of one number per mesh
dim that shards the loss, before any rank computes, so every rank raises
alike. Double backward through these losses is not supported.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import collectives
from .._torch_compat import assert_in_graph, l1_loss_weight, traced, tracing
from ..rule_kit import broadcast_shape, meta_output, to_layout, unshard_target, wrap
from ._local import Job, aligned, as_shard, cut, local_call, replicated_spec, resolved, sharding_mesh_dims, trailing
from ._local import without_dim

__all__ = ["RULES", "FUNCTIONS"]


def _common(shape, candidates):
    """Layout of the per-element loss of global ``shape``: that of the first sharded candidate of that shape.

    Else the first candidate of that shape; else (every operand broadcasts) replicated.
    """
    full = [c for c in candidates if c is not None and tuple(c.shape) == tuple(shape)]
    for c in full:
        if any(issubclass(type(p), Shard) for p in c._spec.placements):
            return resolved(c._spec)
    if full:
        return resolved(full[0]._spec)
    return replicated_spec(candidates[0]._spec, shape, candidates[0].dtype)


# --------------------------------------------------------------------------- #
# Shared pieces of the handlers
# --------------------------------------------------------------------------- #
def _reduction(size_average, reduce, reduction):
    """``reduction``, or what the deprecated ``size_average``/``reduce`` mean (torch's legacy rule)."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    return ("mean" if size_average else "sum") if reduce else "none"


def _reduce(loss, reduction, denominator=None):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if denominator is None:
        return loss.mean()
    return _ratio_of_sums(loss, denominator)


def _ratio_of_sums(numerator, denominator):
    """``numerator.sum() / denominator.sum()``, both sums global: one all-reduce of the two partial sums together."""
    both = torch.stack([numerator.sum(), denominator.sum().to(numerator.dtype)])
    if any(issubclass(type(p), Partial) for p in both.placements):
        both = both.redistribute(placements=[Replicate()] * both.device_mesh.ndim)
    return both[0] / both[1]


def _agree_none_bad(bad_local, spec, message):
    """Raise ``message(count)`` on every rank if any rank's ``bad_local`` (a bool tensor) has a True.

    One all-reduce of one number per mesh dim that shards ``spec`` (ranks along
    a replicated mesh dim hold the same values, so their counts agree already).
    """
    count = bad_local.sum().reshape(1).to(torch.int64)
    for m in sharding_mesh_dims(spec):
        count = collectives.all_reduce(count, "sum", spec.mesh, m)
    if traced(count):  # torch.compile: no value to read yet; the check runs in the graph (a RuntimeError then)
        assert_in_graph(count[0] == 0, str(message("some")))
        return
    n = int(count.item())
    if n:
        raise message(n)


def _elementwise(name, x, t, extra, local_loss, reduction, weight=None, weighted_mean="ratio"):
    """An elementwise loss of ``x`` and ``t`` (broadcast), optional ``extra`` operands that broadcast too.

    ``local_loss(x, t, *extra)`` is torch's loss with ``reduction="none"``; a
    ``weight`` (same size as the input, torch's ``mse``/``l1``/``huber``
    ``weight``) multiplies it, and ``"mean"`` is then ``sum(w*l)/sum(w)``
    (``weighted_mean="ratio"``) or ``(w*l).mean()`` (``"mean"``, huber).
    """
    shape = broadcast_shape(tuple(x.shape), tuple(t.shape))
    operands = [x, t, *extra, weight]
    common = _common(shape, [x, t])
    modes = [
        aligned(common) if tuple(o.shape) == shape else trailing(o.ndim, len(shape)) for o in operands if o is not None
    ]
    operands = [o for o in operands if o is not None]

    def fn(*local):
        loss = local_loss(*local[: 2 + len(extra)])
        return (loss * local[-1],) if weight is not None else (loss,)

    (loss,) = local_call(Job(fn, modes, common, (common,)), *operands)
    if weight is not None and reduction == "mean" and weighted_mean == "ratio":
        return _reduce(loss, reduction, weight)
    return _reduce(loss, reduction)


def _bind(func, args, kwargs, names, defaults):
    values = {k: v for k, v in defaults.items() if k in names}
    values.update(zip(names, args))
    values.update(kwargs)
    unknown = set(values) - set(names)
    if unknown:
        raise TypeError(f"{func.__name__}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    return values


# --------------------------------------------------------------------------- #
# Handlers
# --------------------------------------------------------------------------- #
_REG = ("input", "target", "size_average", "reduce", "reduction", "weight")
_REG_DEFAULTS = dict(size_average=None, reduce=None, reduction="mean", weight=None)


def _mse(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    a = _bind(func, args, kwargs, _REG, _REG_DEFAULTS)
    x = a["input"]
    t, w = as_shard(a["target"], x), as_shard(a["weight"], x)
    reduction = _reduction(a["size_average"], a["reduce"], a["reduction"])
    return _elementwise("mse_loss", x, t, (), lambda x, t: F.mse_loss(x, t, reduction="none"), reduction, w)


def _l1(func, types, args, kwargs):
    a = _bind(func, args, kwargs, _REG, _REG_DEFAULTS)
    if a["weight"] is None:  # torch does not forward l1_loss's weight to handlers: read it from its call
        a["weight"] = l1_loss_weight()
        if a["weight"] is None and tracing(a["input"]._local_tensor):
            warnings.warn(
                "F.l1_loss on ShardTensors inside torch.compile: torch does not pass `weight` to tensor subclasses "
                "and the compiled call has no frame to read it from, so a weight given there is ignored; write a "
                "weighted L1 loss out: (w * (x - y).abs()).sum() / w.sum()",
                stacklevel=2,
            )
    meta_output(func, (), a)
    x = a["input"]
    t, w = as_shard(a["target"], x), as_shard(a["weight"], x)
    reduction = _reduction(a["size_average"], a["reduce"], a["reduction"])
    return _elementwise("l1_loss", x, t, (), lambda x, t: F.l1_loss(x, t, reduction="none"), reduction, w)


def _huber(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    a = _bind(
        func,
        args,
        kwargs,
        ("input", "target", "reduction", "delta", "weight"),
        dict(reduction="mean", delta=1.0, weight=None),
    )
    x = a["input"]
    t, w, delta = as_shard(a["target"], x), as_shard(a["weight"], x), a["delta"]
    local = lambda x, t: F.huber_loss(x, t, reduction="none", delta=delta)  # noqa: E731
    return _elementwise("huber_loss", x, t, (), local, a["reduction"], w, weighted_mean="mean")


def _smooth_l1(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    a = _bind(
        func,
        args,
        kwargs,
        ("input", "target", "size_average", "reduce", "reduction", "beta"),
        dict(size_average=None, reduce=None, reduction="mean", beta=1.0),
    )
    x = a["input"]
    t, beta = as_shard(a["target"], x), a["beta"]
    reduction = _reduction(a["size_average"], a["reduce"], a["reduction"])
    return _elementwise(
        "smooth_l1_loss", x, t, (), lambda x, t: F.smooth_l1_loss(x, t, reduction="none", beta=beta), reduction
    )


def _bce(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    a = _bind(
        func,
        args,
        kwargs,
        ("input", "target", "weight", "size_average", "reduce", "reduction"),
        dict(weight=None, size_average=None, reduce=None, reduction="mean"),
    )
    x = a["input"]
    t, w = as_shard(a["target"], x), as_shard(a["weight"], x)
    common = _common(tuple(x.shape), [x, t])
    for name, v in (("input", x), ("target", t)):  # torch's kernel checks, made on every rank alike
        local = to_layout(v, common)
        _agree_none_bad(
            ~((local >= 0) & (local <= 1)),
            common,
            lambda n, name=name: RuntimeError(
                f"binary_cross_entropy: all elements of {name} should be between 0 and 1 ({n} are not, NaN "
                f"included); for logits use F.binary_cross_entropy_with_logits"
            ),
        )
    extra = () if w is None else (w,)
    local_loss = lambda x, t, *w: F.binary_cross_entropy(x, t, weight=w[0] if w else None, reduction="none")  # noqa: E731
    return _elementwise(
        "binary_cross_entropy", x, t, extra, local_loss, _reduction(a["size_average"], a["reduce"], a["reduction"])
    )


def _bce_logits(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    a = _bind(
        func,
        args,
        kwargs,
        ("input", "target", "weight", "size_average", "reduce", "reduction", "pos_weight"),
        dict(weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None),
    )
    x = a["input"]
    t, w, pw = as_shard(a["target"], x), as_shard(a["weight"], x), as_shard(a["pos_weight"], x)
    has_w, has_pw = w is not None, pw is not None
    extra = tuple(o for o in (w, pw) if o is not None)

    def local_loss(x, t, *extra):
        it = iter(extra)
        weight = next(it) if has_w else None
        pos_weight = next(it) if has_pw else None
        return F.binary_cross_entropy_with_logits(x, t, weight=weight, pos_weight=pos_weight, reduction="none")

    reduction = _reduction(a["size_average"], a["reduce"], a["reduction"])
    return _elementwise("binary_cross_entropy_with_logits", x, t, extra, local_loss, reduction)


_NLL = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_NLL_DEFAULTS = dict(
    weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0
)


def _class_loss(func, types, args, kwargs):
    """``nll_loss`` and ``cross_entropy``: class dim 1 (0 for a 1-D input) held whole, batch/spatial dims sharded."""
    meta_output(func, args, kwargs)
    name = func.__name__
    a = _bind(func, args, kwargs, _NLL if name == "cross_entropy" else _NLL[:-1], _NLL_DEFAULTS)
    x = a["input"]
    t, w = as_shard(a["target"], x), as_shard(a["weight"], x)
    ignore_index, smoothing = a["ignore_index"], a.get("label_smoothing", 0.0)
    reduction = _reduction(a["size_average"], a["reduce"], a["reduction"])
    cdim = 1 if x.ndim >= 2 else 0
    n_classes = x.shape[cdim]
    common = unshard_target(x._spec, (cdim,))  # the class dim whole (one all-to-all if it was sharded)
    out_spec = without_dim(common, cdim, x.dtype)
    probabilities = tuple(t.shape) == tuple(x.shape)  # torch's rule: same shape = class probabilities
    if probabilities:
        t_spec = common
    else:
        t_spec = without_dim(common, cdim, t.dtype)
        local_t = to_layout(t, t_spec)
        _agree_none_bad(
            ((local_t < 0) | (local_t >= n_classes)) & (local_t != ignore_index),
            t_spec,
            lambda n: IndexError(
                f"{name}: {n} target value(s) out of bounds: class indices must satisfy 0 <= target < {n_classes} "
                f"(the size of input dim {cdim}) or equal ignore_index={ignore_index}"
            ),
        )
        t = wrap(local_t, t_spec)  # class indices carry no gradient
    operands = [x, t] + ([w] if w is not None else [])
    modes = [aligned(common), aligned(t_spec)] + ([cut((None,))] if w is not None else [])  # class weights whole
    denominator = not probabilities and reduction == "mean"

    def fn(x, t, w=None):
        if name == "cross_entropy":
            loss = F.cross_entropy(
                x, t, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=smoothing
            )
        else:
            loss = F.nll_loss(x, t, weight=w, ignore_index=ignore_index, reduction="none")
        if not denominator:
            return (loss,)
        keep = t != ignore_index
        if w is None:
            return loss, keep.to(loss.dtype)
        return loss, torch.where(keep, w.detach()[t.masked_fill(~keep, 0)], 0).to(loss.dtype)

    specs = (out_spec, out_spec) if denominator else (out_spec,)
    outs = local_call(Job(fn, modes, common, specs), *operands)
    if denominator:
        return _ratio_of_sums(*outs)
    return _reduce(outs[0], reduction)


#: No ATen-level rules: every loss is handled above autograd.
RULES: dict = {}

FUNCTIONS = {
    F.mse_loss: _mse,
    F.l1_loss: _l1,
    F.huber_loss: _huber,
    F.smooth_l1_loss: _smooth_l1,
    F.binary_cross_entropy: _bce,
    F.binary_cross_entropy_with_logits: _bce_logits,
    F.nll_loss: _class_loss,
    F.cross_entropy: _class_loss,
}
