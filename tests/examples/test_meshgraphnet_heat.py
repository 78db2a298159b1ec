"""``examples/meshgraphnet_heat.py``: a MeshGraphNet on partitioned meshes trains like one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import meshgraphnet_heat

from ._run import argv, context, help_text, on_layout, summary

# 14 x 5 = 70 nodes: uneven point ranges over 3 ranks; one mesh per step (the default on one ddp rank)
TINY = {"--around": 14, "--rings": 4, "--samples": 3, "--test-samples": 1, "--width": 8, "--layers": 10,
        "--steps": 4, "--checkpoint-every": 2, "--quiet": None}


def train(ctx, out: str, strategy: str, options: dict | None = None) -> dict:
    """Rank body: the example's whole run on this job's mesh."""
    flags = {**TINY, **(options or {}), "--strategy": strategy}
    result = meshgraphnet_heat.run(argv(flags, out), context(ctx, strategy))
    return summary(result, "graphs_built", "ghost_counts")


def test_arguments(capsys):
    args = meshgraphnet_heat.parse_args([])
    assert (args.strategy, args.device, args.layers, args.batch_size) == ("ddp", "cpu", 10, None)
    text = help_text(meshgraphnet_heat.parse_args, capsys)
    assert all(flag in text for flag in ("--around", "--rings", "--layers", "--domain-size", "--resume"))


@pytest.mark.timeout(600)
def test_trains_on_three_ranks_like_one_process(tmp_path):
    """Losses of one process and of 3 domain ranks (uneven ranges) agree; plots and checkpoints are written; DDP runs."""
    single = on_layout(__name__, "train", (1, 1), out=tmp_path / "one", strategy="ddp")
    assert len(single["losses"]) == 4 and all(math.isfinite(v) for v in single["losses"])
    assert single["ghost_counts"] == [0]
    parallel = on_layout(__name__, "train", (1, 3), out=tmp_path / "three", strategy="ddp")
    assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    assert parallel["test_loss"] == pytest.approx(single["test_loss"], rel=1e-3)
    assert parallel["graphs_built"] == 3  # each training mesh once, though step 4 revisits one
    assert all(count > 0 for count in parallel["ghost_counts"]), parallel["ghost_counts"]
    assert {Path(p).name for p in parallel["files"].values()} == {"loss.png", "prediction.png", "partition.png"}
    assert all(Path(p).stat().st_size > 0 for p in parallel["files"].values())
    assert sorted(p.name for p in (tmp_path / "three" / "checkpoints").iterdir()) == ["step_00000002",
                                                                                   "step_00000004"]
    # DDP: one mesh per ddp rank and step, and at least one test mesh each
    ddp = on_layout(__name__, "train", (2, 1), out=tmp_path / "ddp", strategy="ddp", options={"--test-samples": 2})
    assert len(ddp["losses"]) == 4 and all(math.isfinite(v) for v in ddp["losses"])
