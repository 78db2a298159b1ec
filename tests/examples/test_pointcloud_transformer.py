"""``examples/pointcloud_transformer.py``: ring attention over points split by rank, the same as one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import pointcloud_transformer

from ._run import argv, context, on_layout

TINY = {"--points": 70, "--samples": 8, "--test-samples": 2, "--width": 16, "--heads": 2, "--depth": 1,
        "--batch-size": 4, "--steps": 4, "--checkpoint-every": 2, "--quiet": None}


def train(ctx, out: str, strategy: str) -> dict:
    """Rank body: the example's whole run on this job's mesh."""
    result = pointcloud_transformer.run(argv({**TINY, "--strategy": strategy}, out), context(ctx, strategy))
    checkpoints = sorted(p.name for p in (Path(out) / "checkpoints").iterdir())
    return {"losses": result["losses"], "test_loss": result["test_loss"], "checkpoints": checkpoints,
            "files": {name: str(path) for name, path in result["files"].items()}}


def test_arguments(capsys):
    args = pointcloud_transformer.parse_args([])
    assert (args.strategy, args.device, args.points) == ("ddp", "cpu", 512)
    with pytest.raises(SystemExit):
        pointcloud_transformer.parse_args(["--help"])
    assert "--heads" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_runs_on_four_ranks_like_one_process(tmp_path):
    single = on_layout(__name__, "train", (1, 1), out=tmp_path / "one", strategy="ddp")
    assert len(single["losses"]) == 4 and all(math.isfinite(v) for v in single["losses"])
    for layout, strategy in [((2, 2), "fsdp2"), ((1, 4), "ddp")]:
        parallel = on_layout(__name__, "train", layout, out=tmp_path / f"{layout}", strategy=strategy)
        assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6), (layout, strategy)
        assert parallel["checkpoints"] == ["step_00000002", "step_00000004"]
        assert {Path(p).name for p in parallel["files"].values()} == {"loss.png", "prediction.png"}
        assert all(Path(p).stat().st_size > 0 for p in parallel["files"].values())
