"""Brute-force neighbour search on plain tensors, in blocks so memory stays bounded.

Exactness rests on one rule: every squared distance, between two points or
between a point and a bounding box, is computed by the same formula, the sum
over coordinates *in coordinate order* of squared differences, each step a
separate elementwise op in the points' dtype (:func:`sq_dist`). Elementwise
float ops are correctly rounded and do not depend on the shape of the tensor
they run on, so a pair of points gets the same bits whichever block, rank or
process computes it, and ties (duplicate points, points at equal distance)
are seen identically everywhere. ``torch.cdist`` would not do: its
``|a|^2 + |b|^2 - 2ab`` path rounds differently per block size.

Rounding is monotone, so the box bounds computed by the same formula are
true bounds *of the computed distances* too: for q inside a box and x below
it, ``fl(q - x) >= fl(lo - x)`` (likewise above it and for the far corner),
coordinate by coordinate and through squares and sums, hence
``box_gap2(x, box) <= sq_dist(x, q) <= box_far2(x, box)`` bit for bit. That is
what lets pruning never drop a neighbour the brute force would find.

Order: candidates are ranked by ``(squared distance, global id)``. A row's
running best list is merged with each new block by sorting on id, then
stably on distance, so the order of blocks (local points first, then what
other ranks sent) does not matter.
"""

from __future__ import annotations

import torch

#: candidates are grouped in blocks of CANDIDATE_COLS consecutive points, queries in blocks of QUERY_ROWS.
#: Blocks are small so that whole blocks can be skipped: consecutive points of a curve-ordered cloud are compact, so
#: most candidate blocks' boxes lie beyond every query's current k-th distance (or the radius).
QUERY_ROWS = 128
CANDIDATE_COLS = 256
#: candidate blocks searched in one pass (bounds a pass's distances to QUERY_ROWS x 8 Ki entries)
UNION_BLOCKS = 32


def sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(n, m)`` squared distances of rows of ``a`` ``(n, D)`` to rows of ``b`` ``(m, D)`` (the one formula)."""
    out = None
    for d in range(a.shape[1]):  # adding the first square to 0 would change no bit: start from it
        diff = a[:, d, None] - b[None, :, d]
        out = diff * diff if out is None else out.add_(diff * diff)
    return out


def box_gap2(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``(n, B)`` lower bounds of the squared distance of each row of ``x`` to any point of each box.

    An empty box (``lo = +inf``, ``hi = -inf``) is infinitely far.
    """
    out = x.new_zeros(x.shape[0], lo.shape[0])
    for d in range(x.shape[1]):
        gap = torch.maximum(lo[None, :, d] - x[:, d, None], x[:, d, None] - hi[None, :, d]).clamp_min(0)
        out = out + gap * gap
    return out


def box_far2(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``(n, B)`` upper bounds of the squared distance of each row of ``x`` to any point of each box."""
    out = x.new_zeros(x.shape[0], lo.shape[0])
    for d in range(x.shape[1]):
        far = torch.maximum((x[:, d, None] - lo[None, :, d]).abs(), (x[:, d, None] - hi[None, :, d]).abs())
        out = out + far * far
    return out


def box_pair_gap2(lo_a, hi_a, lo, hi) -> torch.Tensor:
    """``(B,)`` lower bounds of the squared distance between any point of box ``a`` and any point of each box."""
    out = lo.new_zeros(lo.shape[0])
    for d in range(lo.shape[1]):
        gap = torch.maximum(lo[:, d] - hi_a[d], lo_a[d] - hi[:, d]).clamp_min(0)
        out = out + gap * gap
    return out


def _candidate_blocks(candidates: torch.Tensor):
    """Bounding boxes ``(lo, hi)`` ``(blocks, D)`` of the blocks of CANDIDATE_COLS consecutive candidates."""
    blocks = candidates.split(CANDIDATE_COLS)
    return torch.stack([b.amin(0) for b in blocks]), torch.stack([b.amax(0) for b in blocks])


def _masked(d2, q_ids, c_ids, loop: bool, radius):
    """Distances with the point itself (unless ``loop``) and points beyond ``radius`` set to +inf."""
    if not loop:
        d2 = d2.masked_fill(q_ids[:, None] == c_ids[None, :], torch.inf)
    if radius is not None:
        d2 = d2.masked_fill(~(d2.sqrt() <= radius), torch.inf)
    return d2


def _block_best(d2: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` first of each row of ``d2`` in (distance, id) order; ``ids`` ``(m,)`` ascending.

    ``topk`` finds the k-th value (values are exact whatever its tie order);
    among entries equal to it the leftmost, i.e. lowest ids, are kept.
    """
    if d2.shape[1] > k:
        kth = torch.topk(d2, k, dim=1, largest=False, sorted=False).values.amax(1, keepdim=True)
        keep = d2 <= kth
        if (keep.sum(1) != k).any():  # ties at the k-th distance: of those, keep the leftmost
            below = d2 < kth
            tie = d2 == kth
            keep = below | (tie & (tie.cumsum(1) <= k - below.sum(1, keepdim=True)))
        cols = keep.nonzero(as_tuple=True)[1].view(-1, k)  # row-major: ascending column within a row
    else:
        cols = torch.arange(d2.shape[1], device=d2.device).expand(d2.shape[0], -1)
    sel = d2.gather(1, cols)
    order = torch.sort(sel, dim=1, stable=True).indices
    return sel.gather(1, order), ids[cols.gather(1, order)]


def _merge(best, new, k: int):
    """Merge two per-row lists of (d2, ids), each in (distance, id) order; keep the first ``k``."""
    if best is None:
        return new
    d2 = torch.cat([best[0], new[0]], 1)
    ids = torch.cat([best[1], new[1]], 1)
    by_id = ids.argsort(1)
    d2, ids = d2.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(d2, dim=1, stable=True).indices[:, :k]
    return d2.gather(1, order), ids.gather(1, order)


def nearest(queries, q_ids, candidates, c_ids, k: int, *, loop: bool, radius=None, best=None):
    """Update each query's running ``k`` nearest ``(d2 (n, <=k), ids)`` with a set of candidates.

    ``c_ids`` must be ascending (each rank's points are a contiguous id range, and
    ranks send theirs in order). Excluded entries (the point itself unless ``loop``,
    points beyond ``radius``) have distance +inf and come last.

    Per block of queries: the candidate block with the nearest box first, which
    bounds every query's k-th distance; then, in one pass, only the blocks whose
    boxes lie within that bound (and ``radius``). The bounds are exact for the
    computed distances (see the module doc), so skipping never changes the result.
    """
    n, m = queries.shape[0], candidates.shape[0]
    if m == 0 or n == 0:
        return best if best is not None else (queries.new_zeros(n, 0), q_ids.new_zeros(n, 0))
    lo, hi = _candidate_blocks(candidates)
    parts = []
    for q0 in range(0, n, QUERY_ROWS):
        q, qi = queries[q0 : q0 + QUERY_ROWS], q_ids[q0 : q0 + QUERY_ROWS]
        run = None if best is None else (best[0][q0 : q0 + QUERY_ROWS], best[1][q0 : q0 + QUERY_ROWS])
        gap2 = box_pair_gap2(q.amin(0), q.amax(0), lo, hi)
        if radius is not None:
            gap2 = gap2.masked_fill(~(gap2.sqrt() <= radius), torch.inf)
        first = int(gap2.argmin())
        if torch.isfinite(gap2[first]):
            run = _merge(run, _best_of(q, qi, candidates, c_ids, [first], k, loop, radius), k)
            bound = run[0][:, k - 1].max() if run[0].shape[1] == k else torch.inf
            rest = ((gap2 <= bound) & torch.isfinite(gap2)).nonzero().flatten().tolist()
            rest = [b for b in rest if b != first]
            for g0 in range(0, len(rest), UNION_BLOCKS):
                run = _merge(run, _best_of(q, qi, candidates, c_ids, rest[g0 : g0 + UNION_BLOCKS], k, loop, radius), k)
        parts.append(run if run is not None else (q.new_zeros(q.shape[0], 0), qi.new_zeros(q.shape[0], 0)))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _columns(blocks, m: int) -> torch.Tensor:
    """Candidate positions of the given blocks (ascending block numbers: ascending positions)."""
    return torch.cat([torch.arange(b * CANDIDATE_COLS, min(m, (b + 1) * CANDIDATE_COLS)) for b in blocks])


def _best_of(q, qi, candidates, c_ids, blocks, k, loop, radius):
    """The ``k`` first (d2, id) per query over the candidates of ``blocks`` (ascending)."""
    cols = _columns(blocks, candidates.shape[0]).to(candidates.device)
    ci = c_ids[cols]
    return _block_best(_masked(sq_dist(q, candidates[cols]), qi, ci, loop, radius), ci, k)


def kth_bound(best_d2, queries, lo, hi, counts, k: int) -> torch.Tensor:
    """Per query, an upper bound of its k-th nearest squared distance over ALL points.

    Two certificates, whichever is smaller: the k-th local distance (``best_d2``,
    the running list over this rank's points, +inf when it holds fewer than
    ``k``), and the smallest radius R such that the local points within R plus
    the whole of every other rank whose box lies within R (``box_far2 <= R``)
    number at least ``k``. The second is finite whenever ``k`` points exist, so
    a rank with fewer than ``k`` points still gets a finite reach from the
    box table alone (no extra round, no ring).
    """
    if best_d2.shape[1] >= k:
        bound = best_d2[:, k - 1]
    else:
        bound = torch.full((queries.shape[0],), torch.inf, dtype=queries.dtype, device=queries.device)
    if lo.shape[0]:
        far2, order = box_far2(queries, lo, hi).sort(1)
        whole = counts[order].cumsum(1)
        local = torch.searchsorted(best_d2.contiguous(), far2.contiguous(), right=True)
        bound = torch.minimum(bound, torch.where(whole + local >= k, far2, torch.inf).amin(1))
    return bound


def within(queries, q_ids, candidates, c_ids, radius, *, loop: bool):
    """All pairs within ``radius``: ``(query row, candidate id, d2)`` flat, in no particular order.

    Candidate blocks whose box is beyond ``radius`` of a query block's box are skipped.
    """
    n, m = queries.shape[0], candidates.shape[0]
    rows_out, ids_out, d2_out = [], [], []
    if n and m:
        lo, hi = _candidate_blocks(candidates)
        for q0 in range(0, n, QUERY_ROWS):
            q, qi = queries[q0 : q0 + QUERY_ROWS], q_ids[q0 : q0 + QUERY_ROWS]
            near = (box_pair_gap2(q.amin(0), q.amax(0), lo, hi).sqrt() <= radius).nonzero().flatten().tolist()
            for g0 in range(0, len(near), UNION_BLOCKS):
                cols = _columns(near[g0 : g0 + UNION_BLOCKS], m).to(candidates.device)
                ci = c_ids[cols]
                d2 = _masked(sq_dist(q, candidates[cols]), qi, ci, loop, radius)
                r, col = torch.isfinite(d2).nonzero(as_tuple=True)
                rows_out.append(r + q0)
                ids_out.append(ci[col])
                d2_out.append(d2[r, col])
    if not rows_out:
        return q_ids.new_zeros(0), q_ids.new_zeros(0), queries.new_zeros(0)
    return torch.cat(rows_out), torch.cat(ids_out), torch.cat(d2_out)


def order_pairs(rows, ids, d2):
    """Flat pairs sorted by (query row, distance, id): per query, nearest first, ties by id."""
    perm = torch.arange(rows.numel(), device=rows.device)
    for key in (ids, d2, rows):  # least significant key first, each sort stable
        perm = perm[torch.sort(key[perm], stable=True).indices]
    return rows[perm], ids[perm], d2[perm]
