"""What the attention Functions share: options, grouped local inputs, spans, gradients in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _mesh_order
from .._redistribute import grad_layout
from ..rule_kit import shard_tensor_cls, to_layout, wrap
from . import _heads
from ._blocks import NEG_INF, Span, compute_dtype
from ._placement import AttentionLayout, sequence_ranges
from .zigzag import spans


@dataclass(frozen=True)
class Options:
    """The call's options that every rank shares."""

    scale: float
    causal: bool
    zigzag: bool
    groups: int  # query heads per key/value head


@dataclass
class Grouped:
    """This rank's inputs in the grouped layout of :mod:`._blocks`."""

    q: torch.Tensor  # compute dtype
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    ndim: int
    dtype: torch.dtype

    def accumulators(self):
        """Zero output and ``-inf`` log-sum-exp for the queries (batch dims broadcast with the keys')."""
        batch = torch.broadcast_shapes(self.q.shape[:-2], self.k.shape[:-2], self.v.shape[:-2])
        rows = self.q.shape[-2]
        out = torch.zeros((*batch, rows, self.v.shape[-1]), dtype=self.q.dtype, device=self.q.device)
        lse = torch.full((*batch, rows), NEG_INF, dtype=self.q.dtype, device=self.q.device)
        return out, lse

    def output(self, out5: torch.Tensor) -> torch.Tensor:
        return _heads.ungroup_queries(out5, self.ndim, self.dtype)

    def queries_like(self, t: torch.Tensor) -> torch.Tensor:
        """A query-shaped local tensor (the output's gradient) in the grouped layout and compute dtype."""
        return _heads.group_queries(t, self.q.shape[-3], self.q.dtype)


def grouped(q, k, v, mask, options: Options) -> Grouped:
    """Local tensors ``q, k, v, mask`` (in the canonical layout) in the grouped layout."""
    return Grouped(
        _heads.group_queries(q, options.groups, compute_dtype(q.dtype)),
        _heads.group_keys(k),
        _heads.group_keys(v),
        _heads.group_mask(mask, q.ndim, options.groups),
        q.ndim,
        q.dtype,
    )


def token_spans(spec, layout: AttentionLayout, options: Options, rank: int):
    """Causal spans of the tokens that coordinate ``rank`` of the sequence mesh dim holds of ``spec``'s sequence, and their global offset."""
    offset, length = sequence_ranges(spec, layout.seq_mesh_dim)[rank]
    if not options.causal:  # positions do not matter: one span, one tile
        return (Span(0, length, 0),), offset
    n = spec.global_shape[-2]
    parts = spec.mesh.size(layout.seq_mesh_dim) if layout.seq_mesh_dim is not None else 1
    return spans(offset, length, n, parts, options.zigzag), offset


def sequence_coordinate(layout: AttentionLayout) -> int:
    """This rank's index along the sequence mesh dim (0 without one)."""
    m = layout.seq_mesh_dim
    return 0 if m is None else _mesh_order.coordinate(layout.q.mesh, m)


def local_grad(grad, spec) -> torch.Tensor:
    """The local part of an incoming gradient, in the gradient layout of output spec ``spec``."""
    if isinstance(grad, shard_tensor_cls()):
        return to_layout(grad, grad_layout(spec))
    return grad


def ungrouped_grads(g: Grouped, dq, dk, dv, layout: AttentionLayout):
    """Gradients of q, k, v as ShardTensors in the layout's gradient specs."""
    return (
        wrap(_heads.ungroup_queries(dq, g.ndim, g.dtype), layout.q_grad),
        wrap(_heads.ungroup_keys(dk, g.ndim, g.dtype), layout.k_grad),
        wrap(_heads.ungroup_keys(dv, g.ndim, g.dtype), layout.v_grad),
    )
