"""Pure shape arithmetic of ``view``/``reshape`` on uneven layouts (no tensors, no communication).

A reshape maps *groups* of input dims onto groups of output dims with the same
product (``(4, 3) -> (2, 6)`` is one group, ``(7, 5, 3) -> (7, 15)`` is ``7 -> 7``
and ``5, 3 -> 15``). Within a group the data is laid out row-major, so a rank
that holds the slab ``[a, b)`` of the group's outermost input dim holds the
contiguous run ``[a * inner_in, b * inner_in)`` of the flattened group. That run
is a slab of the outermost *output* dim exactly when its ends are multiples of
``inner_out``. Hence the one rule (:func:`output_layout`):

* a group may stay sharded only on its outermost input dim, and only when every
  shard's extent times ``inner_in`` is divisible by ``inner_out``; the output
  shard sizes are then ``extent * inner_in // inner_out`` on the outermost
  output dim. This covers merging (``inner_out == 1``: always keeps) and
  splitting (``inner_in == 1``: keeps when every shard divides by the inner
  product), with nested sharding too, since the size table is ordered like the
  slabs.
* anything else — a sharded inner dim, indivisible shard sizes, a sharded
  size-1 dim that the view drops — needs data to move first.
  :func:`compatible_layout` picks where: each offending mesh dim moves its
  shard to the group head (or another group head) that can carry the most
  whole units, with the split rule over those units (one all-to-all; the
  shard stays O(local)); only when no dim can carry it does it gather.
  A dim whose own head holds a whole unit keeps its shard, rebalanced by moving each shard
  boundary to the nearest whole unit (:func:`rounded_table`): splitting
  ``H`` into windows ``(H // ws, ws)`` on shards that cut windows moves only
  the rows of the cut windows, less than half a window per boundary, and the
  windows never land on a channel dim that a following contraction sums.
  A shard moved to another dim is laid out by the split rule over its units.

Size-1 dims are paired with size-1 dims when both sides are at one, dropped
(input only) or inserted (output only) otherwise.
"""

from __future__ import annotations

from math import gcd, prod
from typing import Sequence

from torch.distributed.tensor.placement_types import Replicate, Shard

from . import _layout
from .split import chunk_sizes

__all__ = ["view_groups", "output_layout", "compatible_layout", "nested_chunks", "rounded_table"]


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple:
    """``((in_dims, out_dims), ...)`` covering both shapes in order; products match per group.

    Both shapes must have the same non-zero number of elements. Groups with
    empty ``out_dims`` drop size-1 input dims; groups with empty ``in_dims``
    insert size-1 output dims. A group with both sides starts with a dim of
    size > 1 on each side unless it pairs two size-1 dims.
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if prod(in_shape) != prod(out_shape) or prod(in_shape) == 0:
        raise ValueError(f"cannot group {in_shape} -> {out_shape}: element counts differ or are zero")
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        one_in = i < len(in_shape) and in_shape[i] == 1
        one_out = j < len(out_shape) and out_shape[j] == 1
        if one_in and one_out:
            groups.append(((i,), (j,)))
            i, j = i + 1, j + 1
        elif one_in or j == len(out_shape):
            groups.append(((i,), ()))
            i += 1
        elif one_out or i == len(in_shape):
            groups.append(((), (j,)))
            j += 1
        else:
            ins, outs = [i], [j]
            p, q = in_shape[i], out_shape[j]
            i, j = i + 1, j + 1
            while p != q:
                if p < q:
                    p *= in_shape[i]
                    ins.append(i)
                    i += 1
                else:
                    q *= out_shape[j]
                    outs.append(j)
                    j += 1
            groups.append((tuple(ins), tuple(outs)))
    return tuple(groups)


def _inner(shape, dims) -> int:
    return prod(shape[d] for d in dims[1:])


def _unit(in_shape, out_shape, group) -> int:
    """Smallest head extent whose flattened run is a whole number of output rows."""
    ins, outs = group
    inner_out = _inner(out_shape, outs)
    return inner_out // gcd(inner_out, _inner(in_shape, ins))


def _blocked_dims(in_shape, out_shape, placements, dim_sizes) -> list[int]:
    """Sharded input dims that the reshape cannot carry through unchanged."""
    blocked = []
    for ins, outs in view_groups(in_shape, out_shape):
        for pos, d in enumerate(ins):
            if dim_sizes[d] is None:
                continue
            if not outs or pos > 0:
                blocked.append(d)
            elif any(s % _unit(in_shape, out_shape, (ins, outs)) for s in dim_sizes[d]):
                blocked.append(d)
    return blocked


def output_layout(in_shape, out_shape, placements, dim_sizes):
    """``(placements, dim_sizes)`` of the reshaped tensor, or ``None`` if data must move first.

    Replicate and Partial mesh dims are unaffected. A tensor with no elements
    keeps no sharding (every local piece is empty, so any layout holds it).
    """
    placements = tuple(placements)
    if prod(in_shape) == 0:
        return tuple(Replicate() if issubclass(type(p), Shard) else p for p in placements), (None,) * len(out_shape)
    if _blocked_dims(in_shape, out_shape, placements, dim_sizes):
        return None
    tables: list = [None] * len(out_shape)
    target = {}
    for ins, outs in view_groups(in_shape, out_shape):
        if ins and outs and dim_sizes[ins[0]] is not None:
            ratio_in, ratio_out = _inner(in_shape, ins), _inner(out_shape, outs)
            tables[outs[0]] = tuple(s * ratio_in // ratio_out for s in dim_sizes[ins[0]])
            target[ins[0]] = outs[0]
    out = tuple(Shard(target[p.dim]) if issubclass(type(p), Shard) else p for p in placements)
    return out, tuple(tables)


def nested_chunks(total: int, parts: Sequence[int]) -> tuple[int, ...]:
    """Split rule nested over mesh dims of sizes ``parts`` (outer first), flat table order."""
    pieces = [total]
    for n in parts:
        pieces = [s for piece in pieces for s in chunk_sizes(piece, n)]
    return tuple(pieces)


def rounded_table(table: Sequence[int], unit: int) -> tuple[int, ...]:
    """Shard sizes with every shard boundary moved to the nearest multiple of ``unit`` (halves round up).

    The rows that change owner are those of the units a boundary cuts, fewer
    than ``unit / 2`` per boundary, whatever the number of shards: what a
    split of a sharded dim into whole units (``H -> (H // ws, ws)``) has to
    move, and no more. The table keeps its (flat, nested) order, so it fits
    the same mesh dims; a shard smaller than half a unit may become empty.
    """
    bounds, start = [], 0
    for size in table:
        start += size
        bounds.append((2 * start + unit) // (2 * unit) * unit)
    return tuple(b - a for a, b in zip([0] + bounds[:-1], bounds))


def compatible_layout(in_shape, out_shape, placements, dim_sizes, mesh_shape):
    """An input layout that :func:`output_layout` can carry through the reshape.

    Returns ``(placements, dim_sizes)``, equal to the input's when nothing
    has to move. For each blocked dim, the mesh dims sharding it move together
    to the group head that fits the most whole units (its own head, itself
    rebalanced: each boundary rounded to the nearest whole unit, or the head
    of another group, split by the split rule over its units); with no head
    free they become Replicate. The dim's own head is chosen whenever it holds
    a whole unit; otherwise the head that keeps the most shards non-empty
    (``min(units, shards)``), then the one with the most units.
    """
    placements, tables = list(placements), list(dim_sizes)
    if prod(in_shape) == 0:
        return tuple(placements), tuple(tables)
    heads = {ins[0]: (ins, outs) for ins, outs in view_groups(in_shape, out_shape) if ins and outs}
    for d in _blocked_dims(in_shape, out_shape, placements, dim_sizes):
        mesh_dims = _layout.sharding_mesh_dims(placements, d)
        busy = {p.dim for p in placements if issubclass(type(p), Shard)} - {d}
        units = {e: in_shape[e] // _unit(in_shape, out_shape, g) for e, g in heads.items() if e not in busy}
        shards = prod(mesh_shape[m] for m in mesh_dims)
        # The dim's own head whenever it has a whole unit: a split such as Swin's H -> (H // ws, ws) then only
        # moves the rows of the units its shard boundaries cut (some shards may end empty when there are fewer
        # units than shards), and never lands on a channel dim that a following contraction would sum into
        # pending values. Otherwise the head that keeps the most shards busy, then the most units.
        best = max(units, key=lambda e: (e == d and units[e] > 0, min(units[e], shards), units[e], -e), default=None)
        tables[d] = None
        if best is None or units[best] == 0:
            for m in mesh_dims:
                placements[m] = Replicate()
            continue
        unit = _unit(in_shape, out_shape, heads[best])
        for m in mesh_dims:
            placements[m] = Shard(best)
        if best == d:
            tables[d] = rounded_table(dim_sizes[d], unit)
            continue
        chunks = nested_chunks(units[best], [mesh_shape[m] for m in mesh_dims])
        tables[best] = tuple(c * unit for c in chunks)
    return tuple(placements), tuple(tables)
