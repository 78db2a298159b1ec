"""``examples/diffusion_darcy.py``: trains, samples the same field on every decomposition, draws its figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import diffusion_darcy

from ._run import argv, context, help_text, on_layout, summary

# 18 rows: 9 after pooling, uneven over 2 domain ranks; one pooling level and 2 noise levels keep it fast
TINY = {"--grid": 18, "--samples": 8, "--test-samples": 1, "--width": 8, "--depth": 1, "--batch-size": 4,
        "--steps": 3, "--sample-steps": 2, "--checkpoint-every": 100, "--quiet": None}


def train(ctx, out: str, options: dict, strategy: str) -> dict:
    """Rank body: the example's whole run on this job's mesh."""
    result = diffusion_darcy.run(argv({**options, "--strategy": strategy}, out), context(ctx, strategy))
    return summary(result, "p_difference", "sample")


def test_arguments(capsys):
    args = diffusion_darcy.parse_args([])
    assert (args.strategy, args.sample_steps, args.churn, args.grid) == ("ddp", 18, 10.0, 32)
    text = help_text(diffusion_darcy.parse_args, capsys)
    assert all(flag in text for flag in ("--domain-size", "--strategy", "--steps", "--out", "--sample-steps"))


@pytest.mark.timeout(600)
def test_trains_samples_and_is_decomposition_invariant(tmp_path):
    """One process vs 2 domain ranks (FSDP2): the same losses, the same sample; figures written."""
    single = on_layout(__name__, "train", (1, 1), out=tmp_path / "one", options=TINY, strategy="ddp")
    assert len(single["losses"]) == 3 and all(math.isfinite(v) for v in single["losses"])
    assert {Path(p).name for p in single["files"].values()} == {"loss.png", "prediction.png", "p_invariance.png"}
    assert all(Path(p).stat().st_size > 0 for p in single["files"].values())
    assert (tmp_path / "one" / "pipeline" / "pipeline.json").is_file()
    split = on_layout(__name__, "train", (1, 2), out=tmp_path / "two", options=TINY, strategy="fsdp2")
    assert split["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    # the 2-rank sample vs the one-process sample of the same weights, relative to the sample's size (float32)
    assert split["p_difference"] < 1e-4 and single["p_difference"] < 1e-4
    scale = single["sample"].abs().max().item()
    torch.testing.assert_close(split["sample"], single["sample"], rtol=1e-4, atol=1e-4 * scale)
