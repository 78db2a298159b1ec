"""Run the benchmark suite and write ``report.json`` and one PNG plot per suite.

    python -m benchmarks.run                      # defaults for this 2-core CPU machine (a few minutes)
    python -m benchmarks.run --tiny --out /tmp/b  # what CI runs (seconds of benchmarking)
    python -m benchmarks.run --compare-dtensor    # also DTensor, side by side, where it can (even shards)
    python -m benchmarks.run --world-sizes 1 2 4 8 --backend nccl --scale 4   # GPUs

Ranks are started with :func:`physicsnemo_dp.launch`, once per world size; every
suite module (``SUITES``) runs on every rank. Every figure is a ratio to a
baseline measured in the same run: absolute times on a shared machine are
noise. A timed figure is the median ratio of three interleaved repetitions,
printed and stored with its spread (see ``benchmarks/_timing.py``). See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import resource
import time
from pathlib import Path

import torch

from benchmarks import table
from benchmarks._record import over_ranks
from physicsnemo_dp import launch

SUITES = ("comm_volume", "dispatch_overhead", "memory_scaling", "throughput_scaling", "io_throughput",
          "scaling_curves", "graph", "graph_search", "third_party", "overlap", "compiled", "mesh_prepare")
#: Left out of ``--tiny``'s default suites: ``compiled`` spends minutes compiling on every rank, however tiny the
#: model (tests/benchmarks/test_compiled.py runs it at tiny sizes on its own). ``--suites compiled`` runs it.
NOT_TINY = ("compiled",)


def _rank_body(mesh, suites, scale: float, tiny: bool, compare_dtensor: bool):
    """Every suite on this rank. A suite module has ``sizes(tiny, scale) -> dict`` and
    ``run(mesh, compare_dtensor=..., **sizes) -> list[Result]`` (identical on every rank)."""
    torch.set_num_threads(1)  # ranks share the cores; one thread each keeps them from fighting
    results, seconds = [], {}
    for name in sorted(suites, key=SUITES.index):  # in SUITES order: mesh_prepare leaves tracemalloc on, so last
        module = importlib.import_module(f"benchmarks.{name}")
        kwargs = module.sizes(tiny, scale)
        start = time.time()
        results += [r.as_dict() for r in module.run(mesh, compare_dtensor=compare_dtensor, **kwargs)]
        seconds[name] = round(time.time() - start, 1)
    # CPU time of all ranks (and their finished reader processes): with the wall
    # time, an estimate of how long the run takes on an idle machine
    used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds["cpu, all ranks"] = round(over_ranks(sum(u.ru_utime + u.ru_stime for u in used)), 1)
    return results, seconds


def _plot(results: list[dict], out: Path) -> list[Path]:
    """A bar chart of ratios per suite; the scaling curves draw their own (efficiency vs local size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import scaling_curves

    paths = scaling_curves.plot(results, out)
    for suite in sorted({r["suite"] for r in results} - {scaling_curves.SUITE}):
        order = {c: i for i, c in enumerate(dict.fromkeys(r["case"] for r in results))}
        rows = sorted((r for r in results if r["suite"] == suite), key=lambda r: (order[r["case"]], r["world_size"]))
        labels = [f"{r['case']} (P={r['world_size']})" for r in rows]
        ratios = [r["ratio"] if math.isfinite(r["ratio"]) else 0.0 for r in rows]
        positive = [x for x in ratios if x > 0]
        log = bool(positive) and max(positive) / min(positive) > 20  # dispatch and CPU timings span decades
        colors = ["tab:green" if r["met"] else ("tab:red" if r["met"] is False else "tab:gray") for r in rows]
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(rows) + 1.5))
        ax.barh(range(len(rows)), ratios, color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        for bound in {r["target"][1] for r in rows if r["target"]}:
            ax.axvline(bound, color="k", linestyle="--", linewidth=0.8)
        if log:
            ax.set_xscale("log")
        ax.set_xlabel("ratio to the same-run baseline\n(dashed: target; green met, red missed, grey no target)")
        ax.set_title(suite)
        fig.tight_layout()
        path = out / f"{suite}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _spread(result: dict) -> str:
    """`` [min-max of N]`` of a timed figure's per-repetition ratios (its ratio is their median); empty for counts."""
    if not result.get("spread"):
        return ""
    low, high = result["spread"]
    return f" [{low:.3f}-{high:.3f} of {result['repetitions']}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="physicsnemo_dp benchmark suite")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"), help="report folder")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--suites", nargs="+", default=None, choices=SUITES,
                        help=f"default: all ({', '.join(NOT_TINY)} not with --tiny)")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per rank)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply problem sizes")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes (for CI)")
    parser.add_argument("--compare-dtensor", action="store_true",
                        help="also measure DTensor on the cases it supports (even shards), side by side")
    args = parser.parse_args(argv)
    if args.suites is None:
        args.suites = [s for s in SUITES if not (args.tiny and s in NOT_TINY)]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results, seconds = [], {}
    for world in args.world_sizes:
        print(f"world size {world} ...", flush=True)
        launched = time.time()
        mine, per_suite = launch(_rank_body, world, args=(args.suites, args.scale, args.tiny, args.compare_dtensor),
                                 backend=args.backend, echo=False)  # fmt: skip
        results += mine
        seconds[world] = {"total": round(time.time() - launched, 1), **per_suite}
    report = {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "backend": args.backend,
            "world_sizes": args.world_sizes,
            "tiny": args.tiny,
            "compare_dtensor": args.compare_dtensor,
            "scale": args.scale,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),  # other jobs on the machine, at the end of the run
            "seconds": round(time.time() - started, 1),
            "seconds_per_world_size": seconds,
        },
        "results": results,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "table.md").write_text(table.markdown(report))
    plots = _plot(results, args.out)
    if "graph" in args.suites:  # ghost-node fraction vs P of the SFC partition: counted in this process, no ranks
        from benchmarks import graph

        plots += graph.plots(args.out, args.tiny, args.scale)
    for r in results:
        flag = {True: "ok  ", False: "MISS", None: "    "}[r["met"]]
        size = "" if r.get("local_size") is None else f" (local {r['local_size']})"
        print(f"{flag} {r['suite']:<18} P={r['world_size']} {r['case'] + size:<48} ratio {r['ratio']:.3f}{_spread(r)}")
    print(f"report: {args.out / 'report.json'}; plots: {', '.join(str(p) for p in plots)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
