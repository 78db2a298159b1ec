"""kNN and radius search on point-sharded clouds against a brute-force search in one process.

The reference sorts every row of the full distance matrix by (distance, global id) and
computes distances by the formula the library documents (sum over coordinates, in order,
of squared differences in the points' dtype), so the comparison is exact: the same
neighbour ids in the same order and the same distance bits.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.collectives import count_collectives
from physicsnemo_dp.errors import PlacementError
from physicsnemo_dp.graph import _search, knn, neighbours, radius
from tests._harness import distributed, run_job


# --------------------------------------------------------------------------- #
# Reference and data
# --------------------------------------------------------------------------- #
def _brute(full: torch.Tensor, *, k=None, radius=None, cap=None, loop=False):
    """Per point i: (ids, squared distances) of its neighbours, nearest first, ties by id."""
    n = full.shape[0]
    d2 = torch.zeros(n, n, dtype=full.dtype)
    for d in range(full.shape[1]):
        diff = full[:, None, d] - full[None, :, d]
        d2 = d2 + diff * diff
    if not loop:
        d2.fill_diagonal_(torch.inf)
    order = torch.sort(d2, dim=1, stable=True).indices  # columns are ids: a stable sort breaks ties by id
    out = []
    for i in range(n):
        ids, dist2 = order[i], d2[i, order[i]]
        if k is not None:
            ids, dist2 = ids[:k], dist2[:k]
        else:
            keep = dist2.sqrt() <= torch.tensor(radius, dtype=full.dtype)
            ids, dist2 = ids[keep][:cap], dist2[keep][:cap]
        out.append((ids, dist2))
    return out


def _cloud(kind: str, n: int, dims: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind in ("surface", "volume"):  # datapipes' synthetic clouds, as meshers emit them (random order)
        from datapipes.synthetic import point_cloud

        pts = torch.from_numpy(point_cloud(n, kind=kind, seed=seed).points)[:, :dims]
    elif kind == "sfc":  # the same cloud in the datapipe's space-filling-curve order
        from datapipes.sfc import curve_order
        from datapipes.synthetic import point_cloud

        pts = point_cloud(n, kind="volume", seed=seed).points[:, :dims]
        pts = torch.from_numpy(np.ascontiguousarray(pts[curve_order(pts)]))
    elif kind == "grid":  # integer coordinates: many exact ties and duplicate points
        pts = torch.randint(0, 3, (n, dims), generator=g).to(dtype)
    elif kind == "clusters":  # tight clusters far apart
        centres = torch.rand(4, dims, generator=g, dtype=torch.float64) * 100
        pts = centres[torch.randint(0, 4, (n,), generator=g)] + 1e-3 * torch.randn(n, dims, generator=g,
                                                                                 dtype=torch.float64)
    else:
        pts = torch.rand(n, dims, generator=g, dtype=torch.float64)
    return pts.to(dtype).contiguous()


def _sharded(ctx, full: torch.Tensor, sizes) -> ShardTensor:
    """``full`` split along dim 0 by ``sizes`` over the ``domain`` mesh dim (replicated over ``ddp``)."""
    mesh_dim = ctx.mesh.ndim - 1
    me = ctx.mesh.get_local_rank(mesh_dim)
    start = sum(sizes[:me])
    placements = [Replicate()] * (ctx.mesh.ndim - 1) + [Shard(0)]
    return ShardTensor.from_local(full[start : start + sizes[me]].clone(), ctx.mesh, placements,
                                  sharding_shapes={mesh_dim: [(s, full.shape[1]) for s in sizes]})


def _sizes(ctx, n: int, uneven: bool):
    p = ctx.mesh.size(ctx.mesh.ndim - 1)
    if not uneven or p == 1:
        base = [n // p] * p
        base[-1] += n - sum(base)
        return base
    weights = [1 + 2 * i for i in range(p)][::-1]  # rank 0 largest, last rank small
    sizes = [n * w // sum(weights) for w in weights]
    sizes[0] += n - sum(sizes)
    if p >= 3:  # one empty rank in the middle
        sizes[0] += sizes[1]
        sizes[1] = 0
    return sizes


@contextlib.contextmanager
def _small_blocks(rows=8, cols=16):
    """Tiny distance blocks, so small clouds take the many-block paths (merging, skipping far blocks)."""
    saved = _search.QUERY_ROWS, _search.CANDIDATE_COLS
    _search.QUERY_ROWS, _search.CANDIDATE_COLS = rows, cols
    try:
        yield
    finally:
        _search.QUERY_ROWS, _search.CANDIDATE_COLS = saved


def _check_rank(points, full, *, k=None, radius=None, cap=None, loop=False, prune=True, small=True):
    """This rank's search equals its slice of the brute-force result; returns the edges found."""
    with _small_blocks() if small else contextlib.nullcontext():
        src, dst, d2 = neighbours._search_edges(points, k=k, radius=radius, cap=cap, loop=loop, prune=prune)
    ref = _brute(full, k=k, radius=radius, cap=cap, loop=loop)
    mesh_dim = points.device_mesh.ndim - 1
    start = points.spec.offsets(mesh_dim)
    n = points.spec.local_shape[0]
    want_src = torch.cat([ref[i][0] for i in range(start, start + n)]) if n else src.new_zeros(0)
    want_d2 = torch.cat([ref[i][1] for i in range(start, start + n)]) if n else d2.new_zeros(0)
    want_dst = torch.cat([torch.full((len(ref[i][0]),), i) for i in range(start, start + n)]) if n else dst.new_zeros(0)
    assert torch.equal(dst, want_dst)
    assert torch.equal(src, want_src), (src.tolist(), want_src.tolist())
    assert torch.equal(d2, want_d2)
    return src, dst, d2


# --------------------------------------------------------------------------- #
# Exact equality with brute force
# --------------------------------------------------------------------------- #
CASES = [  # (cloud, n, dims, uneven)
    ("sfc", 300, 3, True),
    ("surface", 240, 3, False),  # random order: no compactness at all
    ("grid", 90, 2, True),  # duplicates and ties
    ("clusters", 120, 3, True),
]


@pytest.mark.parametrize("cloud,n,dims,uneven", CASES)
@distributed
def test_knn_equals_brute_force(ctx, cloud, n, dims, uneven):
    full = _cloud(cloud, n, dims, seed=1)
    points = _sharded(ctx, full, _sizes(ctx, full.shape[0], uneven))
    for k, loop in ((1, False), (7, False), (5, True)):
        _check_rank(points, full, k=k, loop=loop)
    _check_rank(points, full, k=7, small=False)


@pytest.mark.parametrize("cloud,n,dims,uneven", CASES)
@distributed
def test_radius_equals_brute_force(ctx, cloud, n, dims, uneven):
    full = _cloud(cloud, n, dims, seed=2)
    points = _sharded(ctx, full, _sizes(ctx, full.shape[0], uneven))
    r = {"grid": 1.0, "clusters": 2e-3}.get(cloud, 0.15)  # grid: exactly on the boundary for axis neighbours
    for cap, loop in ((None, False), (4, False), (None, True), (3, True)):
        _check_rank(points, full, radius=r, cap=cap, loop=loop)
    _check_rank(points, full, radius=r, small=False)


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_ranks_with_fewer_than_k_points(ctx):
    p = ctx.world_size
    sizes = [40] + [1] * (p - 1)  # every other rank holds a single point
    full = _cloud("sfc", sum(sizes), 3, seed=3)
    points = _sharded(ctx, full, sizes)
    _check_rank(points, full, k=6)
    empty = [0] * (p - 1) + [sum(sizes)]  # everything on the last rank
    _check_rank(_sharded(ctx, full, empty), full, k=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@distributed(world_sizes=(3,), mesh_2d=False)
def test_low_precision_and_unpruned_baseline_agree(ctx, dtype):
    full = _cloud("sfc", 600, 3, seed=4, dtype=dtype)
    points = _sharded(ctx, full, _sizes(ctx, 600, False))
    with count_collectives() as pruned:
        a = _check_rank(points, full, k=5)
    with count_collectives() as ring:
        b = _check_rank(points, full, k=5, prune=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    row = 3 * dtype.itemsize + 8  # coordinates and id of one point
    assert ring.bytes_received["neighbour_candidates"] == (600 - 200) * row  # every other rank's points
    moved = torch.tensor([pruned.bytes_received["neighbour_candidates"] / row])
    dist.all_reduce(moved)
    assert moved.item() < 0.5 * 2 * 600  # SFC compactness: far less than the (P-1) N a full exchange moves


# --------------------------------------------------------------------------- #
# The graph and differentiable distances
# --------------------------------------------------------------------------- #
def _reference_edges(full, **search):
    ref = _brute(full, **search)
    src = torch.cat([ids for ids, _ in ref])
    dst = torch.cat([torch.full((len(ids),), i) for i, (ids, _) in enumerate(ref)])
    return src, dst, torch.cat([d2 for _, d2 in ref])


def _safe_distance(a, b):
    total = torch.zeros(a.shape[0], dtype=a.dtype)
    for d in range(a.shape[1]):
        diff = a[:, d] - b[:, d]
        total = total + diff * diff
    return torch.where(total > 0, total, 1).sqrt() * (total > 0)


@pytest.mark.parametrize("kind", ["knn", "radius"])
@distributed
def test_graph_and_distance_gradients_equal_one_process(ctx, kind):
    full = _cloud("grid" if kind == "radius" else "sfc", 120, 3, seed=5)  # grid: duplicates at distance 0
    sizes = _sizes(ctx, full.shape[0], True)
    search = dict(k=5) if kind == "knn" else dict(radius=1.0, cap=6, loop=True)  # loop: self edges at 0
    src, dst, d2 = _reference_edges(full, **search)
    points = _sharded(ctx, full, sizes)
    with torch.no_grad():
        g0, dist0 = knn(points, 5) if kind == "knn" else radius(points, 1.0, max_neighbours=6, loop=True)
    points.requires_grad_(True)
    g, dist = knn(points, 5) if kind == "knn" else radius(points, 1.0, max_neighbours=6, loop=True)

    me = ctx.mesh.get_local_rank(ctx.mesh.ndim - 1)
    start = sum(sizes[:me])
    mine = (dst >= start) & (dst < start + sizes[me])
    assert g.num_nodes == full.shape[0] and g.edge_sizes == g0.edge_sizes
    assert g.num_edges == src.numel() and g.edge_sizes[me] == int(mine.sum())
    assert torch.equal(g.src.to_local(), src[mine]) and torch.equal(g.dst.to_local(), dst[mine])
    assert torch.equal(g.edge_index.to_local(), torch.stack([src[mine], dst[mine]]))
    assert g.edge_attr is None
    assert torch.equal(dist0.to_local(), d2[mine].sqrt())  # the search's own distances
    assert torch.equal(dist.to_local(), d2[mine].sqrt())  # recomputed through the ghost gather: same bits
    assert dist.placements == g.src.placements

    w = torch.randn(src.numel(), generator=torch.Generator().manual_seed(6), dtype=full.dtype)
    (dist * ShardTensor.from_spec(w[mine].clone(), dist.spec)).sum().backward()
    ref = full.clone().requires_grad_(True)
    (_safe_distance(ref[src], ref[dst]) * w).sum().backward()
    grad = points.grad.full_tensor()
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, ref.grad, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- #
# Bad input: the same clear error on every rank, and the ranks stay in step
# --------------------------------------------------------------------------- #
@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_bad_input_raises_on_every_rank(ctx):
    full = _cloud("uniform", 10, 2, seed=7)
    sizes = _sizes(ctx, 10, True)
    points = _sharded(ctx, full, sizes)
    with pytest.raises(ValueError, match=r"k=10 must be an int in \[1, 9\].*loop=True"):
        knn(points, 10)
    with pytest.raises(ValueError, match=r"k=11 must be an int in \[1, 10\]"):
        knn(points, 11, loop=True)
    for k in (0, 2.5, True):
        with pytest.raises(ValueError, match="k="):
            knn(points, k)
    for r in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="r must be a positive number"):
            radius(points, r)
    with pytest.raises(ValueError, match="max_neighbours must be a positive int"):
        radius(points, 0.5, max_neighbours=0)
    with pytest.raises(TypeError, match="floating dtype"):
        knn(_sharded(ctx, full.long(), sizes), 2)
    with pytest.raises(TypeError, match="must be an \\(N, D\\) ShardTensor"):
        knn(full, 2)
    with pytest.raises(PlacementError, match=r"shape \(N, D\)"):
        knn(points[:, 0], 2)
    replicated = points.redistribute(placements=[Replicate()] * ctx.mesh.ndim)
    with pytest.raises(PlacementError, match="knn: points must be node-sharded"):
        knn(replicated, 2)
    bad = full.clone()
    bad[-1, 0] = float("nan")  # on one rank only (the last non-empty one)
    with pytest.raises(ValueError, match="NaN or infinite coordinates"):
        radius(_sharded(ctx, bad, sizes), 0.5)
    _check_rank(points, full, k=3)  # every rank took the same collectives: still in step


# --------------------------------------------------------------------------- #
# Random clouds (hypothesis draws in the test process, ranks run the case)
# --------------------------------------------------------------------------- #
def _random_case(ctx, n, dims, seed, sizes, k, radius, cap, loop, sfc):
    full = _cloud("grid" if seed % 3 == 0 else "uniform", n, dims, seed)
    if sfc:
        from datapipes.sfc import curve_order

        full = full[torch.from_numpy(curve_order(full.numpy()))].contiguous()
    points = _sharded(ctx, full, sizes)
    if k is not None:
        _check_rank(points, full, k=k, loop=loop)
    else:
        _check_rank(points, full, radius=radius, cap=cap, loop=loop)


@st.composite
def _cases(draw):
    world = draw(st.sampled_from([1, 2, 3, 4]))
    n = draw(st.integers(2, 40))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    loop = draw(st.booleans())
    if draw(st.booleans()):
        k, radius, cap = draw(st.integers(1, n if loop else n - 1)), None, None
    else:
        k, radius, cap = None, draw(st.sampled_from([0.1, 0.3, 1.0, 2.0])), draw(st.sampled_from([None, 1, 3]))
    return world, dict(n=n, dims=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)), sizes=sizes, k=k,
                       radius=radius, cap=cap, loop=loop, sfc=draw(st.booleans()))


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(_cases())
def test_random_clouds(case):
    world, params = case
    run_job(world, (world,), __name__, "_random_case", params)
