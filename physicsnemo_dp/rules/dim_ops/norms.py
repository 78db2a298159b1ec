"""layer_norm forward and backward (``native_layer_norm`` and its backward).

Over unsharded trailing dims it is local: each rank normalizes its own rows,
and the weight and bias gradients are each rank's sums over its rows, i.e. a
pending sum (``Partial``) over the mesh dims that shard leading dims; a plain
weight gets it all-reduced once by the promotion step.

Over a sharded normalized dim this is the whole-dim fallback: the shard moves
to a leading dim (one all-to-all), the normalization runs locally, the output
comes back to the input's layout. The saved mean and rstd stay in the moved
layout, where the backward needs them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..._redistribute import grad_layout
from ...rule_kit import grad_like, shard_tensor_cls, to_layout, unshard_dims, wrap
from ._common import local_as, move

aten = torch.ops.aten


def _normalized_dims(x, normalized_shape):
    return range(x.ndim - len(normalized_shape), x.ndim)


def _stats_spec(u_spec, k: int):
    """Layout of mean/rstd (leading dims, then ``k`` dims of size 1), laid out like ``u_spec``."""
    shape = tuple(u_spec.global_shape[: len(u_spec.global_shape) - k]) + (1,) * k
    sizes = tuple(u_spec.dim_sizes[: len(shape) - k]) + (None,) * k
    return type(u_spec).from_sizes(u_spec.mesh, u_spec.placements, shape, u_spec.tensor_meta.dtype, sizes)


def _replicated(t):
    """Local full tensor of an affine parameter (None stays None)."""
    if t is None or not isinstance(t, shard_tensor_cls()):
        return t
    spec = t._spec.with_layout((Replicate(),) * t._spec.mesh.ndim, (None,) * t.ndim)
    return to_layout(t, spec)


def _rows_local(spec, k: int):
    """``(stats spec, weight-gradient placements)`` if rows of ``spec`` are whole on their rank, else None.

    Whole rows: no pending sum and no mesh dim sharding the ``k`` normalized
    dims, so forward and backward run on the local tensors as they are. A pure
    function of the layout, memoised: a model normalizes a few layouts over
    and over, and building the specs is most of the cost of a small call.
    """
    key = (spec, k)
    hit = _ROWS.get(key, _MISSING)
    if hit is _MISSING:
        ndim = len(spec.global_shape)
        local = not spec.has_partial and not any(
            issubclass(type(p), Shard) and p.dim >= ndim - k for p in spec.placements
        )
        hit = (_stats_spec(spec, k), {}) if local else None
        if len(_ROWS) > 4096:  # keep the memo bounded in a long-running process
            _ROWS.clear()
        _ROWS[key] = hit
    return hit


_ROWS: dict = {}
_MISSING = object()


def _whole_local(t):
    """Local tensor of a parameter that every rank holds whole (None stays None), or ``_MISSING``."""
    if t is None:
        return None
    if isinstance(t, shard_tensor_cls()) and all(issubclass(type(p), Replicate) for p in t._spec.placements):
        return t._local_tensor
    return _MISSING


def _layer_norm(func, args, kwargs):
    x, normalized_shape, weight, bias, eps = args
    rows = _rows_local(x._spec, len(normalized_shape))
    if rows is not None:
        w, b = _whole_local(weight), _whole_local(bias)
        if w is not _MISSING and b is not _MISSING:
            out, mean, rstd = func(x._local_tensor, normalized_shape, w, b, eps)
            return wrap(out, x._spec), wrap(mean, rows[0]), wrap(rstd, rows[0])
    u_local, u_spec = unshard_dims(x, _normalized_dims(x, normalized_shape))
    out, mean, rstd = func(u_local, normalized_shape, _replicated(weight), _replicated(bias), eps)
    out_spec = grad_layout(x._spec)
    stats = _stats_spec(u_spec, len(normalized_shape))
    return wrap(move(out, u_spec, out_spec), out_spec), wrap(mean, stats), wrap(rstd, stats)


def _layer_norm_backward(func, args, kwargs):
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
    rows = _rows_local(x._spec, len(normalized_shape))
    if rows is not None:
        fast = _rowwise_backward(func, rows, args)
        if fast is not None:
            return fast
    u_local, u_spec = unshard_dims(x, _normalized_dims(x, normalized_shape))
    stats = _stats_spec(u_spec, len(normalized_shape))
    gi, gw, gb = func(
        local_as(grad, u_spec),
        u_local,
        normalized_shape,
        local_as(mean, stats),
        local_as(rstd, stats),
        _replicated(weight),
        _replicated(bias),
        mask,
    )
    x_grad_spec = grad_layout(x._spec)
    grad_input = None if gi is None else wrap(move(gi, u_spec, x_grad_spec), x_grad_spec)
    return grad_input, _param_grad(gw, weight, u_spec), _param_grad(gb, bias, u_spec)


def _rowwise_backward(func, rows, args):
    """The backward of whole rows on local tensors (see :func:`_rows_local`), or None for the general path."""
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
    stats, grad_specs = rows
    ST = shard_tensor_cls()
    w, b = _whole_local(weight), _whole_local(bias)
    if w is _MISSING or b is _MISSING:
        return None
    for t, spec in ((grad, x._spec), (mean, stats), (rstd, stats)):
        if type(t) is not ST or t._spec is not spec and t._spec != spec:
            return None
    gi, gw, gb = func(grad._local_tensor, x._local_tensor, normalized_shape, mean._local_tensor,
                      rstd._local_tensor, w, b, mask)  # fmt: skip
    out = [None if gi is None else wrap(gi, x._spec)]
    for g, param in ((gw, weight), (gb, bias)):
        if g is None:
            out.append(None)
            continue
        key = (tuple(g.shape), g.dtype)
        spec = grad_specs.get(key)
        if spec is None:  # each rank's sum over its rows: pending over the mesh dims that shard rows
            placements = tuple(Partial("sum") if issubclass(type(p), Shard) else Replicate() for p in x._spec.placements)
            spec = grad_specs[key] = type(x._spec).from_sizes(x._spec.mesh, placements, key[0], g.dtype, (None,) * g.ndim)
        out.append(grad_like(wrap(g, spec), param._spec))
    return tuple(out)


def _param_grad(local, param, u_spec):
    """Each rank's sum over its rows: pending over the mesh dims that shard rows, in ``param``'s layout.

    A plain parameter (one that reached the dispatcher unpromoted) gets a plain, reduced gradient.
    """
    if local is None:
        return None
    placements = tuple(Partial("sum") if issubclass(type(p), Shard) else Replicate() for p in u_spec.placements)
    spec = type(u_spec).from_sizes(u_spec.mesh, placements, tuple(local.shape), local.dtype, (None,) * local.ndim)
    if isinstance(param, shard_tensor_cls()):
        return grad_like(wrap(local, spec), param._spec)
    return move(local, spec, spec.with_layout((Replicate(),) * len(placements), spec.dim_sizes))


RULES = {
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
}
