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
from torch.distributed.tensor.placement_types import Partial, Replicate

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


def _layer_norm(func, args, kwargs):
    x, normalized_shape, weight, bias, eps = args
    u_local, u_spec = unshard_dims(x, _normalized_dims(x, normalized_shape))
    out, mean, rstd = func(u_local, normalized_shape, _replicated(weight), _replicated(bias), eps)
    out_spec = grad_layout(x._spec)
    stats = _stats_spec(u_spec, len(normalized_shape))
    return wrap(move(out, u_spec, out_spec), out_spec), wrap(mean, stats), wrap(rstd, stats)


def _layer_norm_backward(func, args, kwargs):
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
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


def _param_grad(local, param, u_spec):
    """Each rank's sum over its rows: pending over the mesh dims that shard rows, in ``param``'s layout.

    A plain parameter (one that reached the dispatcher unpromoted) gets a plain, reduced gradient.
    """
    if local is None:
        return None
    placements = tuple(Partial("sum") if p.is_shard() else Replicate() for p in u_spec.placements)
    spec = type(u_spec).from_sizes(u_spec.mesh, placements, tuple(local.shape), local.dtype, (None,) * local.ndim)
    if isinstance(param, shard_tensor_cls()):
        return grad_like(wrap(local, spec), param._spec)
    return move(local, spec, spec.with_layout((Replicate(),) * len(placements), spec.dim_sizes))


RULES = {
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
}
