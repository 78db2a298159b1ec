"""A run owns its output folder; pruning, rewinds and resumes never lose checkpoints or ignore flags.

Each test runs ``examples/unet_darcy.py``'s whole run (``_common.fit``) on
harness ranks with a tiny grid. On the loop as it was before: ``--resume auto``
over corrupt checkpoints of higher steps pruned the new run's own checkpoints
and logged "checkpoint None"; a second job on the same ``--out`` ran too and
replaced the first one's checkpoints; a resume after a rewind continued the
old branch; ``--lr`` on resume was ignored and a changed ``--width`` failed
with a raw shape mismatch.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import _common
import unet_darcy

from ._run import argv, context, on_layout
from tests._harness import get_pool
from tests._harness.worker import Job

TINY = {"--grid": 20, "--samples": 16, "--test-samples": 2, "--width": 8, "--batch-size": 4, "--quiet": None,
        "--prefetch": 0}


def _listing(out) -> dict:
    """The checkpoint folders of ``out`` (and those set aside), and the ``final loss`` lines of its log."""
    root = Path(out) / "checkpoints"
    log = (Path(out) / "train.log").read_text() if (Path(out) / "train.log").exists() else ""
    return {
        "checkpoints": sorted(p.name for p in root.iterdir()) if root.is_dir() else [],
        "aside": sorted(p.name for p in root.glob("superseded/*/step_*")),
        "finals": [line for line in log.splitlines() if " final loss " in line],
        "log": log,
    }


def _same_on_every_rank(text: str) -> str:
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    assert len(set(texts)) == 1, texts
    return text


# --------------------------------------------------------------------------- #
# Corrupt checkpoints of higher steps + --resume auto
# --------------------------------------------------------------------------- #
def corrupt_then_auto(ctx, out: str) -> dict:
    """Rank body: 8 steps (steps 4 and 8 kept), a bit flipped in each, then ``--resume auto`` for 3 steps."""
    c = context(ctx, "ddp")
    unet_darcy.run(argv({**TINY, "--steps": 8, "--checkpoint-every": 4}, out), c)
    if ctx.rank == 0:
        for folder in (Path(out) / "checkpoints").glob("step_*"):
            victim = max((p for p in folder.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF  # the size is kept: only the hash tells
            victim.write_bytes(bytes(data))
    dist.barrier()
    result = unet_darcy.run(argv({**TINY, "--steps": 3, "--checkpoint-every": 1, "--resume": "auto"}, out), c)
    return {**_listing(out), "steps": len(result["losses"])}


@pytest.mark.timeout(300)
def test_auto_over_corrupt_higher_checkpoints_keeps_the_new_runs_checkpoints(tmp_path):
    got = on_layout(__name__, "corrupt_then_auto", (2, 1), out=tmp_path)
    assert got["steps"] == 3
    root = tmp_path.resolve() / "checkpoints"
    assert got["finals"][-1].endswith(f"after 3 steps; checkpoint {root / 'step_00000003'}"), got["finals"]
    assert got["checkpoints"] == ["step_00000002", "step_00000003", "superseded"], got
    assert got["aside"] == ["step_00000004", "step_00000008"]  # moved unchanged, not deleted
    assert "2 checkpoint folder(s) from before this fresh start moved unchanged to" in got["log"]


# --------------------------------------------------------------------------- #
# Two jobs with one --out
# --------------------------------------------------------------------------- #
def first_job(ctx, out: str, go: str) -> dict:
    """Rank body of the first job: 4 steps; before step 3 it waits until the test creates ``go``."""
    calls = [0]
    original = unet_darcy.loss_fn

    def waiting_loss(model, batch):
        calls[0] += 1
        deadline = time.monotonic() + 120
        while calls[0] == 3 and not Path(go).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return original(model, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unet_darcy, "loss_fn", waiting_loss)
        result = unet_darcy.run(argv({**TINY, "--steps": 4, "--checkpoint-every": 1}, out), context(ctx, "ddp"))
    return {**_listing(out), "losses": result["losses"]}


def second_job(ctx, out: str) -> str:
    """Rank body of the second job, a fresh run on the same folder: refused on every rank, the same message."""
    with pytest.raises(SystemExit) as refused:
        unet_darcy.run(argv({**TINY, "--steps": 2, "--checkpoint-every": 1}, out), context(ctx, "ddp"))
    return _same_on_every_rank(str(refused.value.code))


@pytest.mark.timeout(400)
def test_a_second_job_on_the_same_out_is_refused_naming_the_first(tmp_path):
    out, go = tmp_path / "run", tmp_path / "go"
    first_pool, second_pool = get_pool(1), get_pool(2)
    first_pool.start()
    second_pool.start()
    box = {}

    def first():
        try:
            box["outcomes"] = first_pool.run(Job(__name__, "first_job", {"out": out, "go": go}, (1, 1)), timeout=300)
        except BaseException as err:  # noqa: BLE001 - reported by the test thread
            box["error"] = err

    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 200
        while not (out / "checkpoints" / "step_00000002").exists() and "error" not in box:
            assert time.monotonic() < deadline, "the first job did not reach step 2"
            time.sleep(0.1)
        assert "error" not in box, box.get("error")
        message = on_layout(__name__, "second_job", (2, 1), out=out)  # while the first job waits before step 3
    finally:
        go.touch()
        thread.join(320)
    assert "error" not in box, box.get("error")
    first_result = box["outcomes"][0].value
    assert message.startswith(f"{out.resolve()} is in use by another run: {out.resolve() / 'run.lock'} names pid "
                              f"{first_pool.pids[0]} on {socket.gethostname()}"), message
    assert "pass another --out" in message
    # the first job was not disturbed: its checkpoints, its log alone, the lock released at its end
    assert len(first_result["losses"]) == 4
    assert first_result["checkpoints"] == ["step_00000003", "step_00000004"]
    assert first_result["finals"][-1].endswith(f"checkpoint {out.resolve() / 'checkpoints' / 'step_00000004'}")
    assert first_result["log"].count("unet-darcy {") == 1  # one run's argument line: nothing of the second job
    assert not (out / "run.lock").exists()


def stale_and_failing(ctx, out: str, dead_pid: int) -> dict:
    """Rank body: a stale lock (dead pid on this host) is taken over; a run that fails releases the lock."""
    c = context(ctx, "ddp")
    lock = Path(out) / "run.lock"
    if ctx.rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid, "started": "earlier"}))
    dist.barrier()
    with pytest.raises(SystemExit, match="no loadable checkpoint"):  # fails after taking the folder
        unet_darcy.run(argv({**TINY, "--steps": 2, "--resume": "latest"}, out), c)
    released = not lock.exists()
    dist.barrier()
    if ctx.rank == 0:  # a holder on another host is never taken over
        lock.write_text(json.dumps({"host": "elsewhere.example", "pid": 1, "started": "earlier"}))
    dist.barrier()
    with pytest.raises(SystemExit) as refused:
        unet_darcy.run(argv({**TINY, "--steps": 2}, out), c)
    return {"released": released, "log": _listing(out)["log"], "refused": _same_on_every_rank(str(refused.value.code))}


@pytest.mark.timeout(300)
def test_a_stale_lock_is_taken_over_and_a_failing_run_releases_its_lock(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    got = on_layout(__name__, "stale_and_failing", (2, 1), out=tmp_path, dead_pid=gone.pid)
    assert f"took over the stale lock of {tmp_path.resolve()}: its holder, pid {gone.pid} on {socket.gethostname()}" \
        in got["log"]
    assert got["released"]
    assert "names pid 1 on elsewhere.example (another host: whether it still runs cannot be checked" in got["refused"]


# --------------------------------------------------------------------------- #
# A rewind, then a plain --resume
# --------------------------------------------------------------------------- #
def rewind_then_resume(ctx, out: str) -> dict:
    """Rank body: 6 steps (4 and 6 kept); resume from 4 to step 5; then a plain ``--resume`` to step 6."""
    c = context(ctx, "ddp")
    root = Path(out) / "checkpoints"
    unet_darcy.run(argv({**TINY, "--steps": 6, "--checkpoint-every": 2}, out), c)
    rewound = unet_darcy.run(argv({**TINY, "--steps": 5, "--checkpoint-every": 1,
                                   "--resume": root / "step_00000004"}, out), c)
    after_rewind = _listing(out)
    later = unet_darcy.run(argv({**TINY, "--steps": 6, "--checkpoint-every": 1, "--resume": None}, out), c)
    return {"rewound": rewound["losses"], "later": later["losses"], "after_rewind": after_rewind, **_listing(out)}


@pytest.mark.timeout(300)
def test_a_resume_after_a_rewind_continues_the_rewound_branch(tmp_path):
    got = on_layout(__name__, "rewind_then_resume", (2, 1), out=tmp_path)
    root = tmp_path.resolve() / "checkpoints"
    rewind = got["after_rewind"]
    assert rewind["finals"][-1].endswith(f"after 5 steps; checkpoint {root / 'step_00000005'}"), rewind["finals"]
    assert rewind["checkpoints"] == ["step_00000004", "step_00000005", "superseded"], rewind
    assert rewind["aside"] == ["step_00000006"]  # the old branch's later step: kept, out of the way
    assert f"resumed from {root / 'step_00000005'} at step 5" in got["log"]
    assert got["later"][:5] == got["rewound"]  # the rewound branch's losses, not the old branch's
    assert got["finals"][-1].endswith(f"after 6 steps; checkpoint {root / 'step_00000006'}")


# --------------------------------------------------------------------------- #
# Flags on resume: --lr applied and logged, --width refused naming the difference
# --------------------------------------------------------------------------- #
def resume_with_other_flags(ctx, out: str) -> dict:
    c = context(ctx, "ddp")
    unet_darcy.run(argv({**TINY, "--steps": 4, "--checkpoint-every": 4}, out), c)
    lower = unet_darcy.run(argv({**TINY, "--steps": 8, "--checkpoint-every": 4, "--lr": 1e-5, "--resume": None}, out), c)
    optimizer = lower["optimizer"]
    with pytest.raises(SystemExit) as refused:
        unet_darcy.run(argv({**TINY, "--steps": 10, "--width": 16, "--grid": 24, "--resume": None}, out), c)
    return {"lr": [g["lr"] for g in optimizer.param_groups], "initial": [g["initial_lr"] for g in optimizer.param_groups],
            "log": _listing(out)["log"], "refused": _same_on_every_rank(str(refused.value.code))}


@pytest.mark.timeout(300)
def test_resume_applies_a_new_lr_and_refuses_a_new_width_naming_each_difference(tmp_path):
    got = on_layout(__name__, "resume_with_other_flags", (2, 1), out=tmp_path)
    assert "--lr changed 0.003 → 1e-05 on resume" in got["log"]
    assert "--steps changed 4 → 8 on resume" in got["log"]
    # the cosine schedule ends at 5 % of the peak: of the new peak, not of the one restored from the checkpoint
    assert got["lr"] == [pytest.approx(0.05 * 1e-5)] and got["initial"] == [1e-5]
    root = tmp_path.resolve() / "checkpoints"
    assert got["refused"] == (
        f"--resume latest: checkpoint {root / 'step_00000008'} was written with other settings of the model or data:\n"
        "  --grid 20 → 24\n  --width 8 → 16\n"
        "resume with the checkpoint's values, or start a new run (without --resume, or with another --out)")


def test_every_shared_flag_that_may_change_is_a_flag():
    dests = set(vars(unet_darcy.parse_args([])))
    assert _common.MAY_CHANGE_ON_RESUME <= dests
    assert {"seed", "batch_size", "grid", "samples", "width", "depth"}.isdisjoint(_common.MAY_CHANGE_ON_RESUME)
