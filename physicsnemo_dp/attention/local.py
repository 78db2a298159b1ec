"""Schedules for attention when one side of the sequence is whole on every rank.

* ``local`` — each rank's queries see every key locally (sharded queries with
  replicated keys/values, or no sequence sharding at all). No communication
  in forward or backward; the gradients of replicated keys/values come back
  Partial (each rank's share of the sum over its queries), reduced only if and
  when a consumer needs them.
* ``kv_sharded`` — replicated queries, sharded keys/values. Each rank attends
  to its own keys, then the ranks agree on the global log-sum-exp per query
  (an all-reduce of the max and one of the shifted sum: ``2 * rows`` values)
  and each scales its partial output by ``exp(lse_local - lse)``. The output
  is then an exact Partial sum: cheaper than all-gathering the keys
  (``S * (E + Ev)`` values) or reducing the outputs (``L * Ev``) before anyone
  needs them. Backward needs one all-reduce of ``delta = rowsum(dout * out)``
  (``rows`` values); dq comes back Partial, dk/dv stay sharded.

A schedule is ``forward(g, layout, options) -> (out, lse)`` and
``backward(g, layout, options, dout, out, lse) -> (dq, dk, dv)`` on grouped
local tensors (see :mod:`._common`).
"""

from __future__ import annotations

import torch

from .. import collectives
from ._blocks import _safe, attend, attend_backward, plan_tiles
from ._common import Grouped, Options, group_rank, token_spans
from ._placement import AttentionLayout


def _tiles(layout: AttentionLayout, options: Options):
    """Tiles and mask offsets of this rank's queries against its local keys."""
    me = group_rank(layout)
    q_spans, q_offset = token_spans(layout.q, layout, options, me)
    k_spans, k_offset = token_spans(layout.k, layout, options, me)
    rows0 = 0 if layout.mask_split == "rows" else q_offset
    cols0 = 0 if layout.mask_split == "cols" else k_offset
    return plan_tiles(q_spans, k_spans, options.causal), rows0, cols0


def local_forward(g: Grouped, layout: AttentionLayout, options: Options):
    out, lse = g.accumulators()
    tiles, rows0, cols0 = _tiles(layout, options)
    attend(g.q, g.k, g.v, g.mask, rows0, cols0, tiles, options.scale, out, lse)
    return out, lse


def local_backward(g: Grouped, layout: AttentionLayout, options: Options, dout, out, lse, reduce_delta=False):
    delta = (dout * out).sum(-1)
    if reduce_delta:
        delta = collectives.all_reduce(delta, "sum", layout.q.mesh, layout.seq_mesh_dim)
    dq = torch.zeros_like(g.q)
    tiles, rows0, cols0 = _tiles(layout, options)
    exact = None if reduce_delta else out  # a kv_sharded output is one rank's share: no fused backward
    dk, dv = attend_backward(g.q, g.k, g.v, g.mask, rows0, cols0, tiles, options.scale, dout, lse, delta, dq, exact)
    return dq, dk, dv


def kv_sharded_forward(g: Grouped, layout: AttentionLayout, options: Options):
    """Attend to the local keys, then scale to this rank's exact share of the global result."""
    out, lse = local_forward(g, layout, options)
    mesh, m = layout.q.mesh, layout.seq_mesh_dim
    shift = _safe(collectives.all_reduce(lse, "max", mesh, m))
    total = shift + torch.log(collectives.all_reduce(torch.exp(lse - shift), "sum", mesh, m))
    return out.mul_(torch.exp(lse - _safe(total)).unsqueeze(-1)), total


def kv_sharded_backward(g: Grouped, layout: AttentionLayout, options: Options, dout, out, lse):
    return local_backward(g, layout, options, dout, out, lse, reduce_delta=True)
