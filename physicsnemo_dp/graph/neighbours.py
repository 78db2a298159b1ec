"""kNN and radius search on point-sharded point clouds, pruned by the partition's spatial compactness.

``knn(points, k)`` and ``radius(points, r)`` return the edges ``j -> i`` from
each point ``i`` to its neighbours ``j`` among *all* points of the cloud, as a
:class:`ShardedGraph` whose edges live with their destination (the query
point), plus their distances. The result equals a brute-force search in one
process: the same neighbour sets in the same order (nearest first, ties by
global index) and the same distance bits (see :mod:`._search` for why the bits
agree and how ties are seen identically on every rank).

Why it needs little communication: a datapipe partition (space-filling-curve
order, one contiguous range per rank) makes each rank's points spatially
compact, so most neighbours of a rank's points are on that rank and the rest
on ranks whose bounding boxes are close. The search therefore moves only
candidate points that can matter:

1. every rank all-gathers ``BOXES`` bounding boxes of consecutive runs of its
   points (``2 D BOXES`` numbers per rank);
2. **radius**: rank ``s`` sends to rank ``t`` its points within ``r`` of one of
   ``t``'s boxes; **kNN**: each rank first finds the k nearest among its own
   points, bounds each query's k-th distance (by that, or by whole boxes of
   other ranks near enough to hold ``k`` points, see :func:`._search.kth_bound`)
   and all-gathers its *reach* per box, the largest bound over the box's
   queries; rank ``s`` sends to ``t`` its points within reach of one of ``t``'s boxes;
3. one all-to-all-v carries the candidates (coordinates and global ids packed
   in one byte buffer, after a count exchange of one int per peer);
4. each rank finishes the brute-force search over its own points plus the
   candidates and hands its edges, already at their owner, to
   :func:`build_graph`, which keeps their order.

The bounds are certificates, not heuristics, so pruning never changes the
result, only the traffic. Random-ordered points (no compactness) make every
box span the cloud: then every point travels to every rank, as a full ring
would, and memory at each rank is that of the whole cloud's coordinates.
Distances are computed in small blocks either way (``_search.QUERY_ROWS`` x
``_search.CANDIDATE_COLS``), and blocks whose boxes are out of reach are skipped.
"""

from __future__ import annotations

import numbers

import torch

from .. import _mesh_order, collectives
from ..errors import PlacementError
from ..shard_tensor import ShardTensor
from ..split import chunk_sizes
from . import _search
from ._build import build_graph, node_mesh_dim
from ._graph import ShardedGraph

__all__ = ["knn", "radius"]

#: bounding boxes per rank. One box of a space-filling-curve piece is loose (a
#: Hilbert third of a cube spans most of it); 16 boxes of consecutive runs hug
#: the piece, for a gather of ``32 D`` numbers per rank.
BOXES = 16


# --------------------------------------------------------------------------- #
# Input checks (metadata every rank shares: every rank raises alike)
# --------------------------------------------------------------------------- #
def _point_mesh_dim(points, fn: str) -> int:
    """The mesh dim that shards the points' dim 0; raise for any other input."""
    if not isinstance(points, ShardTensor):
        raise TypeError(
            f"{fn}: points must be an (N, D) ShardTensor sharded on dim 0 (e.g. a datapipe's point batch), "
            f"got {type(points).__name__}; wrap each rank's piece with ShardTensor.from_local(..., [Shard(0)])"
        )
    if points.ndim != 2 or points.shape[1] < 1:
        raise PlacementError(f"{fn}: points must have shape (N, D) with D >= 1, got {tuple(points.shape)}")
    if not points.dtype.is_floating_point:
        raise TypeError(f"{fn}: points must have a floating dtype, got {points.dtype}; cast with points.float()")
    return node_mesh_dim(points.spec, f"{fn}: points")


# --------------------------------------------------------------------------- #
# The search (plain tensors in, plain per-rank edges out)
# --------------------------------------------------------------------------- #
def _boxes(local: torch.Tensor, mesh, mesh_dim: int, fn: str):
    """Every rank's ``BOXES`` bounding boxes ``(lo, hi)``, ``(P * BOXES, D)`` each, rank-major.

    Box ``b`` of a rank bounds piece ``b`` of its points split in order by the
    split rule: a run of consecutive points, compact when the points come in
    curve order. An empty piece gets ``lo=+inf, hi=-inf`` (infinitely far).
    Non-finite coordinates on any rank travel as a flag in the same gather, so
    every rank refuses them alike (a NaN has no place in a distance order).
    """
    n, dims = local.shape
    lo = local.new_full((BOXES, dims), torch.inf)
    hi = local.new_full((BOXES, dims), -torch.inf)
    for b, piece in enumerate(local.split(list(chunk_sizes(n, BOXES)))):
        if piece.shape[0]:
            lo[b], hi[b] = piece.amin(0), piece.amax(0)
    bad = local.new_tensor([float(bool(n) and not torch.isfinite(local).all())])
    row = torch.cat([lo.flatten(), hi.flatten(), bad])
    table = collectives.all_gather_v(row[None], [1] * mesh.size(mesh_dim), 0, mesh, mesh_dim)
    if table[:, -1].any():
        ranks = table[:, -1].nonzero().flatten().tolist()
        raise ValueError(f"{fn}: points hold NaN or infinite coordinates (on domain ranks {ranks}); clean them first")
    size = BOXES * dims
    return table[:, :size].reshape(-1, dims), table[:, size : 2 * size].reshape(-1, dims)


def _exchange(local, ids, wanted, mesh, mesh_dim: int):
    """Send rank ``r`` the local points of column ``r`` of ``wanted`` ``(n, P)``; return what arrives, in id order.

    One all-to-all of counts, then one all-to-all-v of packed (coordinates, id)
    rows, counted under the kind ``"neighbour_candidates"`` of
    :func:`physicsnemo_dp.collectives.count_collectives`.
    """
    group, me = mesh.size(mesh_dim), _mesh_order.coordinate(mesh, mesh_dim)
    wanted[:, me] = False
    chosen = [wanted[:, r].nonzero().flatten() for r in range(group)]
    send_counts = [int(c.numel()) for c in chosen]
    recv_counts = collectives.all_to_all_v(
        torch.tensor(send_counts, dtype=torch.int64, device=local.device), [1] * group, [1] * group,
        mesh, mesh_dim, kind="neighbour_counts",
    ).tolist()
    rows = torch.cat(chosen)
    width = local.shape[1] * local.dtype.itemsize
    packed = torch.cat([local[rows].contiguous().view(torch.uint8), ids[rows, None].view(torch.uint8)], 1)
    got = collectives.all_to_all_v(packed, send_counts, recv_counts, mesh, mesh_dim, kind="neighbour_candidates")
    coords = got[:, :width].clone(memory_format=torch.contiguous_format).view(local.dtype)
    cand_ids = got[:, width:].clone(memory_format=torch.contiguous_format).view(torch.int64).flatten()
    return coords, cand_ids


def _search_edges(points, *, k=None, radius=None, cap=None, loop: bool, prune: bool = True):
    """This rank's edges ``(src ids, dst ids, squared distances)``: its queries, nearest first.

    ``k`` set: kNN. ``radius`` set: radius search, at most ``cap`` per query.
    ``prune=False`` sends every point to every rank (the full-exchange
    baseline the benchmark compares against; same result).
    """
    fn = "knn" if k is not None else "radius"
    mesh_dim = _point_mesh_dim(points, fn)
    mesh = points.device_mesh
    local = points._local_tensor.detach()
    group, me = mesh.size(mesh_dim), _mesh_order.coordinate(mesh, mesh_dim)
    sizes = [s[0] for s in points.spec.sharding_shapes(mesh_dim)]
    start = sum(sizes[:me])
    ids = torch.arange(start, start + sizes[me], device=local.device)
    lo, hi = _boxes(local, mesh, mesh_dim, fn)
    gap2 = _search.box_gap2(local, lo, hi)  # (n, P * BOXES): how close each local point comes to each box
    if k is not None:
        best = _search.nearest(local, ids, local, ids, k, loop=loop)
        reach = local.new_full((BOXES,), -torch.inf)  # per box of this rank; an empty box asks for nothing
        if sizes[me]:
            counts = torch.tensor([c for s in sizes for c in chunk_sizes(s, BOXES)], device=local.device)
            owner = torch.arange(group, device=local.device).repeat_interleave(BOXES)
            other = (owner != me) & (counts > 0)
            bound = _search.kth_bound(best[0], local, lo[other], hi[other], counts[other], k)
            piece = torch.arange(BOXES, device=local.device).repeat_interleave(
                torch.tensor(chunk_sizes(sizes[me], BOXES), device=local.device))
            reach = reach.scatter_reduce(0, piece, bound, "amax")
        reach2 = collectives.all_gather_v(reach, [BOXES] * group, 0, mesh, mesh_dim)
        wanted = gap2 <= reach2[None, :]
    else:
        r_t = torch.tensor(radius, dtype=local.dtype, device=local.device)
        wanted = gap2.sqrt() <= r_t  # the criterion the search applies to the points themselves
    wanted = wanted.view(-1, group, BOXES).any(-1)  # near any box of rank r: a candidate for r
    if not prune:
        wanted = torch.ones_like(wanted)
    cand, cand_ids = _exchange(local, ids, wanted, mesh, mesh_dim)
    if k is not None:
        d2, src = _search.nearest(local, ids, cand, cand_ids, k, loop=loop, best=best)
        dst = ids[:, None].expand_as(src)
        return src.flatten(), dst.flatten(), d2.flatten()
    if cap is not None:
        best = _search.nearest(local, ids, local, ids, cap, loop=loop, radius=r_t)
        d2, src = _search.nearest(local, ids, cand, cand_ids, cap, loop=loop, radius=r_t, best=best)
        dst = ids[:, None].expand_as(src)
        keep = torch.isfinite(d2)
        return src[keep], dst[keep], d2[keep]
    rows_a, ids_a, d2_a = _search.within(local, ids, local, ids, r_t, loop=loop)
    rows_b, ids_b, d2_b = _search.within(local, ids, cand, cand_ids, r_t, loop=loop)
    rows, src, d2 = _search.order_pairs(torch.cat([rows_a, rows_b]), torch.cat([ids_a, ids_b]),
                                        torch.cat([d2_a, d2_b]))
    return src, ids[rows], d2


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #
def _graph(points, src, dst, d2) -> tuple[ShardedGraph, ShardTensor]:
    """The edges, already at their destination's owner, as a graph (order kept) and their distances.

    Distances are differentiable w.r.t. ``points`` when it requires grad: they
    are then recomputed through the graph's ghost gather (``points[g.src]``,
    one all-to-all of exactly the ghost rows, whose backward returns the
    gradients to their owners) with the search's formula, so the values are
    the same bits; otherwise they are the search's own, without communication.
    """
    g = build_graph(torch.stack([src, dst]), points, check=False)
    if not (torch.is_grad_enabled() and points.requires_grad):
        return g, ShardTensor.from_spec(d2.sqrt(), g.edge_spec((g.num_edges,), d2.dtype))
    diff = points[g.src] - points[g.dst]
    total = None
    for d in range(points.shape[1]):
        sq = diff[:, d] * diff[:, d]
        total = sq if total is None else total + sq
    positive = total > 0  # sqrt has an infinite slope at 0 (duplicates, self loops): give those a zero gradient
    return g, torch.where(positive, total, 1).sqrt() * positive


def knn(points: ShardTensor, k: int, *, loop: bool = False) -> tuple[ShardedGraph, ShardTensor]:
    """The ``k`` nearest neighbours of every point among all points, as a sharded graph (collective).

    Equal to a brute-force search in one process: for each point ``i``, edges
    ``j -> i`` to its ``k`` nearest points ``j``, nearest first, ties (equal
    distances, duplicate points) broken by the lower global index. Distances
    are ``sqrt`` of the sum over coordinates, in order, of squared differences,
    in the points' dtype: two points at equal distance in that arithmetic are a
    tie, and near-ties are ordered by those exact values, identically on every
    rank and in a single-process search that uses the same formula.

    Args:
        points: ``(N, D)`` floating ShardTensor, sharded on dim 0 over one mesh
            dim (a 1-D mesh, or the ``"domain"`` dim of a 2-D mesh, replicated
            over the others); uneven and empty shards are fine.
        k: Neighbours per point, ``1 <= k <= N - 1`` (``N`` with ``loop``).
        loop: Count each point as its own neighbour (at distance 0).

    Returns:
        ``(graph, distances)``: a :class:`ShardedGraph` for ``points``' layout
        whose rank ``r`` holds the ``k * n_r`` edges into its points, ordered by
        destination, then nearest first (``g.edge_attr`` is None); and the
        distances, an ``(E,)`` ShardTensor aligned with ``g.src`` / ``g.dst``,
        differentiable w.r.t. ``points``.

    Raises:
        TypeError: ``points`` is not a ShardTensor or not floating point.
        PlacementError: ``points`` is not ``(N, D)`` sharded on dim 0.
        ValueError: ``k`` is not an int in range, or a coordinate is NaN or infinite.
    """
    fn = "knn"
    _point_mesh_dim(points, fn)
    n = points.shape[0]
    available = n if loop else n - 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > available:
        raise ValueError(
            f"knn: k={k!r} must be an int in [1, {available}]: there are {n} points"
            + ("" if loop else ", and a point is not its own neighbour unless loop=True")
            + "; lower k" + ("" if loop else " or pass loop=True")
        )
    return _graph(points, *_search_edges(points, k=k, loop=loop))


def radius(points: ShardTensor, r: float, *, max_neighbours: int | None = None,
           loop: bool = False) -> tuple[ShardedGraph, ShardTensor]:
    """Every neighbour within distance ``r`` of every point, as a sharded graph (collective).

    Equal to a brute-force search in one process: for each point ``i``, edges
    ``j -> i`` from every ``j`` with ``distance <= r``, nearest first, ties by
    the lower global index, the first ``max_neighbours`` of them if given.
    Distances and ties are computed as in :func:`knn`; the test is
    ``distance <= r`` with ``r`` rounded to the points' dtype.

    Args:
        points: ``(N, D)`` floating ShardTensor, sharded on dim 0 over one mesh
            dim (as for :func:`knn`).
        r: Search radius, a positive number.
        max_neighbours: Keep at most this many (the nearest) per point; None keeps all.
        loop: Count each point as its own neighbour (at distance 0).

    Returns:
        ``(graph, distances)`` as for :func:`knn`, with a varying number of
        edges per point (possibly none).

    Raises:
        TypeError: ``points`` is not a ShardTensor or not floating point.
        PlacementError: ``points`` is not ``(N, D)`` sharded on dim 0.
        ValueError: ``r`` is not a positive number, ``max_neighbours`` not a
            positive int, or a coordinate is NaN or infinite.
    """
    fn = "radius"
    _point_mesh_dim(points, fn)
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not r > 0:
        raise ValueError(f"radius: r must be a positive number, got {r!r}")
    if max_neighbours is not None and (isinstance(max_neighbours, bool) or not isinstance(max_neighbours, int)
                                       or max_neighbours < 1):
        raise ValueError(f"radius: max_neighbours must be a positive int or None, got {max_neighbours!r}")
    return _graph(points, *_search_edges(points, radius=float(r), cap=max_neighbours, loop=loop))
