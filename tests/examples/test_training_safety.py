"""Training loops that stop cleanly and say why (issue 14, items 8, 11, 12 and 16).

Every test runs ``examples/unet_darcy.py``'s whole run (``_common.fit``) on
harness ranks with a tiny grid, and injects the failure from the rank body:
NaN data on one rank, corrupt checkpoints, a rank that stops. On the loop
as it was before, the NaN runs trained on and saved NaN weights, ``--resume``
with nothing loadable started from step 0, and a stopped rank hung the job.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

import _common
import unet_darcy
from datapipes import InvalidValuesError

from . import EXAMPLES
from ._run import argv, context, on_layout

ROOT = EXAMPLES.parent
TINY = {"--grid": 20, "--samples": 16, "--test-samples": 2, "--width": 8, "--batch-size": 4, "--quiet": None,
        "--prefetch": 0}


def _poisoned(at_calls, rank: int):
    """``unet_darcy.loss_fn`` that writes a NaN into global rank ``rank``'s piece of the batch at the given calls."""
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if calls[0] in at_calls and dist.get_rank() == rank:
            batch["permeability"].to_local()[0, 0, 0] = float("nan")
        return unet_darcy.__dict__["_original_loss_fn"](model, batch)

    return loss_fn


def run_poisoned(ctx, out: str, options: dict, at_calls: tuple, rank: int) -> dict:
    """Rank body: the run with NaN data on ``rank`` at ``at_calls``; what happened, as plain data."""
    unet_darcy._original_loss_fn = unet_darcy.loss_fn
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(unet_darcy, "loss_fn", _poisoned(set(at_calls), rank))
            try:
                result = unet_darcy.run(argv(options, out), context(ctx, "ddp"))
            except _common.NonFiniteLossError as err:
                return {"error": str(err), "checkpoints": _checkpoints(out)}
    finally:
        del unet_darcy._original_loss_fn
    log = (Path(out) / "train.log").read_text() if ctx.rank == 0 else ""
    return {"losses": result["losses"], "checkpoints": _checkpoints(out), "log": log}


def _checkpoints(out) -> list[str]:
    folder = Path(out) / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


# --------------------------------------------------------------------------- #
# Item 12: a non-finite loss stops every rank (or skips the step), never saved
# --------------------------------------------------------------------------- #
@pytest.mark.timeout(300)
def test_nan_data_on_one_rank_stops_every_rank_before_the_step_is_saved(tmp_path):
    options = {**TINY, "--steps": 5, "--checkpoint-every": 1}
    # global rank 3 = (ddp 1, domain 1) on the (2, 2) mesh; its NaN reaches ddp rank 1's loss at step 3
    got = on_layout(__name__, "run_poisoned", (2, 2), out=tmp_path, options=options, at_calls=(3,), rank=3)
    error = got.get("error", "")
    assert error.startswith("step 3: the loss is not finite (nan) on ddp rank(s) [1] (--on-nonfinite stop)"), got
    assert "rank 3 (ddp 1, domain 1, samples [" in error and "non-finite values in ['permeability']" in error
    assert "rank 2 (ddp 1, domain 0, samples [" in error and "its data is finite" in error
    assert "nothing was saved for this step" in error
    assert got["checkpoints"] == ["step_00000001", "step_00000002"]  # no step 3, nothing after


@pytest.mark.timeout(300)
def test_skip_drops_the_step_and_gives_up_after_max_skips(tmp_path):
    options = {**TINY, "--steps": 4, "--checkpoint-every": 100, "--on-nonfinite": "skip"}
    once = on_layout(__name__, "run_poisoned", (2, 1), out=tmp_path / "once", options=options, at_calls=(2,), rank=1)
    assert len(once["losses"]) == 4 and all(math.isfinite(v) for v in once["losses"]), once
    assert "step 2: the loss is not finite (nan) on ddp rank(s) [1] (--on-nonfinite skip)" in once["log"]
    assert "skipped (1 in a row, at most 10)" in once["log"]
    assert once["checkpoints"] == ["step_00000004"]
    always = on_layout(__name__, "run_poisoned", (2, 1), out=tmp_path / "always",
                       options={**options, "--max-skips": 2}, at_calls=(2, 3, 4, 5), rank=1)
    assert "3 consecutive steps skipped (--max-skips)" in always.get("error", ""), always


# --------------------------------------------------------------------------- #
# Item 8: a NaN found by validation on one rank is raised on every rank
# --------------------------------------------------------------------------- #
def run_with_bad_file(ctx, out: str, options: dict) -> str:
    """Rank body: the training set on disk has a NaN in the last row of sample 5 (read by one rank only)."""
    import h5py

    train, _ = unet_darcy.prepare_data(unet_darcy.parse_args(argv(options, out)), Path(out).resolve())
    if ctx.rank == 0:
        with h5py.File(train, "r+") as f:
            f["pressure"][5, -1, 3] = float("nan")
    dist.barrier()
    with pytest.MonkeyPatch.context() as patch:  # statistics without validation: the pipe of fit finds it
        patch.setattr(unet_darcy, "DomainPipe", _validating(unet_darcy.DomainPipe))
        patch.setattr(unet_darcy, "compute_statistics", lambda *a, **k: _finite_statistics())
        with pytest.raises(InvalidValuesError) as raised:
            unet_darcy.run(argv(options, out), context(ctx, "ddp"))
    return str(raised.value)


def _validating(pipe_class):
    return lambda *args, **kwargs: pipe_class(*args, **{**kwargs, "validate": True})


def _finite_statistics():
    from datapipes import Statistics

    names = (unet_darcy.INPUT, unet_darcy.TARGET)
    return Statistics(*({n: v for n in names} for v in (1, 0.0, 1.0, -1.0, 1.0)))


@pytest.mark.timeout(300)
def test_invalid_values_on_one_rank_stop_every_rank_with_the_same_error(tmp_path):
    options = {**TINY, "--steps": 8, "--checkpoint-every": 100}
    message = on_layout(__name__, "run_with_bad_file", (2, 2), out=tmp_path, options=options)
    assert "variable 'pressure' of sample 5" in message and "darcy_20_train_n16_seed0.h5" in message
    assert "read by rank 3 (ddp 1, domain 1)" in message or "read by rank 1 (ddp 0, domain 1)" in message


# --------------------------------------------------------------------------- #
# Item 11: --resume fails when nothing loads, unless --resume auto
# --------------------------------------------------------------------------- #
def resume(ctx, out: str, options: dict, corrupt: bool) -> dict:
    """Rank body: train 2 steps (2 checkpoints), optionally corrupt both, then resume three ways."""
    unet_darcy.run(argv({**options, "--steps": 2}, out), context(ctx, "ddp"))
    if corrupt and ctx.rank == 0:
        for folder in (Path(out) / "checkpoints").iterdir():
            biggest = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            biggest.write_bytes(biggest.read_bytes()[:-7])  # truncated: the manifest no longer matches
    dist.barrier()
    results = {}
    with pytest.raises(SystemExit) as failed:
        unet_darcy.run(argv({**options, "--steps": 3, "--resume": "latest"}, out), context(ctx, "ddp"))
    results["latest"] = str(failed.value.code)
    auto = unet_darcy.run(argv({**options, "--steps": 3, "--resume": "auto"}, out), context(ctx, "ddp"))
    results["auto_steps"] = len(auto["losses"])
    results["log"] = (Path(out) / "train.log").read_text() if ctx.rank == 0 else ""
    return results


@pytest.mark.timeout(300)
def test_resume_latest_fails_when_no_checkpoint_loads_and_auto_starts_fresh(tmp_path):
    options = {**TINY, "--checkpoint-every": 1}
    got = on_layout(__name__, "resume", (2, 1), out=tmp_path, options=options, corrupt=True)
    assert got["latest"].startswith(f"--resume latest: no loadable checkpoint in {tmp_path / 'checkpoints'}"), got
    for step in ("step_00000001", "step_00000002"):  # each rejected candidate is named, with the reason
        assert step in got["latest"], got["latest"]
    assert "--resume auto" in got["latest"]
    assert got["auto_steps"] == 3  # started from step 0
    assert "--resume auto: no loadable checkpoint" in got["log"]


def test_resume_and_timeout_flags():
    args = unet_darcy.parse_args([])
    assert (args.resume, args.timeout, args.on_nonfinite, args.max_skips) == (None, 600.0, "stop", 10)
    assert unet_darcy.parse_args(["--resume"]).resume == "latest"
    assert unet_darcy.parse_args(["--resume", "auto", "--timeout", "30"]).timeout == 30.0
    with pytest.raises(SystemExit):
        unet_darcy.parse_args(["--timeout", "0"])


# --------------------------------------------------------------------------- #
# Item 16: a rank that stops is reported (step, rank) and the job ends
# --------------------------------------------------------------------------- #
STALL_RANK, TIMEOUT = 2, 10


def _start_stalled_job(tmp_path, step: int, options: dict) -> subprocess.Popen:
    """3 ranks of unet_darcy under torchrun; rank 2 SIGSTOPs itself in ``step``."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(EXAMPLES), env.get("PYTHONPATH")]))
    flags = argv({**TINY, "--checkpoint-every": 100, "--batch-size": 3, "--test-samples": 3, **options}, tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               str(Path(__file__).with_name("_stall.py")), str(step), str(STALL_RANK), *flags]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _kill_tree(job: subprocess.Popen) -> None:
    """Kill a job still running, with its ranks: torchrun starts each rank in a session of its own, so the tree, not
    a process group."""
    if job.poll() is None:
        try:
            torchrun = psutil.Process(job.pid)
            tree = [torchrun, *torchrun.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        job.wait()


def _finish_stalled_job(job: subprocess.Popen) -> tuple[int, str, str, float, float]:
    """Wait for the job: (status, stdout, stderr, when rank 2 stopped, when the job ended)."""
    try:
        stdout, stderr = job.communicate(timeout=300)
        ended = time.time()
    finally:  # whatever happened: nothing of this job (e.g. a still stopped rank) outlives the test
        _kill_tree(job)
    stopped_at = [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("stalling rank")]
    assert job.returncode != 0 and stopped_at, stdout[-3000:] + stderr[-5000:]
    return job.returncode, stdout, stderr, stopped_at[0], ended


#: The two stalled torchrun jobs below (--timeout, and the adaptive bound) run at the same time: most of each job is
#: waiting (starting ranks, then the watchdog's bound after the stop), so together they take little more than one.
_JOBS = {"timeout": (3, {"--steps": 6, "--timeout": TIMEOUT}), "adaptive": (5, {"--steps": 8, "--stall-floor": 5})}


class StalledJobs:
    """Both jobs, started together, each waited for on a thread of its own (its end time taken when it ends).

    ``tests/conftest.py`` starts them when collection ends if a test of theirs is selected and other tests run
    before this module: the ~10 s each job spends waiting on its timeout then passes beside those tests instead of
    adding to the run. Otherwise the ``stalled_jobs`` fixture starts them when its first test needs them.
    """

    def __init__(self, folder: Path):
        import concurrent.futures

        self.folder = folder
        self._jobs, self._futures = {}, {}
        self._pool = concurrent.futures.ThreadPoolExecutor(len(_JOBS))
        try:
            for name, (step, options) in _JOBS.items():
                (folder / f"stall_{name}").mkdir(parents=True)
                self._jobs[name] = _start_stalled_job(folder / f"stall_{name}", step, options)
                self._futures[name] = self._pool.submit(_finish_stalled_job, self._jobs[name])
        except BaseException:
            self.close(kill=True)
            raise

    def results(self) -> dict:
        """Each job's ``_finish_stalled_job`` result, or the exception it raised (raised by the test that reads it)."""
        return {name: future.exception() or future.result() for name, future in self._futures.items()}

    def close(self, kill: bool = False) -> None:
        """Wait for the jobs' threads, after ending the jobs if ``kill`` (no test will read them); remove the
        jobs' folders. Each thread kills its job's tree if the job outlives its own timeout."""
        import shutil

        if kill:
            for job in self._jobs.values():
                _kill_tree(job)
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.folder, ignore_errors=True)


#: Started by ``tests/conftest.py`` when collection ends (see :class:`StalledJobs`); None otherwise.
EARLY: StalledJobs | None = None


def start_early() -> None:
    global EARLY
    import tempfile

    if EARLY is None:
        EARLY = StalledJobs(Path(tempfile.mkdtemp(prefix="pdp-stalled-jobs-")))


def stop_early(kill: bool = True) -> None:
    """End the early jobs: at session end (``kill``: no test read them, e.g. an interrupted session), or once read."""
    global EARLY
    if EARLY is not None:
        EARLY, early = None, EARLY
        early.close(kill=kill)


@pytest.fixture(scope="module")
def stalled_jobs(tmp_path_factory):
    """Both jobs' results; each test reads its own (a failure is raised by the test that reads it)."""
    jobs = EARLY or StalledJobs(tmp_path_factory.mktemp("stalled"))
    try:
        return jobs.results()
    finally:
        if jobs is EARLY:
            stop_early(kill=False)
        else:
            jobs.close()


def _stalled_job(stalled_jobs, name: str) -> tuple[int, str, str, float, float]:
    got = stalled_jobs[name]
    if isinstance(got, BaseException):
        raise got
    return got


@pytest.mark.timeout(400)
def test_a_stopped_rank_ends_the_torchrun_job_naming_the_step_and_the_rank(stalled_jobs):
    # Step 3 is the first step measured (steps 1 and 2 are warm-up): no adaptive bound yet, --timeout ends it.
    _, _, stderr, stopped_at, ended = _stalled_job(stalled_jobs, "timeout")
    assert f"step 3 did not finish within --timeout {TIMEOUT:g} s; ranks that did not arrive: [{STALL_RANK}]" \
        in stderr, stderr[-5000:]
    assert f"rank {STALL_RANK}: STOPPED (SIGSTOP)" in stderr and "rank 0: waiting (step 3" in stderr
    assert ended - stopped_at < TIMEOUT + 25, "the job did not end soon after the timeout"


@pytest.mark.timeout(400)
def test_the_default_watchdog_ends_a_job_with_a_stopped_rank_within_its_adaptive_bound(stalled_jobs):
    # No --timeout (600 s): the adaptive bound (5 x the slowest of steps 3 and 4, at least --stall-floor 5 s)
    # ends the job. Before it, the job hung silently until --timeout.
    _, stdout, stderr, stopped_at, ended = _stalled_job(stalled_jobs, "adaptive")
    ended -= stopped_at
    assert f"step 5: rank {STALL_RANK} is stopped (SIGSTOP). The step has lasted" in stderr, stderr[-5000:]
    assert f"ranks that did not arrive: [{STALL_RANK}]" in stderr
    assert "at least --stall-floor 5 s, at most --timeout 600 s" in stderr
    assert f"rank {STALL_RANK}: STOPPED (SIGSTOP)" in stderr
    assert "watchdog: a step lasting over" in stdout  # the bound, logged once set
    assert ended < 90, f"the job ended {ended:.0f} s after the stop"


def run_with_a_slow_rank(ctx, out: str, options: dict, step: int, seconds: float) -> str:
    """Rank body: global rank 1 sleeps ``seconds`` in ``step``'s forward, past the watchdog's bound; the log."""
    calls = [0]
    original = unet_darcy.loss_fn

    def slow(model, batch):
        calls[0] += 1
        if calls[0] == step and dist.get_rank() == 1:
            time.sleep(seconds)
        return original(model, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unet_darcy, "loss_fn", slow)
        patch.setattr(_common, "STALL_FACTOR", 1.0)  # a bound of 1 s (the floor) at these step times
        result = unet_darcy.run(argv(options, out), context(ctx, "ddp"))
    assert len(result["losses"]) == options["--steps"]
    return (Path(out) / "train.log").read_text() if ctx.rank == 0 else ""


@pytest.mark.timeout(300)
def test_a_slow_rank_is_waited_for_not_killed(tmp_path):
    options = {**TINY, "--steps": 5, "--checkpoint-every": 100, "--stall-floor": 1}
    log = on_layout(__name__, "run_with_a_slow_rank", (2, 1), out=tmp_path, options=options, step=4, seconds=8)
    assert "watchdog: a step lasting over" in log, log
    assert "watchdog: step 4's step has lasted" in log and "but no rank is stopped or dead: waiting" in log, log
    assert "final loss" in log


def test_the_adaptive_bound_leaves_out_warm_up_and_measures_checkpoints_apart():
    bound = _common._StallBound(timeout=600, floor=5, factor=5, warmup=2, recent=3)
    assert bound.bound("step") is None and bound.bound("checkpoint") is None  # only --timeout, until measured
    assert not bound.record("step", 100.0) and not bound.record("step", 50.0)  # compile, warm-up: not counted
    assert bound.bound("step") is None
    assert bound.record("step", 0.5)  # the first measured step sets the bound
    assert bound.bound("step") == 5  # the floor: 5 x 0.5 s is less
    assert not bound.record("step", 2.0)
    assert bound.bound("step") == 10
    assert bound.bound("checkpoint") is None  # a step's time says nothing of a checkpoint write
    assert bound.record("checkpoint", 30.0)
    assert bound.bound("checkpoint") == 150 and bound.bound("step") == 10
    for _ in range(3):  # only the last `recent` steps count
        bound.record("step", 0.1)
    assert bound.bound("step") == 5
    bound.record("checkpoint", 500.0)
    assert bound.bound("checkpoint") == 600  # never above --timeout
    assert "5 x the slowest of the last 3 step(s)" in bound.describe("step")


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "-1", "0", "ten"])
def test_timeout_refuses_what_is_not_a_finite_number_of_seconds(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        unet_darcy.parse_args(["--timeout", value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --timeout: must be a finite number of seconds, more than 0 and at most 604800 (a week), " \
        f"got '{value}'" in error, error
    assert unet_darcy.parse_args(["--timeout", "604800"]).timeout == 604800
    assert unet_darcy.parse_args([]).stall_floor == _common.STALL_FLOOR == 60


def test_the_watchdog_ends_the_job_for_stopped_or_dead_ranks_only(tmp_path):
    """The verdicts behind the adaptive bound: facts about processes, never slowness (no process group needed)."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("the process state is read from /proc")
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _common.process_state(stopped.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        watchdog = object.__new__(_common.StepWatchdog)
        watchdog.rank, watchdog.world, watchdog._space = 0, 6, _common._process_space()
        here, there = watchdog._space, "another host"

        def at(step, beat, pid=os.getpid(), space=here):
            return {"step": step, "phase": "forward and backward", "beat": beat, "pid": pid, "space": space}

        first = {0: at(5, 1), 1: at(5, 1, stopped.pid), 2: at(5, 1, dead.pid), 3: at(5, 1), 4: at(5, 7, space=there),
                 5: at(4, 3, space=there)}
        last = {**first, 0: at(5, 4), 5: at(4, 4, space=there)}  # rank 3: alive here, heartbeat still
        verdicts = watchdog._verdicts(5, first, last, hard=False, earlier={})
        assert {r: (v.state, v.culprit, v.kill) for r, v in verdicts.items()} == {
            0: ("waiting", False, False),
            1: ("STOPPED (SIGSTOP)", True, True),  # killed: a stopped process ignores the launcher's SIGTERM
            2: ("EXITED", True, False),
            3: ("alive, heartbeat stopped (C code holding the GIL?)", False, False),  # slow, not stopped
            4: ("heartbeat stopped (looking again later)", False, False),  # another host: not yet
            5: ("did not arrive", False, False),  # behind, but its heartbeat moves
        }
        again = watchdog._verdicts(5, first, last, hard=False, earlier={4: 7})
        assert (again[4].state, again[4].culprit, again[4].kill) == ("NOT RESPONDING", True, False)  # a bound later
        hard = watchdog._verdicts(5, first, last, hard=True)  # --timeout: whoever did not arrive
        assert [r for r, v in hard.items() if v.culprit] == [1, 2, 3, 4, 5]
    finally:
        stopped.kill()
        stopped.wait()
