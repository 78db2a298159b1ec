"""Checkpoints: bit-identical resume, resharding across layouts, crash safety."""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from physicsnemo_dp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests._harness import distributed


def _shared_dir(name: str) -> Path:
    """A folder every rank agrees on (rank 0 empties it)."""
    path = Path(f"/tmp/pdp-ckpt-tests/{name}-{os.getppid()}")
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(model, opt, sched, steps, data_seed):
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6)  # draws from the (checkpointed) RNG
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _setup():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_resume_is_bit_identical(ctx):
    root = _shared_dir("resume")
    torch.manual_seed(100 + ctx.rank)
    model, opt, sched = _setup()
    _train(model, opt, sched, 3, 0)
    save_checkpoint(root, 3, model, opt, sched, extra={"epoch": 1, "sample": 24})
    reference = _train(model, opt, sched, 4, 0)

    torch.manual_seed(999)  # a fresh process would start elsewhere
    model2, opt2, sched2 = _setup()
    restored = load_checkpoint(root, model2, opt2, sched2)
    assert restored.step == 3 and restored.extra == {"epoch": 1, "sample": 24} and restored.rng_restored
    assert _train(model2, opt2, sched2, 4, 0) == reference  # bit for bit


@distributed(world_sizes=(2,), mesh_2d=False)
def test_killed_save_keeps_the_previous_checkpoint(ctx):
    root = _shared_dir("killed")
    model, opt, sched = _setup()
    save_checkpoint(root, 1, model, opt, sched)
    if ctx.rank == 0:
        # what a save killed mid-way leaves: a temporary folder, and a step folder whose
        # files do not match a manifest (e.g. a truncated file)
        (root / ".tmp-step_00000002").mkdir()
        (root / ".tmp-step_00000002" / "__0_0.distcp").write_bytes(b"partial")
        broken = root / "step_00000003"
        shutil.copytree(root / "step_00000001", broken)
        victim = next(p for p in broken.iterdir() if p.suffix == ".distcp")
        victim.write_bytes(victim.read_bytes()[:10])
    dist.barrier()
    assert latest_checkpoint(root).name == "step_00000001"
    restored = load_checkpoint(root, *_setup())
    assert restored.step == 1
    with pytest.raises(RuntimeError, match="incomplete or corrupted"):
        load_checkpoint(root / "step_00000003", *_setup())
    save_checkpoint(root, 4, model, opt, sched)  # the next save cleans the leftovers
    assert not list(root.glob(".tmp-*"))


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_keep_limits_the_number_of_checkpoints(ctx):
    root = _shared_dir("keep")
    model, opt, sched = _setup()
    for step in range(4):
        save_checkpoint(root, step, model, opt, sched, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]


def test_load_from_an_empty_folder_returns_none(tmp_path):
    assert load_checkpoint(tmp_path, _model()) is None
