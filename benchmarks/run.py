"""Run the benchmark suite and write ``report.json`` and PNG plots.

    python -m benchmarks.run                      # small defaults, this 2-core CPU machine
    python -m benchmarks.run --tiny --out /tmp/b  # what CI runs (seconds)
    python -m benchmarks.run --world-sizes 1 2 4 8 --backend nccl --scale 16   # GPUs

Every figure is a ratio to a baseline measured in the same run: absolute
times on a shared machine are noise.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from physicsnemo_dp import launch

SUITES = ("comm_volume", "dispatch_overhead")


def _rank_body(mesh, suites, scale: float, tiny: bool):
    import importlib

    results = []
    for name in suites:
        module = importlib.import_module(f"benchmarks.{name}")
        kwargs = _sizes(name, scale, tiny)
        results += [r.as_dict() for r in module.run(mesh, **kwargs)]
    return results


def _sizes(suite: str, scale: float, tiny: bool) -> dict:
    if suite == "comm_volume":
        return {"rows": 64, "cols": 8} if tiny else {"rows": int(4096 * scale), "cols": 256}
    if suite == "dispatch_overhead":
        return {"calls": 20, "repeats": 2} if tiny else {"calls": 200, "repeats": 5}
    return {}


def _plot(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for suite in sorted({r["suite"] for r in results}):
        rows = [r for r in results if r["suite"] == suite]
        labels = [f"{r['case']} (P={r['world_size']})" for r in rows]
        ratios = [r["ratio"] if math.isfinite(r["ratio"]) else 0.0 for r in rows]
        colors = ["tab:green" if r["met"] else ("tab:red" if r["met"] is False else "tab:gray") for r in rows]
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
        ax.barh(range(len(rows)), ratios, color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        for bound in {r["target"][1] for r in rows if r["target"]}:
            ax.axvline(bound, color="k", linestyle="--", linewidth=0.8)
        ax.set_xlabel("ratio to same-run baseline (dashed: target)")
        ax.set_title(suite)
        fig.tight_layout()
        path = out / f"{suite}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="physicsnemo_dp benchmark suite")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"), help="report folder")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per rank)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply problem sizes")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes (for CI)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results = []
    for world in args.world_sizes:
        print(f"world size {world} ...", flush=True)
        results += launch(_rank_body, world, args=(args.suites, args.scale, args.tiny), backend=args.backend, echo=False)
    report = {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "backend": args.backend,
            "world_sizes": args.world_sizes,
            "tiny": args.tiny,
            "seconds": round(time.time() - started, 1),
        },
        "results": results,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plots = _plot(results, args.out)
    for r in results:
        flag = {True: "ok  ", False: "MISS", None: "    "}[r["met"]]
        print(f"{flag} {r['suite']:<18} P={r['world_size']} {r['case']:<48} ratio {r['ratio']:.3f}")
    print(f"report: {args.out / 'report.json'}; plots: {', '.join(str(p) for p in plots)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
