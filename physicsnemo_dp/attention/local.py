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

A schedule is ``forward(g, ap) -> (out, lse)`` and
``backward(g, ap, dout, out, lse) -> (dq, dk, dv)`` on grouped local tensors
(see :mod:`._common`), with the tiles and collectives the call's plan
(:class:`~._propagate.AttentionPlan`) lays out.
"""

from __future__ import annotations

import torch

from .. import collectives
from ._blocks import _safe, attend, attend_backward, attend_backward_whole, attend_whole, needs_delta, one_call
from ._common import Grouped
from ._propagate import AttentionPlan


def local_forward(g: Grouped, ap: AttentionPlan):
    sched = ap.schedule
    block = sched.blocks[0]
    call = one_call(g.q, g.k, g.v, g.mask, block.tiles)
    if call is not None:  # one kernel call gives the result: no accumulators to merge into
        return attend_whole(g.q, g.k, g.v, *call, ap.options.scale)
    out, lse = g.accumulators()
    attend(g.q, g.k, g.v, g.mask, sched.rows0, block.cols0, block.tiles, ap.options.scale, out, lse)
    return out, lse


def local_backward(g: Grouped, ap: AttentionPlan, dout, out, lse, reduce_delta=False):
    sched = ap.schedule
    block = sched.blocks[0]
    exact = None if reduce_delta else out  # a kv_sharded output is one rank's share: no fused backward
    call = None if reduce_delta else one_call(g.q, g.k, g.v, g.mask, block.tiles)
    if call is not None:  # the kernel's gradients are the result: no zeros to add them into
        return attend_backward_whole(g.q, g.k, g.v, *call, ap.options.scale, dout, out, lse)
    delta = None
    if needs_delta(g.q, g.k, g.v, g.mask, exact):  # the fused kernel recomputes it itself
        delta = (dout * out).sum(-1)
        if reduce_delta:
            delta = collectives.all_reduce(delta, "sum", ap.layout.q.mesh, ap.layout.seq_mesh_dim)
    dq = torch.zeros_like(g.q)
    dk, dv = attend_backward(g.q, g.k, g.v, g.mask, sched.rows0, block.cols0, block.tiles, ap.options.scale, dout, lse,
                             delta, dq, exact)  # fmt: skip
    return dq, dk, dv


def kv_sharded_forward(g: Grouped, ap: AttentionPlan):
    """Attend to the local keys, then scale to this rank's exact share of the global result."""
    out, lse = local_forward(g, ap)
    mesh, m = ap.layout.q.mesh, ap.layout.seq_mesh_dim
    shift = _safe(collectives.all_reduce(lse, "max", mesh, m))
    total = shift + torch.log(collectives.all_reduce(torch.exp(lse - shift), "sum", mesh, m))
    return out.mul_(torch.exp(lse - _safe(total)).unsqueeze(-1)), total


def kv_sharded_backward(g: Grouped, ap: AttentionPlan, dout, out, lse):
    return local_backward(g, ap, dout, out, lse, reduce_delta=True)
