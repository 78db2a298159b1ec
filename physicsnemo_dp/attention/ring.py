"""Ring attention: queries, keys and values all sharded along the sequence.

Forward, on the ``P`` ranks of the sequence mesh dim: at step ``t`` rank ``r``
holds the key/value block of rank ``(r - t) mod P``. It first *posts* the
send of that block to ``r + 1`` and the receive of the next one from
``r - 1``, then attends its queries to the block it holds, merging into its
running ``(out, lse)`` by log-sum-exp, then waits. After ``P`` steps every
query has seen every key, and no rank ever held more than its own queries,
two key/value blocks and one tile of scores: memory is O(local queries x
local keys) per step, never the global sequence.

Backward (flash-attention recomputation): the key/value blocks travel the
same ring again. A rank computes its own block's dk/dv contribution first and
keeps it; every other block's *accumulator* is born at the rank after the
owner and travels with the block, each rank adding its queries'
contribution, until the hop after the last step brings it home to the owner,
who adds its own. So accumulators make ``P - 1`` hops, as the keys/values
do: each block's gradient crosses ``P - 1`` links, the minimum for a sum of
``P`` contributions. Both transfers are posted before the computation they
are not needed for, so they overlap it.

Per step a rank sends ``k_j + v_j`` (block ``j``'s bytes, plus the mask's
columns when the mask is split like the keys) forward, and
``k_j + v_j + dk_j + dv_j`` backward (accumulators in float32 for half
types); every block makes ``P - 1`` hops each way, the minimum. Shard sizes
may differ and be zero: every rank knows every block's shape from the
layout, and empty blocks are neither sent nor computed.

The loop of point-to-point transfers has no graph representation, so the
ring's entry (:func:`.function.ring_attention`) is excluded from
``torch.compile``: inside a compiled model it runs eagerly at a graph break,
while the code around it compiles (see the package docstring for the
regional-compile pattern).
"""

from __future__ import annotations

import torch

from .. import _torch_compat, collectives
from ._blocks import attend, attend_backward, plan_tiles
from ._common import Grouped, Options, group_rank, token_spans
from ._placement import AttentionLayout

_KV, _GRADS = 0, 1  # tags of the two exchanges that can be in flight at once


class _Ring:
    """The static schedule of one call: who holds which block when, and each block's shape."""

    def __init__(self, layout: AttentionLayout, options: Options):
        self.mesh, self.dim = layout.q.mesh, layout.seq_mesh_dim
        self.size = self.mesh.size(self.dim)
        self.me = group_rank(layout)
        q_spans, q_offset = token_spans(layout.q, layout, options, self.me)
        self.rows0 = 0 if layout.mask_split == "rows" else q_offset
        self.mask_travels = layout.mask_split == "cols"
        self.tiles, self.cols0, self.k_len = [], [], []
        for j in range(self.size):
            k_spans, k_offset = token_spans(layout.k, layout, options, j)
            self.tiles.append(plan_tiles(q_spans, k_spans, options.causal))
            self.cols0.append(0 if self.mask_travels else k_offset)
            self.k_len.append(sum(s.length for s in k_spans))
        self.next, self.prev = (self.me + 1) % self.size, (self.me - 1) % self.size

    def source(self, step: int) -> int:
        """Owner of the block this rank holds at ``step``."""
        return (self.me - step) % self.size

    def post(self, tensors, seq_dims, step: int, tag: int):
        """Send ``tensors`` on to the next rank; receive those of the block held at ``step + 1``.

        ``seq_dims`` gives each tensor's key dim, whose extent is the block owner's shard size.
        """
        owner = self.source(step + 1)
        like = []
        for t, dim in zip(tensors, seq_dims):
            shape = list(t.shape)
            shape[dim] = self.k_len[owner]
            like.append((tuple(shape), t.dtype))
        return collectives.send_recv(tensors, self.next, like, self.prev, self.mesh, self.dim, tag=tag)


def _block(g: Grouped, ring: _Ring):
    """What travels: keys, values and, when split like the keys, the mask's columns."""
    return [g.k, g.v, g.mask] if ring.mask_travels else [g.k, g.v]


_BLOCK_DIMS = (-2, -2, -1)  # key dim of keys, values, mask


def _mask_of(block, g: Grouped, ring: _Ring):
    return block[2] if ring.mask_travels else g.mask


def _eager_only(g: Grouped) -> None:
    """Refuse to run on fake tensors: under torch.compile this makes Dynamo break the graph here.

    Dynamo may put the whole ``F.scaled_dot_product_attention`` call in its
    graph and propagate fake tensors through the handler; the ring's
    transfers cannot be captured, so the call must run eagerly instead.
    """
    if _torch_compat.traced(g.q):
        raise _torch_compat.graph_break("ring attention sends key/value blocks point to point; it runs eagerly")


def ring_forward(g: Grouped, layout: AttentionLayout, options: Options):
    _eager_only(g)
    ring = _Ring(layout, options)
    out, lse = g.accumulators()
    block = _block(g, ring)
    for step in range(ring.size):
        src = ring.source(step)
        pending = ring.post(block, _BLOCK_DIMS, step, _KV) if step < ring.size - 1 else None
        attend(g.q, block[0], block[1], _mask_of(block, g, ring), ring.rows0, ring.cols0[src],
               ring.tiles[src], options.scale, out, lse)  # fmt: skip
        if pending is not None:
            block = pending.wait()
    return out, lse


def ring_backward(g: Grouped, layout: AttentionLayout, options: Options, dout, out, lse):
    _eager_only(g)
    ring = _Ring(layout, options)
    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(g.q)
    block = _block(g, ring)
    own = grads_in = None
    for step in range(ring.size):
        src = ring.source(step)
        pending = ring.post(block, _BLOCK_DIMS, step, _KV) if step < ring.size - 1 else None
        dk, dv = attend_backward(g.q, block[0], block[1], _mask_of(block, g, ring), ring.rows0, ring.cols0[src],
                                 ring.tiles[src], options.scale, dout, lse, delta, dq, out)  # fmt: skip
        if step == 0:
            own = dk, dv  # the own block's contribution stays home
        else:
            if grads_in is not None:
                for mine, arrived in zip((dk, dv), grads_in.wait()):
                    mine.add_(arrived)
            # to the rank holding block ``src`` next; after the last step that is its owner
            grads_in = ring.post([dk, dv], _BLOCK_DIMS, step, _GRADS)
        if pending is not None:
            block = pending.wait()
    dk, dv = own
    if grads_in is not None:
        for mine, arrived in zip((dk, dv), grads_in.wait()):
            mine.add_(arrived)
    return dq, dk, dv
