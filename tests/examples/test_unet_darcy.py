"""``examples/unet_darcy.py``: trains, matches one process, and runs as documented under torchrun."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import unet_darcy

from . import EXAMPLES
from ._run import argv, context, help_text, on_layout, summary

ROOT = EXAMPLES.parent
# 20 rows: uneven shards after pooling (20 -> 10 -> 5 rows, over 2 or 4 domain ranks)
TINY = {"--grid": 20, "--samples": 16, "--test-samples": 2, "--width": 8, "--batch-size": 4,
        "--checkpoint-every": 100, "--quiet": None}


def train(ctx, out: str, options: dict, strategy: str) -> dict:
    """Rank body: the example's whole run on this job's mesh."""
    return summary(unet_darcy.run(argv({**options, "--strategy": strategy}, out), context(ctx, strategy)))


def test_arguments(capsys):
    args = unet_darcy.parse_args([])
    assert (args.strategy, args.device, args.grid, args.resume) == ("ddp", "cpu", 64, None)
    assert unet_darcy.parse_args(["--resume"]).resume == "latest"
    text = help_text(unet_darcy.parse_args, capsys)
    assert all(flag in text for flag in ("--domain-size", "--ddp-size", "--strategy", "--device", "--resume"))


@pytest.mark.timeout(900)
def test_loss_decreases_and_matches_one_process(tmp_path):
    """The same model on the same data: one process vs (ddp, domain) layouts with DDP and FSDP2."""
    options = {**TINY, "--steps": 8}
    single = on_layout(__name__, "train", (1, 1), out=tmp_path / "one", options=options, strategy="ddp")
    losses = single["losses"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses  # it learns
    assert {Path(p).name for p in single["files"].values()} == {"loss.png", "prediction.png"}
    for layout, strategy in [((2, 2), "ddp"), ((2, 2), "fsdp2"), ((1, 4), "ddp")]:
        parallel = on_layout(__name__, "train", layout, out=tmp_path / f"{layout}-{strategy}", options=options,
                             strategy=strategy)
        assert parallel["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6), (layout, strategy)
        assert parallel["test_loss"] == pytest.approx(single["test_loss"], rel=1e-3), (layout, strategy)


@pytest.mark.slow  # the torchrun path is covered by tests/distributed/test_example.py; pytest -m slow
@pytest.mark.timeout(600)
def test_torchrun_end_to_end(tmp_path):
    """The documented command: 4 ranks, progress, log, checkpoint, plots, the output folder named at the end."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    options = {k: v for k, v in TINY.items() if k != "--quiet"}  # with the progress bar
    flags = argv({**options, "--steps": 3, "--checkpoint-every": 2, "--strategy": "fsdp2"}, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(EXAMPLES / "unet_darcy.py"), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"output folder: {tmp_path}" in result.stdout
    assert "mesh (ddp=2, domain=2)" in result.stdout and "samples_s=" in result.stdout  # the log, the bar
    for name in ("loss.png", "prediction.png", "train.log"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    log = (tmp_path / "train.log").read_text()
    assert "step 3 loss" in log and "samples/s" in log
