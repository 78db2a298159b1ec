"""Pure interval arithmetic for slicing and joining along a sharded dim.

Along a sharded dim the flat size table lists consecutive slabs, one per
shard (:mod:`physicsnemo_dp._layout`). Slicing, splitting and selecting keep
each rank's part of its own slab, so their output layouts follow from the
table alone and need no communication; concatenation needs the reverse:
which part of each input lands in which rank's output slab.
"""

from __future__ import annotations

from typing import Sequence

from .split import chunk_sizes, offsets_from_sizes

__all__ = ["normalize_slice", "slice_table", "owner", "intersect", "tiles", "scatter_table"]


def normalize_slice(size: int, start, end, step: int) -> tuple[int, int, int]:
    """``(start, end, step)`` of ``aten.slice`` with torch's clamping (``None`` = open end)."""
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step}")
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def slice_table(table: Sequence[int], start: int, end: int, step: int):
    """Per shard ``(local_start, count)`` of the normalized slice ``[start:end:step]``.

    A shard's elements are those global indices ``start + k * step`` inside
    its slab; ``local_start`` is where the first one sits in the local tensor
    (0 when the shard keeps nothing).
    """
    out = []
    for offset, size in zip(offsets_from_sizes(table), table):
        lo, hi = max(offset, start), min(offset + size, end)
        first = start + -(-(lo - start) // step) * step
        count = max(0, -(-(hi - first) // step))
        out.append((first - offset if count else 0, count))
    return tuple(out)


def owner(table: Sequence[int], index: int) -> int:
    """Flat position of the shard that holds global ``index``."""
    for k, (offset, size) in enumerate(zip(offsets_from_sizes(table), table)):
        if offset <= index < offset + size:
            return k
    raise IndexError(f"index {index} is outside a dim of size {sum(table)}")


def intersect(table: Sequence[int], lo: int, hi: int) -> tuple[int, ...]:
    """Extent of each shard's slab inside ``[lo, hi)``."""
    return tuple(
        max(0, min(offset + size, hi) - max(offset, lo))
        for offset, size in zip(offsets_from_sizes(table), table)
    )


def tiles(pieces: Sequence, shards: int):
    """Size tables that concatenate without communication, or ``None``.

    ``pieces`` has one entry per input in concatenation order: a flat size
    table (the input is sharded like the output) or an int, the extent of an
    input every rank holds whole. Concatenation is free when walking the
    output in order never returns to an earlier shard: then each shard's
    pieces are adjacent. A whole input goes to the shard holding the data just
    before it (the first shard with data after it when it leads). Returns each
    input's table in the output's sharding.
    """
    owners = [[k for k, s in enumerate(p) if s] if not isinstance(p, int) else None for p in pieces]
    last = -1
    for ks in owners:
        if ks:
            if ks[0] < last:
                return None
            last = ks[-1]
    out, current = [], None
    for i, (piece, ks) in enumerate(zip(pieces, owners)):
        if ks:
            current = ks[-1]
        if not isinstance(piece, int):
            out.append(tuple(piece))
            continue
        k = current if current is not None else next((o[0] for o in owners[i + 1 :] if o), 0)
        out.append(tuple(piece if j == k else 0 for j in range(shards)))
    return tuple(out)


def scatter_table(grad_table: Sequence[int], size: int, start: int, step: int, preferred: Sequence[int] | None = None):
    """Layout for the gradient of a slice, built without communication.

    The slice's gradient is zero except at ``start + j * step``; shard ``k``
    holds the gradient entries ``grad_table[k]``, so its slab must cover them
    (slabs follow each other in shard order). Within that constraint the
    slab boundaries are those of ``preferred`` (default: the split rule's
    sizes of ``size``), each moved only as far as needed: the zeros are
    spread over the shards. (Giving the zeros to the shards with entries
    instead would put the whole gradient of a small slice — the low modes of
    a spectrum, a boundary row — on the one rank that holds the slice:
    O(global) memory there.) Returns ``(table, local_starts)``, or ``None``
    when no shard has an entry.
    """
    firsts = [start + step * o for o in offsets_from_sizes(grad_table)]
    filled = [k for k, g in enumerate(grad_table) if g]
    if not filled:
        return None
    ends = {k: firsts[k] + (grad_table[k] - 1) * step + 1 for k in filled}
    preferred = chunk_sizes(size, len(grad_table)) if preferred is None else preferred
    targets = offsets_from_sizes(preferred)
    bounds = [0]
    for k in range(1, len(grad_table)):
        low = max([ends[j] for j in filled if j < k], default=0)  # after every earlier shard's entries
        high = min([firsts[j] for j in filled if j >= k], default=size)  # before every later shard's entries
        bounds.append(min(max(targets[k], low, bounds[-1]), high))
    bounds.append(size)
    table = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    starts = tuple(firsts[k] - bounds[k] if grad_table[k] else 0 for k in range(len(grad_table)))
    return table, starts
