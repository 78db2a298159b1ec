"""``examples/train_ddp_domain.py`` runs as documented: with plain python and under torchrun."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp_domain.py"
_DIST_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(*command, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", stdout, flags=re.M)]


def test_arguments(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("train_ddp_domain", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up
    spec.loader.exec_module(example)
    args = example.parse_args([])
    assert (args.strategy, args.bf16, args.checkpointing) == ("ddp", False, False)
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--bf16"])
    assert exit_.value.code == 2 and "--bf16 needs --strategy fsdp2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--help"])
    assert exit_.value.code == 0 and "--domain-size" in capsys.readouterr().out


def test_single_process_without_torchrun():
    result = _run(sys.executable, str(EXAMPLE), "--steps", "2", "--checkpointing")
    assert result.returncode == 0, result.stderr
    assert "mesh (ddp=1, domain=1), strategy=ddp" in result.stdout
    assert len(_losses(result.stdout)) == 2


@pytest.mark.timeout(600)
def test_torchrun_on_a_2x2_mesh():
    result = _run(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(EXAMPLE), "--strategy", "fsdp2", "--bf16", "--checkpointing", "--steps", "3",
        timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "mesh (ddp=2, domain=2), strategy=fsdp2, bf16=True, checkpointing=True" in result.stdout
    losses = _losses(result.stdout)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
