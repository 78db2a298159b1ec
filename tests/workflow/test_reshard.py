"""Checkpoints through the U-Net example's training loop: bit-identical resume, resharding, killed saves.

* Resume on the same (2, 2) layout continues the loss curve and ends in the
  same weights and optimizer state, bit for bit (DDP and FSDP2).
* A checkpoint saved on (2, 2) loads on 2 ranks as (1, 2) and (2, 1): every
  weight and Adam moment equal to the saved ones, the model's output on a
  fixed input equal to the saving layout's; training resumed there from an
  earlier checkpoint reads the same samples and follows the same loss curve.
* A rank killed (SIGKILL) in the middle of a save — while writing its data,
  before the manifest, before the rename — leaves the previous checkpoint the
  newest loadable one, and the next save removes the debris.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import physicsnemo_dp.checkpoint as checkpoint_module
from physicsnemo_dp import Shard, ShardTensor, chunk_sizes
from physicsnemo_dp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests._harness import RankFailure, get_pool
from tests._harness.worker import Job
from tests.examples import EXAMPLES  # noqa: F401  (puts the examples on sys.path)
from tests.examples._run import argv, context, on_layout

import unet_darcy  # noqa: E402

OPTIONS = {"--grid": 20, "--samples": 16, "--test-samples": 2, "--width": 8, "--batch-size": 4,
           "--steps": 6, "--checkpoint-every": 3, "--quiet": None}
STEP3, STEP6 = "step_00000003", "step_00000006"


# --------------------------------------------------------------------------- #
# Helpers (run on every rank)
# --------------------------------------------------------------------------- #
def _full(value):
    """A state tree with DTensors gathered (collective) and every tensor copied to the CPU."""
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    if isinstance(value, DTensor):
        return value.full_tensor().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def _training_state(model, optimizer) -> dict:
    return _full({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)})


def _assert_identical(actual, expected, where="state"):
    """Bitwise equality of two state trees."""
    assert type(actual) is type(expected), where
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            _assert_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_identical(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    else:
        assert actual == expected, where


@torch.no_grad()
def _probe(model, context) -> torch.Tensor:
    """The model's output on a fixed input, rows split over the domain ranks, gathered."""
    grid = OPTIONS["--grid"]
    x = torch.randn(2, 1, grid, grid, generator=torch.Generator().manual_seed(7))
    sizes = chunk_sizes(grid, context.domain_size)
    start = sum(sizes[: context.domain_rank])
    local = x[:, :, start : start + sizes[context.domain_rank]].to(context.device)
    sharded = ShardTensor.from_local(local, context.domain_mesh, [Shard(2)], sharding_shapes="chunk",
                                     global_shape=tuple(x.shape))
    model.eval()
    out = model(sharded).full_tensor().cpu()
    model.train()
    return out


# --------------------------------------------------------------------------- #
# Resume on the same layout, then resharding (2, 2) -> (1, 2) and (2, 1)
# --------------------------------------------------------------------------- #
def save_body(ctx, out: Path, strategy: str) -> dict:
    """Train 6 steps on (2, 2), then resume from step 3 on the same layout: the same curve and state, bit for bit."""
    c = context(ctx, strategy)
    options = {**OPTIONS, "--strategy": strategy}
    first = unet_darcy.run(argv(options, out), c)
    saved = {"losses": first["losses"], "state": _training_state(first["model"], first["optimizer"]),
             "probe": _probe(first["model"], c)}
    second = unet_darcy.run(argv({**options, "--resume": out / "checkpoints" / STEP3}, out / "resumed-2x2"), c)
    assert len(first["losses"]) == 6
    assert second["losses"] == first["losses"]  # steps 4-6 recomputed bit for bit
    _assert_identical(_training_state(second["model"], second["optimizer"]), saved["state"])
    return saved


def load_body(ctx, out: Path, strategy: str, saved: dict):
    c = context(ctx, strategy)
    options = {**OPTIONS, "--strategy": strategy}
    model, optimizer, scheduler = unet_darcy.build_training(unet_darcy.parse_args(argv(options, out)), c)
    restored = load_checkpoint(out / "checkpoints" / STEP6, model, optimizer, scheduler)
    assert restored.step == 6 and restored.extra["layout"] == [2, 2] and not restored.rng_restored
    assert scheduler.last_epoch == 6
    _assert_identical(_training_state(model, optimizer), saved["state"])  # every weight and Adam moment
    probe = _probe(model, c)
    if c.domain_size == 2:  # the same split as when saved: the same arithmetic
        assert torch.equal(probe, saved["probe"])
    else:  # one rank holds whole rows: convolution sums in another order
        torch.testing.assert_close(probe, saved["probe"], rtol=1e-5, atol=1e-6)
    # resume training here from step 3: the same samples per step, so the same loss curve
    elsewhere = out / f"resumed-{c.ddp_size}x{c.domain_size}"
    resumed = unet_darcy.run(argv({**options, "--resume": out / "checkpoints" / STEP3}, elsewhere), c)
    assert resumed["losses"][:3] == saved["losses"][:3]
    assert resumed["losses"][3:] == pytest.approx(saved["losses"][3:], rel=1e-4)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_is_bit_identical_and_reshards_to_other_layouts(tmp_path, strategy):
    saved = on_layout(__name__, "save_body", (2, 2), out=tmp_path, strategy=strategy)
    for layout in [(1, 2), (2, 1)]:
        on_layout(__name__, "load_body", layout, out=tmp_path, strategy=strategy, saved=saved)


# --------------------------------------------------------------------------- #
# A rank killed mid-save
# --------------------------------------------------------------------------- #
def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def _killed(where: str):
    """Make this process SIGKILL itself at ``where`` in the next save."""
    if where == "mid-write":  # the first bytes of this rank's data file, then death
        original = filesystem.FileSystem.create_stream

        @contextmanager
        def create_stream(self, path, mode):
            with original(self, path, mode) as stream:
                if str(path).endswith(".distcp"):
                    stream.write(b"partial")
                    stream.flush()
                    _die()
                yield stream

        patch = mock.patch.object(filesystem.FileSystem, "create_stream", create_stream)
    elif where == "before-manifest":  # all data written, manifest not yet
        patch = mock.patch.object(checkpoint_module, "_manifest_of", lambda folder: _die())
    else:  # manifest written, folder not yet renamed
        patch = mock.patch.object(checkpoint_module.os, "replace", lambda *a: _die())
    with patch:
        yield


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


def killed_save_body(ctx, root: Path, where: str, victim: int):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    save_checkpoint(root, 1, model, optimizer, extra={"good": True})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if ctx.rank == victim:
        with _killed(where):
            save_checkpoint(root, 2, model, optimizer)
    else:
        save_checkpoint(root, 2, model, optimizer)  # blocks on the dead rank until the harness stops it
    raise AssertionError(f"rank {ctx.rank}: the save at {where} was not killed")


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # this process loads and saves alone
@pytest.mark.parametrize("where, world, victim", [("mid-write", 2, 1), ("before-manifest", 1, 0),
                                                  ("before-rename", 1, 0)])
def test_killed_save_leaves_the_previous_checkpoint(tmp_path, where, world, victim):
    with pytest.raises(RankFailure, match="SIGKILL"):
        get_pool(world).run(Job(__name__, "killed_save_body", dict(root=tmp_path, where=where, victim=victim),
                                (world,)), timeout=120, grace=1.0)  # the survivor waits on the dead rank: no 8 s grace
    debris = tmp_path / ".tmp-step_00000002"
    assert debris.is_dir()  # what the killed save left
    assert (debris / "manifest.json").exists() == (where == "before-rename")
    assert not (tmp_path / "step_00000002").exists()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))  # other weights
    restored = load_checkpoint(tmp_path, model)  # here: one process, no process group
    assert restored.step == 1 and restored.extra == {"good": True}
    for actual, expected in zip(model.state_dict().values(), _model().state_dict().values()):
        assert torch.equal(actual, expected)
    save_checkpoint(tmp_path, 3, model)  # the next save clears the debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]
