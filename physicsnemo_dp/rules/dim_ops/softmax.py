"""softmax / log_softmax and their backward along any dim.

Along an unsharded dim they are local. Along a sharded dim each row needs two
numbers from the other shards, so only those move: an all-reduce of the
per-row maximum, then of the per-row sum of exponentials (each 1/n of the
data along the dim). The backward needs one per-row sum likewise. No gather,
exact on uneven and empty shards.
"""

from __future__ import annotations

import torch

from ...rule_kit import normalize_dim, resolve_partial, wrap
from ._common import all_reduce_over, local_as, mesh_dims_of

aten = torch.ops.aten
_LOG = (aten._log_softmax.default, aten._log_softmax_backward_data.default)


def _row_max(local: torch.Tensor, d: int) -> torch.Tensor:
    if local.shape[d] == 0:  # an empty shard holds no candidate
        shape = list(local.shape)
        shape[d] = 1
        return local.new_full(shape, float("-inf"))
    return local.amax(d, keepdim=True)


def _softmax(func, args, kwargs):
    x, dim, half_to_float = args
    local, spec = resolve_partial(x)
    d = normalize_dim(dim, x.ndim)
    mesh_dims = mesh_dims_of(spec, d)
    if not mesh_dims:
        return wrap(func(local, d, half_to_float), spec)
    shifted = local - all_reduce_over(_row_max(local, d), "max", spec, mesh_dims)
    total = all_reduce_over(shifted.exp().sum(d, keepdim=True), "sum", spec, mesh_dims)
    out = shifted - total.log() if func in _LOG else shifted.exp() / total
    return wrap(out, spec)


def _softmax_backward(func, args, kwargs):
    grad, output, dim, input_dtype = args
    y, spec = resolve_partial(output)
    g = local_as(grad, spec)
    d = normalize_dim(dim, output.ndim)
    mesh_dims = mesh_dims_of(spec, d)
    if not mesh_dims:
        return wrap(func(g, y, d, input_dtype), spec)
    if func in _LOG:
        gi = g - y.exp() * all_reduce_over(g.sum(d, keepdim=True), "sum", spec, mesh_dims)
    else:
        gi = y * (g - all_reduce_over((g * y).sum(d, keepdim=True), "sum", spec, mesh_dims))
    return wrap(gi.to(input_dtype), spec)


RULES = {
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
}
