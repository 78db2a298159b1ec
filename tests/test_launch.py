"""The launcher and the demo, run as a user would (they start their own ranks)."""

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from physicsnemo_dp import RankError, launch

launch_module = importlib.import_module("physicsnemo_dp.launch")  # the package's `launch` attribute is the function

REPO_ROOT = Path(__file__).resolve().parents[1]


def _coordinates(mesh):
    return tuple(mesh.get_coordinate()), mesh.mesh_dim_names


def _raise_on_rank_one(mesh):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, which never comes


def _die_on_rank_one(mesh, how):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # the others are waiting here when rank 1 dies


def _raise_on_rank_one_while_others_return(mesh):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("deliberate failure on rank 1")
    return dist.get_rank()


def _print_and_return(mesh, value):
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} says hi")
    return value * (dist.get_rank() + 1)


def test_launch_returns_rank_zero_or_all_results(capfd):
    assert launch(_print_and_return, 3, args=(5,)) == 5
    assert launch(_print_and_return, 3, args=(5,), return_all=True) == [5, 10, 15]
    out = capfd.readouterr().out
    assert "[rank 2] rank 2 says hi" in out


def test_launch_builds_the_requested_mesh():
    coords = launch(_coordinates, 4, mesh_shape=(2, 2), return_all=True)
    assert [c for c, _ in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert coords[0][1] == ("ddp", "domain")


def test_failing_rank_surfaces_with_its_traceback_in_bounded_time():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank_one, 3, timeout=60)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "_raise_on_rank_one" in str(info.value)  # the rank's own traceback
    assert elapsed < 45, f"took {elapsed:.0f} s"


@pytest.mark.parametrize("how, status", [("exit", "exited with code 1 without raising"),
                                         ("signal", "was killed by signal SIGKILL")])
def test_the_rank_that_died_is_named_not_the_ranks_waiting_for_it(how, status):
    # Issue 14 item 13: the waiting ranks' "Connection closed by peer" errors reach the launcher before (or
    # about when) it sees rank 1 exit; the error must still name rank 1 and list the others as waiting.
    with pytest.raises(RankError) as info:
        launch(_die_on_rank_one, 3, args=(how,), timeout=60, echo=False)
    message = str(info.value)
    assert info.value.rank == 1, message
    assert f"rank 1 {status}" in message
    assert "ranks 0, 2 were waiting in a collective; their errors follow" in message
    assert "----- rank 0 -----" in message and "----- rank 2 -----" in message


def test_failure_is_raised_as_soon_as_every_rank_is_accounted_for(monkeypatch):
    # Issue 14 item 15: ranks 0 and 2 have returned when rank 1 raises: nothing is left to wait for.
    monkeypatch.setattr(launch_module, "_GRACE_SECONDS", 60.0)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank_one_while_others_return, 3, timeout=120, echo=False)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "were stopped" not in str(info.value)  # no rank was left unaccounted for
    assert elapsed < 30, f"took {elapsed:.1f} s: launch waited for the grace period"


_ORPHAN_SCRIPT = """
import os, subprocess, sys, time
from physicsnemo_dp import launch

def body(mesh, pid_dir):
    import torch.distributed as dist
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a rank's own worker
    path = os.path.join(pid_dir, f"rank{dist.get_rank()}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(path + ".tmp", path)
    time.sleep(300)

if __name__ == "__main__":
    launch(body, 2, args=(sys.argv[1],), timeout=600)
"""


def _still_running(processes):
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def test_killing_the_caller_leaves_no_process_behind(tmp_path):
    # Issue 14 item 14: SIGKILL the script while its ranks sleep; the fork server, the resource tracker,
    # the ranks and what the ranks started must all be gone within seconds.
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(_ORPHAN_SCRIPT))
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert caller.poll() is None, "the calling script ended before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        tree = psutil.Process(caller.pid).children(recursive=True)
        started = {int(pid) for r in range(2) for pid in (tmp_path / f"rank{r}").read_text().split()}
        assert started <= {p.pid for p in tree}, "the ranks are not in the caller's process tree"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 15
    while _still_running(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _still_running(tree)
    for pid in [int(line.split()[0]) for line in left]:  # do not leak them into the rest of the session
        os.kill(pid, signal.SIGKILL)
    assert not left, "still running after the caller was killed:\n" + "\n".join(left)


def test_launch_rejects_bad_mesh_shapes():
    with pytest.raises(ValueError, match="nprocs"):
        launch(_coordinates, 3, mesh_shape=(2, 2))


def test_demo_prints_match(monkeypatch, capfd):
    """``python -m physicsnemo_dp.demo``, run the way ``-m`` runs it (``runpy``, the module as ``__main__``, its
    argv), in this process: a fresh interpreter would only add its ``import torch`` (~5 s). A script's own
    interpreter starting ranks is ``test_killing_the_caller_leaves_no_process_behind`` and
    ``tests/examples/test_minimal.py::test_plain_python_starts_four_ranks``."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["demo", "--ranks", "3", "--rows", "8", "--cols", "5"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("physicsnemo_dp.demo", run_name="__main__", alter_sys=True)
    out, err = capfd.readouterr()
    assert exit_.value.code == 0, out + err
    assert "MATCH: the sharded computation equals the single-process result" in out, out + err


def test_ranks_start_again_when_their_group_cannot_form(monkeypatch, capfd):
    """The rendezvous port taken between picking and binding it: the ranks are started again on a new one."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # accepts connections and answers nothing: rank 0's store cannot bind, the others wait
    ports = iter([taken.getsockname()[1]])
    free_port = launch_module._free_port
    monkeypatch.setattr(launch_module, "_free_port", lambda: next(ports, None) or free_port())
    monkeypatch.setattr(launch_module, "_GRACE_SECONDS", 1.0)
    try:
        assert launch(_print_and_return, 2, args=(5,), timeout=120) == 5
    finally:
        taken.close()
    assert next(ports, "used") == "used"


def test_a_group_that_never_forms_is_reported_after_the_second_try(monkeypatch):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    tries = []
    monkeypatch.setattr(launch_module, "_free_port", lambda: tries.append(1) or taken.getsockname()[1])
    monkeypatch.setattr(launch_module, "_GRACE_SECONDS", 1.0)
    try:
        with pytest.raises(RankError, match="(?s)rank 0 failed.*init_process_group"):
            launch(_print_and_return, 2, args=(5,), timeout=120, echo=False)
    finally:
        taken.close()
    assert len(tries) == 2


class _BreakRankTwosJoin:
    """Unpickled by each rank before it joins: rank 2's first join then fails after its group formed.

    As gloo's full-mesh connection does on a loaded machine ("Connection closed by peer"); the other
    ranks' joins have succeeded by then. ``marker`` makes the second start of the ranks join normally.
    """

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (_break_rank_twos_join, (self.marker,))


def _break_rank_twos_join(marker):
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        original(*args, **kwargs)
        if dist.get_rank() == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("Gloo connectFullMesh failed with [...] Connection closed by peer (deliberate)")

    dist.init_process_group = init_process_group
    return marker


def _rank_or_raise_if_run_twice(mesh, marker, ran):
    import torch.distributed as dist

    Path(ran, str(dist.get_rank())).touch(exist_ok=False)  # fn runs once per rank in all, or this raises
    return dist.get_rank()


def test_a_rank_that_fails_to_join_after_the_others_joined_restarts_all_before_fn_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_module, "_GRACE_SECONDS", 5.0)
    ran = tmp_path / "ran"
    ran.mkdir()
    got = launch(_rank_or_raise_if_run_twice, 3, args=(_BreakRankTwosJoin(tmp_path / "broken"), str(ran)),
                 return_all=True, timeout=120, echo=False)  # fmt: skip
    assert got == [0, 1, 2] and (tmp_path / "broken").exists()
    assert sorted(p.name for p in ran.iterdir()) == ["0", "1", "2"]


def _time_out_on_one_then_die_on_two(mesh):
    import time as clock

    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise TimeoutError("timed out waiting for the sensor")  # its own timeout, not a collective's
    if dist.get_rank() == 2:
        clock.sleep(2)
        os._exit(3)
    return 0


def test_the_rank_that_failed_first_is_named_even_when_its_error_is_a_timeout():
    # Rank 1 raises a TimeoutError of its own; rank 2 dies 2 s later. A timeout is only "waiting on a peer"
    # when another rank failed or stopped before it, so rank 1 is the culprit and rank 2 also failed.
    with pytest.raises(RankError) as info:
        launch(_time_out_on_one_then_die_on_two, 3, timeout=120, echo=False)
    message = str(info.value)
    assert info.value.rank == 1, message
    assert "timed out waiting for the sensor" in message
    assert "rank 2 also failed" in message and "rank 2 exited with code 3" in message


def _stop_rank_two(mesh):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))  # ranks 0 and 1 wait here for rank 2
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the process state is read from /proc")
def test_a_stopped_rank_is_named_and_killed():
    start = time.monotonic()
    with pytest.raises(RankError) as info:  # a stopped rank may be continued: the run ends at its timeout
        launch(_stop_rank_two, 3, timeout=8, echo=False)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.rank == 2, message
    assert "rank 2 is stopped (SIGSTOP)" in message
    pid = int(message.split("rank 2 is stopped (SIGSTOP): process ")[1].split()[0])
    assert not psutil.pid_exists(pid), f"the stopped rank (process {pid}) outlived launch"
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_process_state_tells_stopped_running_and_gone_processes_apart():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if launch_module.process_state(os.getpid()) is None:
            pytest.skip("no /proc: the process state is unknown here")
        assert launch_module.process_state(child.pid) == "running"
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while launch_module.process_state(child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launch_module.process_state(child.pid) == "stopped"
        os.kill(child.pid, signal.SIGCONT)
        os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert launch_module.process_state(child.pid) == "gone"  # a zombie until reaped
    finally:
        child.kill()
        child.wait()
    assert launch_module.process_state(child.pid) == "gone"
