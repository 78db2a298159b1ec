"""Mesh preparation: throughput (points/s) and per-rank peak memory on P ranks, and out of core in one.

    python -m benchmarks.mesh_prepare --out outputs/mesh_prepare          # P = 1, 2, 4 and a plot (PNG)
    python -m benchmarks.run --suites mesh_prepare                         # as a suite of the report

Input: :func:`datapipes.synthetic.write_obstacle_vtu`, a ``.pvtu`` of 16
pieces (tetrahedra around a sphere, pressure/velocity point data, a volume
cell field), written once by rank 0 to a temporary directory every rank sees.
Each world size measures, in the same run:

* the single-process in-memory preparation of the input (rank 0, the others
  wait): the baseline of time and memory;
* the preparation on all ``P`` ranks (``group=dist.group.WORLD``): points/s,
  and the largest per-rank peak of traced memory;
* on one rank (P = 1): the out-of-core preparation at a budget of 1/4 of the
  prepared mesh's size.

Peak memory is ``tracemalloc``'s peak during the call above its level at the
call (:func:`benchmarks._memory.traced_peak`): numpy arrays and Python objects
(meshio's parsing included), not the HDF5 library's own buffers nor the page
cache. Tracing stays on once started, so this suite runs last. Files come from the page cache: the figures
measure the software path, not the disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import h5py
import torch.distributed as dist

from ._memory import traced_peak
from ._record import Result, over_ranks

SUITE = "mesh_prepare"


#: the obstacle mesh's pieces repeat the nodes they share, as a solver's .pvtu does
SHARED_NODES = {"allow_duplicate_points": True}


def sizes(tiny: bool, scale: float) -> dict:
    # pieces small enough that the out-of-core budget (1/4 of the mesh) holds the largest one twice
    return dict(points=20_000 if tiny else int(200_000 * scale), pieces=16)


def _mesh_bytes(path) -> int:
    with h5py.File(path) as f:
        sizes = []
        f.visititems(lambda _, obj: sizes.append(obj.nbytes) if isinstance(obj, h5py.Dataset) else None)
    return sum(sizes)


def run(mesh, compare_dtensor: bool = False, *, points: int, pieces: int = 16) -> list[Result]:
    from datapipes import prepare_mesh
    from datapipes.synthetic import write_obstacle_vtu

    import meshio  # noqa: F401  (imported before any timing, on every rank)

    P, rank = dist.get_world_size(), dist.get_rank()
    shared = [None]
    if rank == 0:
        directory = Path(tempfile.mkdtemp(prefix="mesh_prepare-"))
        source = write_obstacle_vtu(directory / "in.pvtu", points, pieces=pieces)
        single = traced_peak(lambda: prepare_mesh(directory / "single.h5", source, **SHARED_NODES))
        shared = [(directory, source, single)]
    dist.broadcast_object_list(shared, src=0)
    directory, source, (single_s, single_peak) = shared[0]
    with h5py.File(directory / "single.h5") as f:
        n = f.attrs["num_points"]
    dist.barrier()
    if P > 1:
        seconds, peak = traced_peak(lambda: prepare_mesh(directory / "dist.h5", source, group=dist.group.WORLD,
                                                         **SHARED_NODES))
        seconds, peak = over_ranks(seconds, "max"), over_ranks(peak, "max")
    else:
        seconds, peak = single_s, single_peak
    results = [
        Result(SUITE, "points/s on P ranks vs 1 process", P, n / seconds, n / single_s, "points/s"),
        Result(SUITE, "per-rank peak memory vs 1 process", P, peak, single_peak, "bytes",
               ("<=", 0.35) if P == 4 else None),
    ]
    if P == 1:
        budget = _mesh_bytes(directory / "single.h5") // 4
        ooc_s, ooc_peak = traced_peak(lambda: prepare_mesh(directory / "ooc.h5", source, max_memory=budget,
                                                           **SHARED_NODES))
        results += [
            Result(SUITE, "out of core (budget 1/4 mesh): peak vs in-memory", 1, ooc_peak, single_peak, "bytes"),
            # below a few MB the budget is dominated by fixed costs (parsers, HDF5 objects): no target there
            Result(SUITE, "out of core (budget 1/4 mesh): peak vs budget", 1, ooc_peak, budget, "bytes",
                   ("<=", 1.0) if budget >= 4 * 2**20 else None),
            Result(SUITE, "out of core (budget 1/4 mesh): time vs in-memory", 1, ooc_s, single_s, "s"),
        ]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return results


def _rank_body(mesh, points: int):
    import torch

    torch.set_num_threads(1)
    return [r.as_dict() for r in run(mesh, points=points)]


def main(argv=None) -> int:
    from physicsnemo_dp import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=200_000, help="points of the synthetic mesh")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path("outputs/mesh_prepare"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for world in args.world_sizes:
        results += launch(_rank_body, world, args=(args.points,), backend="gloo", echo=False)
    (args.out / "mesh_prepare.json").write_text(json.dumps(results, indent=2))
    for r in results:
        print(f"P={r['world_size']} {r['case']:<52} {r['value']:.4g} / {r['baseline']:.4g} {r['unit']} "
              f"= {r['ratio']:.3f} {'' if r['met'] is None else ('ok' if r['met'] else 'MISS')}")
    _plot(results, args.out / "mesh_prepare.png")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = sorted((r["world_size"], r["value"], r["baseline"]) for r in results if r["case"].startswith("points/s"))
    peak = sorted((r["world_size"], r["value"], r["baseline"]) for r in results if r["case"].startswith("per-rank"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot([p for p, *_ in rate], [1 / v * 1e6 for _, v, _ in rate], "o-", label="P ranks (wall time)")
    left.axhline(1 / rate[0][2] * 1e6, color="k", linestyle="--", linewidth=0.8, label="1 process, in memory")
    left.set(xlabel="ranks P", ylabel="seconds per million points", title="preparation cost")
    right.plot([p for p, *_ in peak], [v / 2**20 for _, v, _ in peak], "o-", label="largest rank peak")
    right.plot([p for p, *_ in peak], [b / p / 2**20 for p, _, b in peak], ":", label="1 process / P")
    right.set(xlabel="ranks P", ylabel="MiB (tracemalloc)", title="per-rank peak memory")
    for ax in (left, right):
        ax.set_xticks([p for p, *_ in rate])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
