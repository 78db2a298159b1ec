"""Neighbour search on SFC-partitioned point clouds: pruning ratio and time against a full exchange.

The clouds are ``datapipes.synthetic.point_cloud`` (a torus surface and a cube
volume), sorted along a Hilbert curve as ``datapipes.prepare_mesh`` would, each
rank owning a contiguous range (``balanced_sizes``, as ``MeshSource`` reads it).
Per cloud and search (``knn`` with ``k`` neighbours, ``radius`` with ``r`` set
for about ``k`` neighbours per point) two figures:

* **points exchanged / full ring** (no target; the smaller the better):
  candidate points arriving at all ranks (``count_collectives``, kind
  ``"neighbour_candidates"``, divided by the bytes of one packed point) over
  ``(P - 1) * N``, what a ring over all ranks (or an all-gather) moves.
* **search time / unpruned search** (no target): wall time of the search
  behind ``knn`` / ``radius`` over the same search with pruning off (every
  point sent to every rank, the same kernels: what a ring would compute),
  median of repetitions of interleaved runs, slowest rank.

Nothing moves on one rank, so the suite starts at P = 2.
"""

from __future__ import annotations

import math
import time

import torch

from datapipes import balanced_sizes
from datapipes.sfc import curve_order
from datapipes.synthetic import point_cloud
from physicsnemo_dp import Shard, ShardTensor, count_collectives
from physicsnemo_dp.collectives import mesh_device
from physicsnemo_dp.graph import knn, radius
from physicsnemo_dp.graph.neighbours import _search_edges

from ._record import Result, over_ranks
from ._timing import fastest

SUITE = "graph_search"
TORUS_AREA = 4 * math.pi**2 * 1.0 * 0.4  # datapipes' torus: major radius 1, minor 0.4


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(points=1500, k=8, rounds=1)
    return dict(points=int(12000 * scale), k=16, rounds=3)


def _points(mesh, kind: str, n: int) -> ShardTensor:
    """The cloud in Hilbert order, this rank's contiguous range of it (float32, as the datapipe reads it)."""
    pts = point_cloud(n, kind=kind, seed=0).points
    pts = torch.from_numpy(pts[curve_order(pts, "hilbert")].copy()).to(mesh_device(mesh))
    shares = balanced_sizes(pts.shape[0], mesh.size())
    start = sum(shares[: mesh.get_local_rank()])
    local = pts[start : start + shares[mesh.get_local_rank()]]
    return ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes={0: [(s, 3) for s in shares]})


def _radius_for(kind: str, n: int, k: int) -> float:
    """A radius holding about ``k`` neighbours per point on average."""
    if kind == "surface":
        return math.sqrt(k * TORUS_AREA / (math.pi * n))
    return (3 * k / (4 * math.pi * n)) ** (1 / 3)


def run(mesh, points: int, k: int, rounds: int, compare_dtensor: bool = False) -> list[Result]:
    P = mesh.size()
    if P == 1:
        return []
    results = []
    for kind in ("surface", "volume"):
        x = _points(mesh, kind, points)
        n, row = x.shape[0], 3 * x.dtype.itemsize + 8  # one candidate: coordinates and an int64 id
        r = _radius_for(kind, n, k)
        searches = {
            f"knn k={k}": (lambda: knn(x, k), dict(k=k)),
            f"radius (~{k} neighbours)": (lambda: radius(x, r), dict(radius=r)),
        }
        for name, (search, params) in searches.items():
            with count_collectives() as counted:
                search()
            moved = over_ranks(counted.bytes_received["neighbour_candidates"] / row)
            results.append(Result(SUITE, f"{kind} {name}: points exchanged / full ring", P, moved, (P - 1) * n,
                                  "points"))
            # the search alone on both sides (the graph built from its edges costs the same either way)
            best = fastest({"pruned": lambda p=params: _search_edges(x, loop=False, **p),
                            "full": lambda p=params: _search_edges(x, loop=False, prune=False, **p)},
                           rounds, clock=time.perf_counter)
            t = {key: over_ranks(seconds, "max") for key, seconds in best.items()}
            results.append(Result(SUITE, f"{kind} {name}: search time / unpruned", P, t["pruned"], t["full"], "s"))
    return results
