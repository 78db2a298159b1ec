"""softmax / log_softmax and their backward along any dim.

Along an unsharded dim they are local. Along a sharded dim each row needs two
numbers from the other shards, so only those move: an all-reduce of the
per-row maximum, then of the per-row sum of exponentials (each 1/n of the
data along the dim). The backward needs one per-row sum likewise. No gather,
exact on uneven and empty shards.

Planning is apart from execution: :func:`propagate` (pure, memoised on the op
and the specs) gives the layout, the output spec and those all-reduces with
their bytes; the rules run it, and ``propagation.plan`` answers with it.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from torch.distributed.tensor.placement_types import Partial, Replicate

from ..._redistribute import redistribute_local
from ...propagation import OpPlan, cached, collective_step, freeze, redistribution_steps, replicated
from ...rule_kit import normalize_dim, shard_tensor_cls, wrap
from ._common import all_reduce_over, local_as, mesh_dims_of, with_dtype

aten = torch.ops.aten
_LOG = (aten._log_softmax.default, aten._log_softmax_backward_data.default)


def _row_max(local: torch.Tensor, d: int) -> torch.Tensor:
    if local.shape[d] == 0:  # an empty shard holds no candidate
        shape = list(local.shape)
        shape[d] = 1
        return local.new_full(shape, float("-inf"))
    return local.amax(d, keepdim=True)


@dataclass(frozen=True)
class SoftmaxPlan:
    """A softmax (or its backward) decided from metadata.

    Attributes:
        d: the normalized dim.
        layout: the layout every operand is brought to and the output keeps (the input's with
            pending reductions resolved).
        mesh_dims: the mesh dims that shard ``d`` (the all-reduces run over them).
        plan: output spec and collectives (:class:`~physicsnemo_dp.propagation.OpPlan`).
    """

    d: int
    layout: object
    mesh_dims: tuple
    plan: OpPlan


def _resolved(spec):
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements)
    return spec if placements == spec.placements else spec.with_layout(placements, spec.dim_sizes)


def _row_reduces(layout, d, mesh_dims, dtypes) -> tuple:
    """One all-reduce per mesh dim of ``mesh_dims`` and dtype of ``dtypes`` (in that order) of a per-row statistic."""
    row = prod(n for k, n in enumerate(layout.local_shape) if k != d)
    return tuple(
        collective_step("all_reduce", m, row, dtype.itemsize, layout.mesh_shape[m]) for dtype in dtypes for m in mesh_dims
    )


@lru_cache(maxsize=4096)
def propagate(func, args: tuple, kwargs: tuple) -> SoftmaxPlan:
    """The pure half of softmax / log_softmax and their backward (memoised; tensors as their specs)."""
    if func in (aten._softmax.default, aten._log_softmax.default):
        spec, dim, half_to_float = args
        d = normalize_dim(dim, len(spec.global_shape))
        layout = _resolved(spec)
        mesh_dims = mesh_dims_of(layout, d)
        steps = redistribution_steps(spec, layout, 0) if layout is not spec else ()
        if mesh_dims:  # the row maximum, then the row sum of exponentials, in the input's dtype
            dtype = spec.tensor_meta.dtype
            steps += _row_reduces(layout, d, mesh_dims, (dtype, dtype))
        else:
            dtype = func(torch.empty(spec.global_shape, dtype=spec.tensor_meta.dtype, device="meta"), d, half_to_float).dtype
        out = with_dtype(layout, dtype) if dtype != layout.tensor_meta.dtype else layout
        return SoftmaxPlan(d, layout, mesh_dims, OpPlan((out,), steps, (None if layout is spec else layout,)))
    grad, output, dim, input_dtype = args
    d = normalize_dim(dim, len(output.global_shape))
    layout = _resolved(output)
    mesh_dims = mesh_dims_of(layout, d)
    steps = redistribution_steps(output, layout, 1) if layout is not output else ()
    grad_target = None if (grad.placements, grad.dim_sizes) == (layout.placements, layout.dim_sizes) else layout
    if grad_target is not None:
        steps += redistribution_steps(grad, grad.with_layout(layout.placements, layout.dim_sizes), 0)
    if mesh_dims:  # the row sum of the gradient (times the output for softmax)
        g = grad.tensor_meta.dtype
        steps += _row_reduces(layout, d, mesh_dims, (g if func in _LOG else torch.promote_types(g, layout.tensor_meta.dtype),))
    out = with_dtype(layout, input_dtype) if input_dtype != layout.tensor_meta.dtype else layout
    return SoftmaxPlan(d, layout, mesh_dims, OpPlan((out,), steps, (grad_target, None if layout is output else layout)))


def _plan_of(func, args, kwargs) -> SoftmaxPlan:
    return cached(propagate, func, freeze(args), tuple(sorted(kwargs.items())))


def _propagate_entry(func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for softmax and its backward."""
    return _plan_of(func, args, kwargs).plan


def _softmax(func, args, kwargs):
    x, _, half_to_float = args
    sp = _plan_of(func, args, kwargs)
    local = x._local_tensor if sp.layout is x._spec else redistribute_local(x._local_tensor, x._spec, sp.layout)
    d, mesh_dims, spec = sp.d, sp.mesh_dims, sp.layout
    if not mesh_dims:
        return wrap(func(local, d, half_to_float), sp.plan.output_specs[0])
    shifted = local - all_reduce_over(_row_max(local, d), "max", spec, mesh_dims)
    total = all_reduce_over(shifted.exp().sum(d, keepdim=True), "sum", spec, mesh_dims)
    out = shifted - total.log() if func in _LOG else shifted.exp() / total
    return wrap(out, sp.plan.output_specs[0])


def _softmax_backward(func, args, kwargs):
    grad, output, dim, input_dtype = args
    if not isinstance(grad, shard_tensor_cls()):  # a plain gradient is replicated: sliced to the box
        grad_spec = replicated(output._spec.mesh, tuple(grad.shape), grad.dtype)
    else:
        grad_spec = grad._spec
    sp = _plan_of(func, (grad_spec, output._spec, dim, input_dtype), kwargs)
    spec, d, mesh_dims = sp.layout, sp.d, sp.mesh_dims
    y = output._local_tensor if spec is output._spec else redistribute_local(output._local_tensor, output._spec, spec)
    g = local_as(grad, spec)
    if not mesh_dims:
        return wrap(func(g, y, d, input_dtype), sp.plan.output_specs[0])
    if func in _LOG:
        gi = g - y.exp() * all_reduce_over(g.sum(d, keepdim=True), "sum", spec, mesh_dims)
    else:
        gi = y * (g - all_reduce_over((g * y).sum(d, keepdim=True), "sum", spec, mesh_dims))
    return wrap(gi.to(input_dtype), sp.plan.output_specs[0])


RULES = {
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
}

#: ``propagation.plan`` entries: softmax plans apart from execution.
PROPAGATORS: dict = dict.fromkeys(RULES, _propagate_entry)
