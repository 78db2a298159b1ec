"""``examples/fno_darcy.py``: trains, matches one process on (ddp, domain) layouts, runs under torchrun.

The default run uses ``--model plain`` (``spectral_models.FNO2d``), so it
needs no optional package; neuraloperator's FNO in the same loop is checked
by ``test_neuralop_model_trains`` with ``-m spectral_extra``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fno_darcy

from . import EXAMPLES
from ._run import argv, context, help_text, on_layout, summary

ROOT = EXAMPLES.parent
# 18 rows over 2 or 4 domain ranks: uneven 10 frequency columns after rfft2 (18 // 2 + 1) over the ranks
TINY = {"--grid": 18, "--samples": 12, "--test-samples": 2, "--width": 12, "--modes": 4, "--layers": 2,
        "--batch-size": 4, "--lr": 2e-2, "--checkpoint-every": 100, "--quiet": None}


def train(ctx, out: str, options: dict, strategy: str) -> dict:
    """Rank body: the example's whole run on this job's mesh."""
    return summary(fno_darcy.run(argv({**options, "--strategy": strategy}, out), context(ctx, strategy)))


def test_arguments(capsys):
    args = fno_darcy.parse_args([])
    assert (args.strategy, args.model, args.grid, args.modes) == ("ddp", "auto", 64, 12)
    assert fno_darcy.model_kind("plain") == "plain"
    text = help_text(fno_darcy.parse_args, capsys)
    assert all(flag in text for flag in ("--domain-size", "--strategy", "--model", "--modes", "--resume"))


@pytest.mark.timeout(600)
def test_loss_decreases_and_matches_one_process(tmp_path):
    """The plain FNO: one process vs (2, 2) with FSDP2 and (1, 4) with DDP, the same losses."""
    options = {**TINY, "--model": "plain", "--steps": 10}
    single = on_layout(__name__, "train", (1, 1), out=tmp_path / "one", options=options, strategy="ddp")
    losses = single["losses"]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) / 2 < 0.6 * sum(losses[:2]) / 2, losses  # it learns
    assert {Path(p).name for p in single["files"].values()} == {"loss.png", "prediction.png"}
    for layout, strategy in [((2, 2), "fsdp2"), ((1, 4), "ddp")]:
        parallel = on_layout(__name__, "train", layout, out=tmp_path / f"{layout}-{strategy}", options=options,
                             strategy=strategy)
        assert parallel["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6), (layout, strategy)
        assert parallel["test_loss"] == pytest.approx(single["test_loss"], rel=1e-3), (layout, strategy)


@pytest.mark.spectral_extra
@pytest.mark.timeout(600)
def test_neuralop_model_trains(tmp_path):
    """neuraloperator's FNO through the same loop on (1, 2) with DDP equals one process."""
    pytest.importorskip("neuralop")
    options = {**TINY, "--model": "neuralop", "--steps": 4}
    single = on_layout(__name__, "train", (1, 1), out=tmp_path / "one", options=options, strategy="ddp")
    parallel = on_layout(__name__, "train", (1, 2), out=tmp_path / "two", options=options, strategy="ddp")
    assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)


@pytest.mark.slow  # the torchrun path is covered by tests/distributed/test_example.py; pytest -m slow
@pytest.mark.timeout(600)
def test_torchrun_end_to_end(tmp_path):
    """The documented command on 4 ranks (2 x 2, DDP): progress, log, checkpoint, plots."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    options = {k: v for k, v in TINY.items() if k != "--quiet"}  # with the progress bar
    flags = argv({**options, "--model": "plain", "--steps": 2, "--checkpoint-every": 2}, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(EXAMPLES / "fno_darcy.py"), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "mesh (ddp=2, domain=2)" in result.stdout and "model plain" in result.stdout
    for name in ("loss.png", "prediction.png", "train.log"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
