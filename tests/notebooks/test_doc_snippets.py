"""Every ```python block of README.md and docs/*.md runs as written and prints what it says it prints.

Run modes and the output convention: ``tests/notebooks/_snippets.py`` (and tests/README.md).
The blocks of one mode run together: the single-process ones in one Python process (a fresh
namespace each), the launched ones in one ``physicsnemo_dp.launch`` per rank count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from . import _snippets
from ._snippets import ROOT, Block, all_blocks, as_dicts, check_output


def _report(blocks: list[Block], results: list[dict]) -> list[str]:
    problems = []
    for block, result in zip(blocks, results, strict=True):
        if result["errors"]:
            ranks = sorted(result["errors"], key=int)
            problems.append(f"{block.where} ({block.mode}) failed on rank(s) {ranks}:\n{result['errors'][ranks[0]]}")
            continue
        missing = check_output(block, result["output"])
        if missing:
            problems.append(missing)
    return problems


def test_every_block_has_a_known_run_mode():
    """Markers parse (an unknown one or a skip without a reason fails), and some blocks of each kind exist."""
    found = all_blocks()  # raises on a bad marker, naming the page and line
    modes = {b.mode for b in found}
    assert {"single", "launch"} <= modes, modes
    assert all(b.reason for b in found if b.mode == "skip")


def test_markers():
    """Each mode parses; an unknown marker, a skip without a reason, a slow skip are refused with the page:line."""
    assert _snippets._parse_mode("single", "p:1") == ("single", 1, "", "")
    assert _snippets._parse_mode("launch 3", "p:1") == ("launch", 3, "", "")
    assert _snippets._parse_mode("launch 2, slow (compiles)", "p:1") == ("launch", 2, "", "compiles")
    assert _snippets._parse_mode("skip (needs GPUs)", "p:1") == ("skip", 0, "needs GPUs", "")
    for bad in ("skip", "skip ()", "launch 9", "launch", "run it", "skip (x), slow (y)"):
        with pytest.raises(ValueError, match="p:1"):
            _snippets._parse_mode(bad, "p:1")


def test_output_convention():
    block = Block("x.md", 1, "single", expected=["a = 1", "shape (..., 3)"])
    assert check_output(block, "noise\na = 1\nshape (4, 3)\n") is None
    assert check_output(block, "shape (4, 3)\na = 1\n") is not None  # order matters
    assert check_output(block, "a = 12\nshape (4, 3)\n") is not None  # whole lines


def _run_single(blocks: list[Block]) -> None:
    if not blocks:
        pytest.skip("no such block")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "tests.notebooks._snippets"], input=json.dumps(as_dicts(blocks)),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "@@RESULTS@@" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(done.stdout.rsplit("@@RESULTS@@", 1)[1])
    problems = _report(blocks, results)
    assert not problems, "\n\n".join(problems)


def _run_launched(blocks: list[Block], nprocs: int) -> None:
    from physicsnemo_dp import launch

    if not blocks:
        pytest.skip(f"no such block runs on {nprocs} ranks")
    results = launch(_snippets.run_on_ranks, nprocs, args=(as_dicts(blocks),), timeout=300, echo=False)
    problems = _report(blocks, results)
    assert not problems, "\n\n".join(problems)


def test_single_process_blocks():
    _run_single([b for b in all_blocks() if b.mode == "single" and not b.slow])


@pytest.mark.parametrize("nprocs", [2, 3])
def test_launched_blocks(nprocs):
    _run_launched([b for b in all_blocks() if b.mode == "launch" and b.nprocs == nprocs and not b.slow], nprocs)


@pytest.mark.slow
def test_slow_blocks():
    """Blocks marked ``slow (reason)``: a cold Inductor compile (see the reason on the page)."""
    slow = [b for b in all_blocks() if b.slow]
    if not slow:
        pytest.skip("no slow block")
    _run_single([b for b in slow if b.mode == "single"]) if any(b.mode == "single" for b in slow) else None
    for nprocs in sorted({b.nprocs for b in slow if b.mode == "launch"}):
        _run_launched([b for b in slow if b.mode == "launch" and b.nprocs == nprocs], nprocs)
