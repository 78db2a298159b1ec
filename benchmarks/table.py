"""The report as a Markdown table: one row per figure, one column per world size.

    python -m benchmarks.table outputs/benchmarks/report.json > table.md

``benchmarks.run`` writes the same table as ``table.md`` beside ``report.json``;
the "Figures on this machine" table of ``benchmarks/README.md`` is pasted from
it, so the README's numbers come from one run and say which. A ratio that
misses its target is in bold; one that rounds to its bound gets a third decimal. A timed
figure is the median of interleaved repetitions, followed by the range of the
repetitions' ratios in parentheses (see ``benchmarks/_timing.py``). Points of a scaling curve (figures with a local
size) are left out: their plots show them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cell(result: dict | None) -> str:
    if result is None:
        return "–"
    text = f"{result['ratio']:.2f}"
    if result["target"] and float(text) == result["target"][1]:  # 1.201 against <= 1.2: show which side
        text = f"{result['ratio']:.3f}"
    text = f"**{text}**" if result["met"] is False else text
    if result.get("spread"):  # a timing: the median of repetitions, then their range
        low, high = result["spread"]
        text += f" ({low:.2f}–{high:.2f})"
    return text


def markdown(report: dict) -> str:
    """The table of ``report`` (the dict ``report.json`` holds), with a line naming the run."""
    meta, results = report["meta"], [r for r in report["results"] if r.get("local_size") is None]
    worlds = list(meta["world_sizes"])
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for r in results:
        rows.setdefault((r["suite"], r["case"]), {})[r["world_size"]] = r
    load = ", ".join(f"{x:.1f}" for x in meta.get("load_average", ()))
    sizes = ", tiny sizes" if meta["tiny"] else ""
    if meta.get("scale", 1) != 1:
        sizes += f", scale {meta['scale']:g}"
    lines = [
        f"torch {meta['torch']}, backend {meta['backend']}, {meta['cpus']} CPUs, world sizes "
        f"{' '.join(map(str, worlds))}{sizes}; {meta['seconds']:.0f} s; load average at the end {load}. "
        "Bold: the target is missed. Timings: the median of interleaved repetitions (their range in parentheses).",
        "",
        "| suite | figure | target | " + " | ".join(f"P={w}" for w in worlds) + " |",
        "|---|---|---|" + "---|" * len(worlds),
    ]
    for (suite, case), by_world in rows.items():
        target = next((r["target"] for r in by_world.values() if r["target"]), None)
        bound = f"{target[0]} {target[1]:g}" if target else ""
        cells = " | ".join(_cell(by_world.get(w)) for w in worlds)
        lines.append(f"| {suite} | {case.replace('|', '/')} | {bound} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[0] + "\nusage: python -m benchmarks.table REPORT.json", file=sys.stderr)
        return 2
    print(markdown(json.loads(Path(args[0]).read_text())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
