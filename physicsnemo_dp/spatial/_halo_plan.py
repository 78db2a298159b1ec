"""Pure arithmetic of the halo exchange: which rows go where (no communication).

Along one tensor dim of global extent ``N``, split into shards of known sizes,
every shard ``r`` asks for a *window* ``[lo_r, hi_r)`` of global indices. The
window may reach past the shard (halo), past its neighbours (a thin shard
gathers from further ranks) and past the dim (boundary padding). Every window
position reads one global row through the boundary mode:

* ``constant`` (``zeros`` is ``constant`` with value 0): rows outside
  ``[0, N)`` are the fill value;
* ``replicate``: the nearest edge row;
* ``reflect``: mirrored about the edge rows (the edge not repeated);
* ``circular``: ``i mod N`` (periodic domains).

Only the *global* boundary is padded: inside ``[0, N)`` a window reads real
rows, whoever owns them. Each rank receives every distinct row it needs and
does not own exactly once (sorted by global index, hence by owner), then
builds its window as one concatenation of slices of ``[local | received]`` and fill.
So the bytes moved are exactly the halo volume, and replicated edge rows
travel once, not once per use.

Plans are functions of shard sizes and windows only, identical on every rank
of the group (every rank computes what every other rank asks for, so it knows
what to send). They are cached: a network applies the same few geometries
over and over (``plan_dim.cache_clear()`` resets the cache). Plans are real
tensors even while torch.compile traces; the executor hands their index
tables to the traced ops as graph constants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._torch_compat import on_real_tensors
from ..split import offsets_from_sizes

BOUNDARY_MODES = ("zeros", "constant", "replicate", "reflect", "circular")


def source_rows(lo: int, hi: int, extent: int, mode: str) -> torch.Tensor:
    """Global row read by each position of window ``[lo, hi)``; ``-1`` means the fill value."""
    i = torch.arange(lo, hi)
    if mode in ("zeros", "constant"):
        return torch.where((i >= 0) & (i < extent), i, -1)
    if len(i) and extent == 0:
        raise ValueError(f"cannot pad an empty dim in {mode!r} mode")
    if mode == "replicate":
        return i.clamp(0, max(extent - 1, 0))
    if mode == "circular":
        return i.remainder(max(extent, 1))
    if mode == "reflect":
        if extent == 1:
            return torch.zeros_like(i)
        period = 2 * (extent - 1)
        folded = i.remainder(period)
        return torch.where(folded < extent, folded, period - folded)
    raise ValueError(f"boundary mode must be one of {BOUNDARY_MODES}, got {mode!r}")


@dataclass(frozen=True, eq=False)
class DimPlan:
    """How this rank builds its window along one tensor dim.

    ``send_index`` (local rows, destinations in coordinate order) with
    ``send_peers``/``recv_peers`` (``(coordinate, rows)`` of the few ranks
    this one exchanges with, in coordinate order) drive one neighbour exchange
    over ``mesh_dim``: per call, work in the number of peers, not in the
    group size. ``send_splits``/``recv_splits`` are the same as dense
    group-long tables (for byte accounting and pictures, read at planning
    time). ``exchange`` is False when no rank of the group needs a foreign
    row (then no collective is issued at all).
    ``segments`` builds the window from ``[local rows | received rows]``:
    runs ``(window start, source start, length)`` of consecutive rows of one
    source (source ``-1``: the fill value), so the window is one
    concatenation of slices; ``identity`` says the window is exactly the
    local shard (nothing to do).
    """

    dim: int
    mesh_dim: int | None
    local_rows: int
    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_peers: tuple[tuple[int, int], ...]
    recv_peers: tuple[tuple[int, int], ...]
    segments: tuple[tuple[int, int, int], ...]
    exchange: bool
    fill: bool
    identity: bool

    @functools.cached_property
    def received_rows(self) -> int:
        """Rows this rank receives (kept: asked on every call)."""
        return sum(n for _, n in self.recv_peers)


@functools.lru_cache(maxsize=1024)
@on_real_tensors
def plan_dim(
    sizes: tuple[int, ...],
    windows: tuple[tuple[int, int], ...],
    me: int,
    mode: str,
    dim: int,
    mesh_dim: int | None,
) -> DimPlan:
    """Plan the exchange along ``dim`` for coordinate ``me`` along the mesh dim.

    ``sizes[r]`` and ``windows[r]`` are shard ``r``'s extent and requested
    window (global indices), for every rank of the group along ``mesh_dim``.

    Row tables are built only for this rank and the ranks whose windows can
    read its rows (its neighbours, and in the wrapping modes the ranks whose
    windows overhang the global boundary); the scan over the other ranks is
    integer arithmetic. So a plan for 4,096 ranks costs little more than one
    for 4, and the exchange it drives involves the peers only.
    """
    extent = sum(sizes)
    starts = offsets_from_sizes(sizes)
    ends = tuple(s + n for s, n in zip(starts, sizes))
    lo_me, hi_me = starts[me], ends[me]
    wraps = mode not in ("zeros", "constant")

    def overhangs(r: int) -> bool:
        lo, hi = windows[r]
        return wraps and hi > lo and (lo < 0 or hi > extent)

    def reads_foreign(r: int) -> bool:
        lo, hi = windows[r]
        if overhangs(r):
            return bool(_foreign(source_rows(lo, hi, extent, mode), starts[r], ends[r]).any())
        lo, hi = max(lo, 0), min(hi, extent)
        return hi > lo and (lo < starts[r] or hi > ends[r])

    def may_read_mine(r: int) -> bool:
        lo, hi = windows[r]
        return r != me and sizes[me] > 0 and (overhangs(r) or (lo < hi_me and hi > lo_me and hi > lo))

    sends = []
    for r in range(len(sizes)):
        if not may_read_mine(r):
            sends.append(None)
            continue
        src = source_rows(*windows[r], extent, mode)
        wanted = src[_foreign(src, starts[r], ends[r]) & (src >= lo_me) & (src < hi_me)]
        sends.append(torch.unique(wanted) - lo_me)
    src = source_rows(*windows[me], extent, mode)
    mine_foreign = _foreign(src, lo_me, hi_me)
    received = torch.unique(src[mine_foreign])
    owners = torch.searchsorted(torch.tensor(ends), received, right=True)
    recv_splits = tuple(torch.bincount(owners, minlength=len(sizes)).tolist())
    peers, counts = torch.unique_consecutive(owners, return_counts=True)  # owners ascend with the rows

    local, n_recv = sizes[me], len(received)
    assembly = torch.where(
        src < 0,
        local + n_recv,
        torch.where(mine_foreign, local + torch.searchsorted(received, src), src - lo_me),
    )
    exchange = any(reads_foreign(r) for r in range(len(sizes)))
    fill = bool((src < 0).any())
    present = [s for s in sends if s is not None]
    return DimPlan(
        dim=dim,
        mesh_dim=mesh_dim,
        local_rows=local,
        send_index=torch.cat(present) if present else torch.zeros(0, dtype=torch.long),
        send_splits=tuple(0 if s is None else len(s) for s in sends),
        recv_splits=recv_splits,
        send_peers=tuple((r, len(s)) for r, s in enumerate(sends) if s is not None and len(s)),
        recv_peers=tuple(zip(peers.tolist(), counts.tolist())),
        segments=_segments(assembly.tolist(), local, n_recv),
        exchange=exchange,
        fill=fill,
        identity=not exchange and not fill and torch.equal(assembly, torch.arange(local)),
    )


def _foreign(src: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Which positions of a window read a real row that the shard ``[start, end)`` does not own."""
    return (src >= 0) & ((src < start) | (src >= end))


def _segments(assembly: list[int], local: int, received: int) -> tuple[tuple[int, int, int], ...]:
    """Runs ``(window start, source start, length)`` of ``assembly``; source ``-1`` is the fill row.

    A run holds consecutive source rows from one region (local rows, received
    rows, or fill), so each run is one slice of one tensor.
    """
    fill = local + received

    def region(i):
        return 2 if i == fill else int(i >= local)

    runs: list[list[int]] = []
    for pos, i in enumerate(assembly):
        last = runs[-1] if runs else None
        if last is not None and region(i) == region(last[1]) and (i == fill or i == last[1] + last[2]):
            last[2] += 1
        else:
            runs.append([pos, i, 1])
    return tuple((pos, -1 if i == fill else i, n) for pos, i, n in runs)
