"""The pure half of attention: from specs and options to layouts, schedule and collectives (memoised).

:func:`propagate` maps the specs of ``q, k, v`` (and of the mask, if any) and
the call's non-tensor arguments to an :class:`AttentionPlan`: the canonical
layout (:mod:`._placement`), the options every rank shares, the *schedule*
(which tiles of which key/value block this rank computes, and for the ring
who holds which block when and how the backward is cut into head chunks)
and the collectives of the forward and of the backward with this rank's
bytes, counted as :mod:`physicsnemo_dp.collectives` records them.

The schedules of :mod:`.local` and :mod:`.ring` take their tiles, offsets,
block lengths and head chunks from the plan instead of deriving them while
they run, so what ``propagation.plan`` reports is what runs: the byte counts
here are computed from the same block lengths and chunks the ring sends.

Nothing here touches a tensor: shapes of the grouped local tensors
(:mod:`._heads`) are derived from the specs' local shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..propagation import CommStep, OpPlan, collective_step, moves
from ..split import chunk_sizes, offsets_from_sizes
from ._blocks import compute_dtype, plan_tiles
from ._common import Options, sequence_coordinate, token_spans
from ._heads import query_groups
from ._placement import AttentionLayout, plan_layout
from .zigzag import zigzag_sizes

#: Most head chunks a block is cut into in the ring's backward (see :mod:`.ring`): with two,
#: the blocks in flight are about half of a rank's own attention inputs and results.
_MAX_CHUNKS = 2
#: Least bytes of keys + values per chunk and hop. A message has a fixed cost (with
#: gloo on a loaded 2-core machine, 0.4-1.7 ms of CPU in its threads): measured on
#: the benchmark's transformer block at 1,024 tokens over 4 ranks (128 KiB blocks),
#: cutting at 64 KiB brought the per-rank peak from 1.47x to 1.12x the ideal at
#: the CPU work of the unpacked, uncut ring; 32 KiB chunks (4) cost 40 % more work.
_MIN_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class Block:
    """One key/value block this rank attends to: its tiles, the mask column it starts at, its token count."""

    tiles: tuple
    cols0: int
    k_len: int


@dataclass(frozen=True)
class Schedule:
    """Who computes what, when: everything the local and ring schedules need besides the tensors.

    Attributes:
        me: this rank's index along the sequence mesh dim (0 without one).
        size: ranks in the ring (1 for the local kinds).
        rows0: the mask row this rank's queries start at.
        blocks: for the ring, the block of every coordinate of the sequence mesh dim (indexed by owner); for the
            local kinds, the one block this rank attends to.
        mask_travels: the mask is split like the keys and travels with the ring's blocks.
        chunks: ``(start, length)`` of the head groups (dim -4 of the grouped tensors) whose
            ring backward runs one after the other (empty for the local kinds).
    """

    me: int
    size: int
    rows0: int
    blocks: tuple
    mask_travels: bool
    chunks: tuple

    def source(self, step: int) -> int:
        """Owner of the block this rank holds at ring step ``step``."""
        return (self.me - step) % self.size


@dataclass(frozen=True)
class AttentionPlan:
    """An attention call decided from metadata.

    Attributes:
        layout: canonical input layouts, output layout and gradient layouts.
        options: scale, causality, zig-zag order, query groups.
        schedule: the tiles and ring order (:class:`Schedule`).
        plan: the call's :class:`~physicsnemo_dp.propagation.OpPlan`: output spec, then the
            redistributions of the inputs to the canonical layout followed by the schedule's
            forward collectives.
        backward: the collectives of the schedule's backward, with the output's gradient in
            its gradient layout (a gradient in another layout is first redistributed, planned
            as any redistribution); the inputs' gradients then return to their callers'
            layouts through the redistributions' own backward.
    """

    layout: AttentionLayout
    options: Options
    schedule: Schedule
    plan: OpPlan
    backward: tuple


# --------------------------------------------------------------------------- #
# Validation, from metadata only (every rank raises the same error)
# --------------------------------------------------------------------------- #
def _validate(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> int:
    """Check the call (specs); returns the number of query heads per key/value head."""
    if dropout_p != 0.0:
        raise ValueError(
            f"scaled_dot_product_attention on ShardTensors needs dropout_p=0, got {dropout_p}: "
            "sharded attention has no reproducible dropout; pass dropout_p=0.0 (or put the module "
            "in eval mode) and apply dropout to the attention output instead"
        )
    qs, ks, vs = q.global_shape, k.global_shape, v.global_shape
    if not (len(qs) == len(ks) == len(vs)) or len(qs) < 2:
        raise ValueError(
            "scaled_dot_product_attention on ShardTensors needs query, key and value with the same "
            f"number of dims (at least 2), got {len(qs)}, {len(ks)} and {len(vs)}"
        )
    qd, kd, vd = (t.tensor_meta.dtype for t in (q, k, v))
    if not (qd == kd == vd):
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {qd} key.dtype: {kd} and value.dtype: {vd} instead."
        )
    if qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise RuntimeError(
            f"scaled_dot_product_attention: query {qs}, key {ks} and value "
            f"{vs} need query.size(-1) == key.size(-1) and key.size(-2) == value.size(-2)"
        )
    for d in range(len(qs) - 3):
        torch.broadcast_shapes((qs[d],), (ks[d],), (vs[d],))
    if len(qs) >= 3:
        hq, hk, hv = qs[-3], ks[-3], vs[-3]
        gqa = enable_gqa and hk == hv and hk > 0 and hq % hk == 0
        if not (gqa or {hk, hv} <= {1, hq}):
            raise RuntimeError(
                f"scaled_dot_product_attention: {hq} query heads cannot attend to {hk} key and {hv} "
                "value heads; pass enable_gqa=True with key/value heads dividing the query heads"
            )
    if mask is not None:
        md, ms = mask.tensor_meta.dtype, mask.global_shape
        if md != torch.bool and not md.is_floating_point:
            raise RuntimeError(f"Expected attn_mask dtype to be bool or float, but got {md}")
        if len(ms) > max(len(qs), 2):
            raise RuntimeError(f"attn_mask of shape {ms} has more dims than the query")
        torch.broadcast_shapes(ms, (*torch.broadcast_shapes(qs[:-2], ks[:-2]), qs[-2], ks[-2]))
        if is_causal:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    return query_groups(qs[-3], ks[-3]) if len(qs) >= 3 else 1


def _check_zigzag(layout: AttentionLayout) -> None:
    """Under ``zigzag_causal()`` a sharded sequence must have the zig-zag shard sizes."""
    m = layout.seq_mesh_dim
    for name, spec in (("query", layout.q), ("key", layout.k)):
        table = spec.dim_sizes[-2]
        n = spec.global_shape[-2]
        if table is not None and tuple(table) != zigzag_sizes(n, spec.mesh.size(m)):
            raise ValueError(
                f"inside zigzag_causal() the {name} sequence must be laid out by to_zigzag "
                f"(shard sizes {zigzag_sizes(n, spec.mesh.size(m))}), got shard sizes {tuple(table)}"
            )


# --------------------------------------------------------------------------- #
# Shapes of the grouped local tensors (see _heads.py), from specs
# --------------------------------------------------------------------------- #
def _grouped_shapes(layout: AttentionLayout, groups: int):
    """Local shapes of the grouped ``q, k, v, mask`` (mask None without one)."""

    def lift(shape):
        return (1, *shape) if len(shape) == 2 else tuple(shape)

    q, k, v = (lift(s.local_shape) for s in (layout.q, layout.k, layout.v))
    q5 = (*q[:-3], q[-3] // groups, groups, *q[-2:])
    k5, v5 = ((*t[:-2], 1, *t[-2:]) for t in (k, v))
    mask5 = None
    if layout.mask is not None:
        m = tuple(layout.mask.local_shape)
        m = (1,) * (max(len(layout.q.global_shape), 3) - len(m)) + m
        mask5 = (*m[:-3], m[-3] // groups, groups, *m[-2:]) if groups > 1 and m[-3] > 1 else (*m[:-2], 1, *m[-2:])
    return q5, k5, v5, mask5


def _head_groups(heads: int, parts: int) -> tuple:
    """``(start, length)`` of at most ``parts`` groups of ``heads`` heads, cut with the split rule."""
    sizes = chunk_sizes(heads, max(1, min(heads, parts)))
    return tuple((o, n) for o, n in zip(offsets_from_sizes(sizes), sizes) if n)


def _chunks(shapes, itemsize: int, mask_travels: bool, k_lens) -> tuple:
    """Head chunks of the ring's backward: cut only while each still moves ``_MIN_CHUNK_BYTES`` per hop.

    Keys (or a mask) shared by all heads would travel once per chunk, so those are never cut;
    the decision uses the largest block of any rank, so all ranks agree.
    """
    q5, k5, v5, mask5 = shapes
    heads = q5[-4]
    if heads == 1 or k5[-4] != heads or v5[-4] != heads or (mask_travels and mask5[-4] != heads):
        return ((0, heads),)
    token = sum(math.prod(t[:-2]) * t[-1] * itemsize for t in (k5, v5))
    return _head_groups(heads, min(_MAX_CHUNKS, max(k_lens) * token // _MIN_CHUNK_BYTES))


def _schedule(layout: AttentionLayout, options: Options, shapes, itemsize: int) -> Schedule:
    me = sequence_coordinate(layout)
    ring = layout.kind == "ring"
    size = layout.q.mesh.size(layout.seq_mesh_dim) if ring else 1
    q_spans, q_offset = token_spans(layout.q, layout, options, me)
    rows0 = 0 if layout.mask_split == "rows" else q_offset
    mask_travels = layout.mask_split == "cols"
    blocks = []
    for j in range(size) if ring else (me,):
        k_spans, k_offset = token_spans(layout.k, layout, options, j)
        tiles = tuple(plan_tiles(q_spans, k_spans, options.causal))
        blocks.append(Block(tiles, 0 if mask_travels else k_offset, sum(s.length for s in k_spans)))
    k_lens = [b.k_len for b in blocks]
    chunks = _chunks(shapes, itemsize, mask_travels, k_lens) if ring else ()
    return Schedule(me, size, rows0, tuple(blocks), mask_travels, chunks)


# --------------------------------------------------------------------------- #
# The collectives of the schedules, with this rank's bytes
# --------------------------------------------------------------------------- #
def _with_tokens(shape, n: int, dim: int = -2):
    out = list(shape)
    out[dim] = n
    return out


def _heads_of(shape, length: int | None):
    """A grouped shape cut to a head chunk of ``length`` heads (dim -4), unless it broadcasts there (None: uncut)."""
    return shape if length is None or shape[-4] == 1 else _with_tokens(shape, length, -4)


def _ring_steps(sched: Schedule, m: int, shapes, dtypes, backward: bool) -> tuple:
    """The ring's ``send_recv`` steps in the order they are posted (forward, or every backward chunk)."""
    _, k5, v5, mask5 = shapes
    kv_size, mask_size, acc_size = dtypes

    def kv(owner, length):
        n = sched.blocks[owner].k_len
        size = sum(math.prod(_with_tokens(_heads_of(t, length), n)) for t in (k5, v5))
        return size * kv_size + (math.prod(_with_tokens(_heads_of(mask5, length), n, -1)) * mask_size if sched.mask_travels else 0)

    def acc(owner, length):
        n = sched.blocks[owner].k_len
        return sum(math.prod(_with_tokens(_heads_of(t, length), n)) for t in (k5, v5)) * acc_size

    def hop(bytes_of, step, length):
        return CommStep("send_recv", m, bytes_of(sched.source(step), length), bytes_of(sched.source(step + 1), length))

    steps = []
    for _, length in sched.chunks if backward else ((0, None),):
        for step in range(sched.size):
            if step < sched.size - 1:
                steps.append(hop(kv, step, length))
            if backward and step:
                steps.append(hop(acc, step, length))  # the accumulator of the block held, on to its next holder
    return tuple(steps)


def _schedule_steps(layout: AttentionLayout, sched: Schedule, shapes) -> tuple[tuple, tuple]:
    """``(forward steps, backward steps)`` of the layout's schedule."""
    m = layout.seq_mesh_dim
    q5, k5, v5, _ = shapes
    compute = compute_dtype(layout.q.tensor_meta.dtype)
    if layout.kind == "kv_sharded":
        # the log-sum-exp (max, then sum of exponentials) forward, delta backward: one value per query row
        rows = math.prod(torch.broadcast_shapes(q5[:-2], k5[:-2], v5[:-2])) * q5[-2]
        group = layout.q.mesh.size(m)
        step = collective_step("all_reduce", m, rows, compute.itemsize, group)
        return (step, step), (step,)
    if layout.kind == "ring":
        mask_size = layout.mask.tensor_meta.dtype.itemsize if layout.mask is not None else 0
        dtypes = (layout.k.tensor_meta.dtype.itemsize, mask_size, compute.itemsize)
        return _ring_steps(sched, m, shapes, dtypes, False), _ring_steps(sched, m, shapes, dtypes, True)
    return (), ()


# --------------------------------------------------------------------------- #
# The propagator
# --------------------------------------------------------------------------- #
def _resolved(spec):
    if spec is None or not spec.has_partial:
        return spec
    return spec.with_layout(tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements), spec.dim_sizes)


def _target(spec, canonical):
    """``canonical`` if ``spec`` must move to it, None if it is used as it is."""
    if spec is None or (spec.placements, spec.dim_sizes) == (canonical.placements, canonical.dim_sizes):
        return None
    return canonical


@lru_cache(maxsize=1024)
def propagate(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, zigzag) -> AttentionPlan:
    """The plan of ``F.scaled_dot_product_attention`` on specs ``q, k, v, mask`` (mask None: no mask).

    ``zigzag`` is whether ``zigzag_causal()`` is active (the caller reads it, so it
    is part of the key). Pure and memoised; raises the errors torch would raise for
    an invalid call, and ValueError for ``dropout_p != 0``.
    """
    groups = _validate(q, k, v, mask, dropout_p, is_causal, enable_gqa)
    layout = plan_layout(_resolved(q), _resolved(k), _resolved(v), _resolved(mask), groups)
    zigzag = bool(is_causal and zigzag)
    if zigzag and layout.seq_mesh_dim is not None:
        _check_zigzag(layout)
    options = Options(
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.global_shape[-1]),
        causal=bool(is_causal),
        zigzag=zigzag,
        groups=groups,
    )
    shapes = _grouped_shapes(layout, groups)
    sched = _schedule(layout, options, shapes, layout.k.tensor_meta.dtype.itemsize)
    forward, backward = _schedule_steps(layout, sched, shapes)
    specs, canonical = (q, k, v, mask), (layout.q, layout.k, layout.v, layout.mask)
    targets = tuple(_target(s, c) for s, c in zip(specs, canonical))
    plan = OpPlan((layout.out,), moves(specs, targets) + forward, targets[: 3 + (mask is not None)])
    return AttentionPlan(layout, options, sched, plan, backward)
