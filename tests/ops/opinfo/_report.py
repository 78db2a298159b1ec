"""Test-process side of the OpInfo sweep: run jobs, survive hangs, combine the ranks' outcomes, judge them
against the expected-failure list, and write the coverage table (``docs/op_coverage.md``).

Outcome of an op on a layout, worst first over its samples (at most 8, those with a primary tensor):

=============  ==========================================================================================
``hang``       a rank did not finish (the job's deadline, or a rank died): must be zero
``crash``      every rank raised outside a sample's run (the sweep's own code): must be zero
``divergent``  ranks disagree: one raised and another did not, or they raised different messages
``wrong``      it ran on every rank and an output or gradient differs from one process (silently wrong)
``error``      every rank raised the same exception (a clear error)
``pass``       every output and every gradient equal to one process's
``not run``    no sample with a primary tensor of at least one dim, or only random samples
=============  ==========================================================================================
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import runpy
import tempfile

from tests._harness import run_job

from ._sweep import LAYOUTS

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[2]
RESULTS = HERE / "results"
DOC = ROOT / "docs" / "op_coverage.md"
SEVERITY = ["hang", "crash", "divergent", "wrong", "error", "pass", "not run"]


def sweep(
    layout: str,
    names,
    *,
    batch: int = 40,
    timeout: float = 600.0,
    max_samples: int | None = None,
    target: str | None = None,
    sample_deadline: float | None = None,
) -> dict:
    """``{op: {"status", "detail", "samples", ...}}`` of ``names`` on ``layout``, in jobs of ``batch`` ops.

    A job that fails (a hang caught by its ``timeout``, a dead rank, or diverged outcomes) leaves the
    ranks' progress files: the op in progress is recorded as ``hang`` or ``divergent`` and the sweep
    resumes after it on a fresh pool.
    """
    world, mesh_shape, _ = LAYOUTS[layout]
    failures: dict[str, str] = {}
    params = {} if max_samples is None else {"max_samples": max_samples}
    if target is not None:  # "dtensor": the side-by-side run (see _sweep.run_sample)
        params.update(target=target, sample_deadline=sample_deadline)
    with tempfile.TemporaryDirectory(prefix="pdp-opinfo-") as progress:
        todo = list(names)
        while todo:
            chunk, todo = todo[:batch], todo[batch:]
            while chunk:
                before = _started(progress)
                try:
                    run_job(
                        world,
                        mesh_shape,
                        "tests.ops.opinfo._sweep",
                        "run_ops",
                        dict(names=chunk, layout=layout, progress_dir=progress, **params),
                        timeout=timeout,
                    )
                    chunk = []
                except AssertionError as failure:
                    report = str(failure)
                    records = _records(progress)
                    started = [op for op in _started(progress) if op not in before]
                    if not started:
                        raise  # nothing ran: the job itself is broken (an import, the pool)
                    op = _unfinished(records, started) or started[-1]
                    diverged = [r for rs in records.values() for r in rs if r.get("op") == op and "diverged" in r]
                    late = [k for k, rs in records.items() if any(r.get("op") == op and "deadline" in r for r in rs)]
                    failures[op] = (
                        ("divergent: outcomes per rank " + str(diverged[0]["diverged"]))[:400]
                        if diverged
                        else f"hang: rank {late[0]} past the {sample_deadline:g} s sample deadline; "
                        + report.strip().splitlines()[0][:200]
                        if late  # it left: its peers may have raised "Connection closed by peer"
                        else ("hang: " if _unfinished_ranks(report) else "crash: ")
                        + report.strip().splitlines()[0][:300]
                    )
                    chunk = chunk[chunk.index(op) + 1 :]
        return combine(names, _records(progress), failures)


def _unfinished_ranks(report: str) -> bool:
    """Whether the harness's report says a rank did not finish or died (else every rank raised)."""
    first = report.strip().splitlines()[0] if report.strip() else ""
    return "did not finish" in report or "died" in first or "raised" not in first


def _files(progress):
    return sorted(pathlib.Path(progress).glob("rank*.jsonl"))


def _records(progress) -> dict[int, list[dict]]:
    out = {}
    for f in _files(progress):
        rank = int(f.stem[4:])
        out[rank] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _started(progress) -> list[str]:
    seen = []
    for rs in _records(progress).values():
        for r in rs:
            if r.get("start") and r["op"] not in seen:
                seen.append(r["op"])
    return seen


def _unfinished(records, started) -> str | None:
    for op in started:
        for rs in records.values():
            if not any(r.get("op") == op and r.get("done") for r in rs):
                return op
    return None


def combine(names, records: dict[int, list[dict]], failures: dict[str, str]) -> dict:
    """Per op, the worst outcome over its samples, each sample judged over every rank."""
    per_sample: dict[tuple, dict[int, dict]] = collections.defaultdict(dict)
    for rank, rs in records.items():
        for r in rs:
            if "status" in r and r.get("sample", -1) >= 0:
                per_sample[(r["op"], r["sample"])][rank] = r
    ranks = sorted(records)
    result = {}
    for op in names:
        samples = sorted(i for (o, i) in per_sample if o == op)
        entry = {"status": "not run", "detail": "", "samples": 0}
        judged = []
        for i in samples:
            by_rank = per_sample[(op, i)]
            judged.append((i, *_judge(by_rank, ranks)))
        run = [j for j in judged if j[1] != "skip"]
        entry["samples"] = len(run)
        entry["seconds"] = round(
            max(
                (
                    sum(
                        r.get("t", 0)
                        for (o, _), by in per_sample.items()
                        if o == op
                        for rr, r in by.items()
                        if rr == rank
                    )
                    for rank in ranks
                ),
                default=0,
            ),
            3,
        )
        if op in failures:
            status = failures[op].split(":")[0]
            entry.update(status=status, detail=failures[op])
        elif run:
            i, status, detail, err, what = min(run, key=lambda j: SEVERITY.index(j[1]))
            entry.update(status=status, detail=detail, sample=i, sample_repr=what)
            if status == "wrong":
                entry["err"] = err
            if status == "pass":
                entry["detail"] = ""
        elif judged:
            entry["detail"] = judged[0][2]
        result[op] = entry
    return result


def _judge(by_rank: dict[int, dict], ranks) -> tuple[str, str, float, str]:
    """``(status, detail, max error, sample description)`` of one sample over the ranks."""
    outs = [by_rank.get(r) for r in ranks]
    if any(o is None for o in outs):
        return "hang", "a rank did not report this sample", float("nan"), ""
    what = next((o.get("sample_repr", "") for o in outs if o.get("sample_repr")), "")
    kinds = {o["status"] for o in outs}
    if kinds == {"skip"}:
        return "skip", outs[0]["detail"], float("nan"), what
    if "wrong" in kinds:
        worst = max((o for o in outs if o["status"] == "wrong"), key=lambda o: _num(o.get("err")))
        return "wrong", worst["detail"], _num(worst.get("err")), what
    if kinds == {"pass"}:
        return "pass", "", float("nan"), what
    if kinds == {"error"}:
        messages = {o["detail"] for o in outs}
        if len(messages) == 1:
            return "error", outs[0]["detail"], float("nan"), what
        return (
            "divergent",
            "different errors per rank: " + " | ".join(f"rank {r}: {o['detail']}" for r, o in zip(ranks, outs)),
            float("nan"),
            what,
        )
    return (
        "divergent",
        "per rank: " + " | ".join(f"rank {r}: {o['status']} {o['detail']}" for r, o in zip(ranks, outs)),
        float("nan"),
        what,
    )


def _num(x) -> float:
    return float("nan") if x is None else float(x)


def problems(layout: str, results: dict, errors: dict, wrong: dict) -> list[str]:
    """What breaks the rule "the expected-failure list may only shrink" on ``layout``."""
    expected_errors, expected_wrong = errors.get(layout, {}), wrong.get(layout, {})
    out = []
    for op, r in results.items():
        status, listed = r["status"], expected_errors.get(op) or expected_wrong.get(op)
        where = f"{op} on {layout}"
        if status in ("pass", "not run"):
            if listed and status == "pass":
                out.append(f"{where} now passes: remove its entry from tests/ops/opinfo/_expected.py")
        elif status == "error":
            if op not in expected_errors:
                out.append(
                    f"{where} raises (not in the expected list): {r['detail']} [sample {r.get('sample')}: "
                    f"{r.get('sample_repr', '')}]"
                )
        elif op not in expected_wrong:
            out.append(
                f"{where} is {status.upper()}: {r['detail']} [sample {r.get('sample')}: {r.get('sample_repr', '')}]"
            )
    return out


def counts(results: dict) -> dict:
    c = collections.Counter(r["status"] for r in results.values())
    return {s: c.get(s, 0) for s in SEVERITY}


def save(layout: str, results: dict) -> None:
    """``results/<layout>.json``, one op a line: what the coverage page needs (passes: status and samples)."""
    RESULTS.mkdir(exist_ok=True)
    keep = ("status", "samples", "detail", "sample", "sample_repr", "err")
    lines = []
    for op, r in sorted(results.items()):
        entry = {k: r[k] for k in keep if k in r and (r["status"] != "pass" or k in ("status", "samples"))}
        if "detail" in entry:
            entry["detail"] = _reason(entry["detail"])
        lines.append(f"{json.dumps(op)}: {json.dumps(entry, sort_keys=True)}")
    (RESULTS / f"{layout}.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")


def load_all() -> dict[str, dict]:
    return {
        layout: json.loads((RESULTS / f"{layout}.json").read_text())
        for layout in LAYOUTS
        if (RESULTS / f"{layout}.json").exists()
    }


def load_dtensor() -> dict[str, dict]:
    """The DTensor side-by-side results (``results/dtensor-<layout>.json``) saved so far, by layout."""
    return {
        layout: json.loads((RESULTS / f"dtensor-{layout}.json").read_text())
        for layout in LAYOUTS
        if (RESULTS / f"dtensor-{layout}.json").exists()
    }


def write_expected(layout: str, results: dict, mode: str) -> None:
    """``mode="shrink"``: drop the entries of ops that now pass; ``"rewrite"``: the layout's errors as measured.

    Reads the file afresh: an earlier layout of the same session may have rewritten it.
    """
    current = runpy.run_path(str(HERE / "_expected.py"))
    errors = {k: dict(v) for k, v in current["ERRORS"].items()}
    wrong = current["WRONG"]
    if mode == "rewrite":
        errors[layout] = {op: _reason(r["detail"]) for op, r in sorted(results.items()) if r["status"] == "error"}
    else:
        errors[layout] = {
            op: why for op, why in errors.get(layout, {}).items() if results.get(op, {}).get("status") != "pass"
        }
    wrong = {
        k: {op: why for op, why in v.items() if k != layout or results.get(op, {}).get("status") != "pass"}
        for k, v in wrong.items()
    }
    path = HERE / "_expected.py"
    head = path.read_text().split("ERRORS = ")[0]
    path.write_text(head + "ERRORS = " + _literal(errors) + "\n\n" + "WRONG = " + _literal(wrong) + "\n")


def _literal(table: dict[str, dict[str, str]]) -> str:
    """``{layout: {op: reason}}`` as Python source, one entry a line, sorted."""
    if not table:
        return "{}"
    lines = ["{"]
    for layout in sorted(table):
        lines.append(f"    {json.dumps(layout)}: {{")
        lines += [
            f"        {json.dumps(op)}: {json.dumps(why, ensure_ascii=False)},"
            for op, why in sorted(table[layout].items())
        ]
        lines.append("    },")
    return "\n".join(lines + ["}"])


def _reason(detail: str) -> str:
    return detail.split(". Either gather first")[0][:160]


def render(all_results: dict[str, dict], families: dict[str, str], dtensor: dict | None = None) -> str:
    """The coverage page: counts per layout, per family, and each op that does not pass with its error."""
    layouts = [lay for lay in LAYOUTS if lay in all_results]
    lines = [
        "# Op coverage: PyTorch's OpInfo database on uneven shards",
        "",
        "Generated by the full OpInfo sweep (`tests/ops/opinfo`, see tests/README.md); do not edit by hand:",
        "",
        "    PYTHONHASHSEED=0 .venv/bin/python -m pytest tests/ops/opinfo -m opinfo_full -q -s",
        "",
        "Every op of `torch.testing._internal.common_methods_invocations.op_db` that supports float64 on CPU, at",
        "most 8 samples each, runs on ShardTensors and on one process. The sample's primary input is sharded",
        "unevenly with empty shards (10 rows over 3 ranks: 5/3/2; 2 rows: 1/0/1; over the 2x2 mesh the dim is",
        "split 4 ways, nested); other tensor arguments stay plain tensors and are promoted (replicated). An op",
        "passes when every output and every gradient of every sample equals one process's (float64, rtol = atol",
        "= 1e-7); *error* means every rank raised the same exception, a clear error to work around (see",
        "[limitations.md](limitations.md)). *Wrong* (silently wrong), *divergent* (ranks disagree) and *hang*",
        "must stay zero outside the reviewed list in `tests/ops/opinfo/_expected.py`.",
        "",
        "| layout | ops run | pass | error | wrong | divergent | hang | crash | not run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lay in layouts:
        c = counts(all_results[lay])
        run = sum(c[s] for s in SEVERITY if s != "not run")
        lines.append(
            f"| {_layout_name(lay)} | {run} | {c['pass']} | {c['error']} | {c['wrong']} | {c['divergent']} "
            f"| {c['hang']} | {c['crash']} | {c['not run']} |"
        )
    dtensor = load_dtensor() if dtensor is None else dtensor
    for lay, rs in dtensor.items():
        c = counts(rs)
        run = sum(c[s] for s in SEVERITY if s != "not run")
        lines.append(
            f"| DTensor: {_layout_name(lay)} | {run} | {c['pass']} | {c['error']} | {c['wrong']} | "
            f"{c['divergent']} | {c['hang']} | {c['crash']} | {c['not run']} |"
        )
    if dtensor:
        lines += [
            "",
            "DTensor rows: the same samples on `torch.distributed.tensor.DTensor` for comparison",
            "(`PDP_OPINFO_TARGET=dtensor`, `test_opinfo_full_dtensor`): the primary input from `distribute_tensor`",
            "(DTensor's even chunks), the other tensor arguments replicated DTensors, 20 s a sample before *hang*;",
            "reported, never judged.",
        ]
    lines += [
        "",
        "## Per family",
        "",
        "Passing ops / ops run, per layout.",
        "",
        "| family | " + " | ".join(_layout_name(lay) for lay in layouts) + " |",
        "| --- |" + " --- |" * len(layouts),
    ]
    by_family = collections.defaultdict(list)
    for op in sorted(all_results[layouts[0]]):
        by_family[families.get(op, "other")].append(op)
    for fam in sorted(by_family):
        if all(
            all_results[lay].get(op, {}).get("status", "not run") == "not run"
            for lay in layouts
            for op in by_family[fam]
        ):
            continue
        cells = []
        for lay in layouts:
            rs = [all_results[lay][op] for op in by_family[fam] if op in all_results[lay]]
            run = [r for r in rs if r["status"] != "not run"]
            cells.append(f"{sum(r['status'] == 'pass' for r in run)} / {len(run)}")
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Ops that do not pass",
        "",
        "The first failing sample's outcome (✓: passes; –: not run), the same on every layout unless the",
        "layouts are named.",
        "",
        "| op | family | outcome |",
        "| --- | --- | --- |",
    ]
    for fam in sorted(by_family):
        for op in by_family[fam]:
            cells = [all_results[lay].get(op, {"status": "not run"}) for lay in layouts]
            if all(c["status"] in ("pass", "not run") for c in cells):
                continue
            texts = [_cell(c) for c in cells]
            if len(set(texts)) == 1:
                outcome = texts[0]
            else:
                outcome = "; ".join(f"{_layout_name(lay)}: {t}" for lay, t in zip(layouts, texts))
            lines.append(f"| `{op}` | {fam} | {outcome} |")
    lines += ["", "## Ops that pass on every layout", ""]
    for fam in sorted(by_family):
        ok = [
            op
            for op in by_family[fam]
            if all(all_results[lay].get(op, {}).get("status") in ("pass", "not run") for lay in layouts)
            and any(all_results[lay].get(op, {}).get("status") == "pass" for lay in layouts)
        ]
        if ok:
            lines.append(f"- **{fam}** ({len(ok)}): " + ", ".join(f"`{op}`" for op in ok))
    return "\n".join(lines) + "\n"


def _layout_name(layout: str) -> str:
    mesh, where = layout.split("-")
    return f"{'3 ranks' if mesh == 'ws3' else '2x2 mesh'}, {'Shard(0)' if where == 'shard0' else 'Shard(-1)'}"


def _cell(r: dict) -> str:
    s = r["status"]
    if s == "pass":
        return "✓"
    if s == "not run":
        return "–"
    detail = _reason(r["detail"]).replace("|", "\\|").replace("\n", " ")
    detail = detail.replace("NotImplementedError: ShardTensor has no rule for ", "no rule: ")
    return f"{s}: {detail[:110]}"


def write_doc(families: dict[str, str]) -> None:
    DOC.write_text(render(load_all(), families))


def env_mode() -> str | None:
    """``PDP_OPINFO_EXPECTED=shrink|rewrite``: update ``_expected.py`` from a full sweep (see tests/README.md)."""
    return os.environ.get("PDP_OPINFO_EXPECTED") or None
