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

Two things keep the work and memory per rank close to the single-device
run's (measured figures in ``benchmarks/README.md``):

* **One message per hop.** A block's keys and values travel packed in one
  flat buffer (so do its dk/dv accumulators): each point-to-point message has
  a fixed cost in the backend (on gloo, CPU time in its network thread), and
  packing halves the number of messages. The packed copy of the own block
  replaces the ``contiguous()`` copy every send needed anyway.
* **Head chunks in backward.** Besides its inputs and results, a rank's
  backward holds four blocks in flight: the block its tiles use, the next
  one arriving, the dk/dv accumulator leaving and the one arriving (into
  which it adds in place, see :func:`.attend_backward`). Heads are
  independent, so large blocks make the backward trip in up to
  ``_MAX_CHUNKS`` groups of heads, one after the other: the blocks in flight
  shrink by that factor and the bytes sent stay the same, but every chunk is
  a message of its own, and a message has a fixed cost (on gloo, CPU time in
  its network thread). So chunks are cut only while each still moves at
  least ``_MIN_CHUNK_BYTES``, and the forward, which holds only two blocks
  in flight, is not cut. The decision uses the largest block of any rank, so
  all ranks agree; it is part of the call's plan (``_MAX_CHUNKS`` and
  ``_MIN_CHUNK_BYTES`` live in :mod:`._propagate`).

The schedule — which tiles of which block, block lengths, head chunks — is
not derived here: :func:`._propagate.propagate` lays it out from the specs,
together with the ``send_recv`` steps and bytes it implies, and this module
runs it. So ``propagation.plan`` reports what the ring sends.

The loop of point-to-point transfers has no graph representation, so the
ring's entry (:func:`.function.ring_attention`) is excluded from
``torch.compile``: inside a compiled model it runs eagerly at a graph break,
while the code around it compiles (see the package docstring for the
regional-compile pattern).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import _torch_compat, collectives
from ._blocks import attend, attend_backward, needs_delta
from ._common import Grouped, Options
from ._propagate import AttentionPlan
from .local import local_backward, local_forward

_KV, _GRADS = 0, 1  # tags of the two exchanges that can be in flight at once


class _Ring:
    """One call's ring on this rank: the plan's schedule (who holds which block when) and the transfers."""

    def __init__(self, ap: AttentionPlan):
        self.mesh, self.dim = ap.layout.q.mesh, ap.layout.seq_mesh_dim
        sched = ap.schedule
        self.size, self.me, self.rows0, self.mask_travels = sched.size, sched.me, sched.rows0, sched.mask_travels
        self.tiles = [b.tiles for b in sched.blocks]
        self.cols0 = [b.cols0 for b in sched.blocks]
        self.k_len = [b.k_len for b in sched.blocks]
        self.chunks = sched.chunks
        self.source = sched.source
        self.next, self.prev = (self.me + 1) % self.size, (self.me - 1) % self.size

    def post(self, tensors, like, tag: int):
        """Send ``tensors`` on to the next rank; receive tensors shaped ``like`` from the previous one."""
        return collectives.send_recv(tensors, self.next, like, self.prev, self.mesh, self.dim, tag=tag)


def _head_slice(t, start: int, length: int, dim: int = -4):
    """Heads ``start:start+length`` of a grouped tensor (dim -4; -3 for per-row values), unless it broadcasts."""
    return t if t is None or t.shape[dim] == 1 else t.narrow(dim, start, length)


class _Parcel:
    """What travels for one head chunk: keys and values packed in one flat buffer, plus the mask's columns.

    Every rank knows every block's shape (the token dim is the owner's shard
    size), so receive buffers are allocated without asking.
    """

    def __init__(self, g: Grouped, ring: _Ring):
        self.g, self.ring = g, ring
        self.mask_travels = ring.mask_travels

    def _shapes(self, owner: int):
        n = self.ring.k_len[owner]
        return [(*t.shape[:-2], n, t.shape[-1]) for t in (self.g.k, self.g.v)]

    def own(self) -> list:
        """The own block, packed (the one copy a send needs anyway), for the first hop."""
        flat = torch.cat([self.g.k.reshape(-1), self.g.v.reshape(-1)])
        return [flat, self.g.mask] if self.mask_travels else [flat]

    def like(self, owner: int) -> list:
        """``(shape, dtype)`` of what arrives when the block of ``owner`` does."""
        shapes = self._shapes(owner)
        like = [((sum(math.prod(s) for s in shapes),), self.g.k.dtype)]
        if self.mask_travels:
            mask = self.g.mask
            like.append(((*mask.shape[:-1], self.ring.k_len[owner]), mask.dtype))
        return like

    def unpack(self, parcel: list | None, owner: int):
        """``(k, v, mask)`` of block ``owner``; ``parcel`` None means the own block."""
        if parcel is None:
            return self.g.k, self.g.v, self.g.mask
        k, v = _unflatten(parcel[0], self._shapes(owner))
        return k, v, parcel[1] if self.mask_travels else self.g.mask

    def grads_like(self, owner: int, dtype) -> list:
        """``(shape, dtype)`` of block ``owner``'s packed dk/dv accumulator."""
        return [((sum(math.prod(s) for s in self._shapes(owner)),), dtype)]

    def grads(self, flat: torch.Tensor, owner: int):
        """``(dk, dv)`` views of a packed accumulator of block ``owner``."""
        return _unflatten(flat, self._shapes(owner))


def _unflatten(flat: torch.Tensor, shapes) -> list:
    sizes = [math.prod(s) for s in shapes]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _eager_only(g: Grouped) -> None:
    """Refuse to run on fake tensors: under torch.compile this makes Dynamo break the graph here.

    Dynamo may put the whole ``F.scaled_dot_product_attention`` call in its
    graph and propagate fake tensors through the handler; the ring's
    transfers cannot be captured, so the call must run eagerly instead.
    """
    if _torch_compat.traced(g.q):
        raise _torch_compat.graph_break("ring attention sends key/value blocks point to point; it runs eagerly")


def _chunk(g: Grouped, start: int, length: int) -> Grouped:
    return dataclasses.replace(g, q=_head_slice(g.q, start, length), k=_head_slice(g.k, start, length),
                               v=_head_slice(g.v, start, length), mask=_head_slice(g.mask, start, length))  # fmt: skip


def ring_forward(g: Grouped, ap: AttentionPlan):
    if ap.schedule.size == 1:  # a ring of one rank: its own block is every key, attended to as the local kind does
        return local_forward(g, ap)  # (nothing travels: traceable, see function.attention)
    _eager_only(g)
    ring, options = _Ring(ap), ap.options
    out, lse = g.accumulators()
    parcel, held = _Parcel(g, ring), None
    for step in range(ring.size):
        src = ring.source(step)
        pending = None
        if step < ring.size - 1:
            pending = ring.post(parcel.own() if held is None else held, parcel.like(ring.source(step + 1)), _KV)
        k, v, mask = parcel.unpack(held, src)
        pending = _arrived_now(pending)
        attend(g.q, k, v, mask, ring.rows0, ring.cols0[src], ring.tiles[src], options.scale, out, lse)
        if pending is not None:
            held = pending.wait()
    return out, lse


class _Arrived:
    """A hop already waited for (``collectives.overlap("off")``): ``wait`` hands its tensors out again."""

    def __init__(self, received):
        self._received = received

    def wait(self):
        return self._received


def _arrived_now(pending):
    """``pending`` as it is (overlapped: waited for after the block), or waited for now (``overlap("off")``)."""
    if pending is None or collectives.overlap_mode() != "off":
        return pending
    return _Arrived(pending.wait())


def ring_backward(g: Grouped, ap: AttentionPlan, dout, out, lse):
    if ap.schedule.size == 1:  # nothing travels: no head chunks, the local kind's backward
        return local_backward(g, ap, dout, out, lse)
    _eager_only(g)
    ring, options = _Ring(ap), ap.options
    delta = (dout * out).sum(-1) if needs_delta(g.q, g.k, g.v, g.mask, out) else None
    dq = torch.zeros_like(g.q)
    dk = torch.zeros(g.k.shape, dtype=dq.dtype, device=dq.device)
    dv = torch.zeros(g.v.shape, dtype=dq.dtype, device=dq.device)
    for start, length in ring.chunks:
        rows = [_head_slice(t, start, length, d) for t, d in ((dout, -4), (out, -4), (lse, -3), (delta, -3), (dq, -4))]
        _backward_chunk(_chunk(g, start, length), ring, options, *rows, _head_slice(dk, start, length),
                        _head_slice(dv, start, length))  # fmt: skip
    return dq, dk, dv


def _backward_chunk(g: Grouped, ring: _Ring, options: Options, dout, out, lse, delta, dq, dk, dv) -> None:
    """One head chunk's ring backward; adds into ``dq`` and into the own block's ``dk``/``dv``."""
    parcel, held, grads_in = _Parcel(g, ring), None, None
    for step in range(ring.size):
        src = ring.source(step)
        pending = None
        if step < ring.size - 1:
            pending = ring.post(parcel.own() if held is None else held, parcel.like(ring.source(step + 1)), _KV)
        k, v, mask = parcel.unpack(held, src)
        pending = _arrived_now(pending)
        if step == 0:
            into = (dk, dv)  # the own block's contribution stays home, in the result
        elif grads_in is None:  # the accumulator of block ``src`` is born here
            into = _Accumulator(parcel, src, dq, None)
        else:  # it arrives from the previous rank while the first tiles run
            into = _Accumulator(parcel, src, dq, grads_in)
        attend_backward(g.q, k, v, mask, ring.rows0, ring.cols0[src], ring.tiles[src], options.scale, dout, lse,
                        delta, dq, out, into=into)  # fmt: skip
        if step:
            # to the rank holding block ``src`` next; after the last step that is its owner
            posted = ring.post([into.flat()], parcel.grads_like(ring.source(step + 1), dq.dtype), _GRADS)
            grads_in = _arrived_now(posted)
        if pending is not None:
            held = pending.wait()
    if grads_in is not None:
        arrived = parcel.grads(grads_in.wait()[0], ring.me)
        dk.add_(arrived[0])
        dv.add_(arrived[1])


class _Accumulator:
    """The packed dk/dv accumulator of one block on this rank: new zeros, or the one arriving (added into in place).

    Called by :func:`.attend_backward` when the first tile's gradients are
    ready, so the arriving accumulator's transfer overlaps with that tile.
    """

    def __init__(self, parcel: _Parcel, owner: int, like: torch.Tensor, arriving):
        self._parcel, self._owner, self._like, self._arriving = parcel, owner, like, arriving
        self._flat = None

    def flat(self) -> torch.Tensor:
        if self._flat is None:
            if self._arriving is None:
                shape, dtype = self._parcel.grads_like(self._owner, self._like.dtype)[0]
                self._flat = torch.zeros(shape, dtype=dtype, device=self._like.device)
            else:
                self._flat = self._arriving.wait()[0]
        return self._flat

    def __call__(self):
        return self._parcel.grads(self.flat(), self._owner)
