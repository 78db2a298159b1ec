"""Persistent pools of rank processes, and the job protocol between pytest and them.

Why pools: a fresh process pays several seconds to import torch and more to
join a process group; paying that per test and per rank would dominate the
suite. One pool per world size is started on first use and serves every test
of that size for the whole session.

Why forkserver: the fork server imports torch once; each worker is then a fork
of it and starts in a fraction of a second, without inheriting pytest's state
(threads, open files) the way a plain fork of pytest would.

Protocol: the test process sends the same :class:`Job` to every rank over its
pipe and waits for one :class:`Outcome` per rank. A pool whose job did not end
cleanly on every rank is stopped (its process group may be stuck in, or out of
step on, a collective) and started again by the next job.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

import torch

from . import worker
from .worker import Job, Outcome

REPO_ROOT = str(Path(__file__).resolve().parents[2])
DEFAULT_TIMEOUT = 60.0  # seconds a job may take on all ranks
DEFAULT_GRACE = 8.0  # seconds the other ranks get to finish after one rank failed
STARTUP_TIMEOUT = 120.0  # seconds for a whole pool to join its process group
COLLECTIVE_TIMEOUT = 300.0  # process-group timeout, a backstop behind the deadlines above
STOP_WAIT = 3.0  # seconds between SIGTERM and SIGKILL when stopping a pool
MAX_OUTPUT = 20_000  # characters of each rank's output kept in a report

_REPORT_ORDER = ("raised", "died", "unfinished", "skipped", "ok")  # causes first

_pools: dict[int, "Pool"] = {}


class RankFailure(Exception):
    """A job (or a pool's start-up) did not end with every rank replying ok or skipped."""

    def __init__(self, message: str, outcomes: list[Outcome]):
        super().__init__(message)
        self.outcomes = outcomes


def choose_backend(world_size: int) -> str:
    """``PDP_TEST_BACKEND`` if set; else nccl when there is a GPU per rank; else gloo."""
    if os.environ.get("PDP_TEST_BACKEND"):
        return os.environ["PDP_TEST_BACKEND"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def choose_device(backend: str) -> str:
    """Where ranks put their tensors: ``cpu`` or ``cuda``.

    ``PDP_TEST_DEVICE`` if set (``cpu`` or ``cuda``), else ``cuda`` with nccl and
    ``cpu`` with gloo. ``cuda`` with gloo puts several ranks on one GPU (rank ``r``
    on ``cuda:r % device_count``): the differential tests then run on CUDA
    tensors on a machine with fewer GPUs than ranks.
    """
    wanted = os.environ.get("PDP_TEST_DEVICE", "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"PDP_TEST_DEVICE={wanted!r}: expected cpu or cuda (or unset: cuda with nccl, else cpu)")
    if backend == "nccl":
        if wanted == "cpu":
            raise ValueError("PDP_TEST_DEVICE=cpu with the nccl backend: NCCL moves CUDA tensors only; "
                             "set PDP_TEST_BACKEND=gloo for CPU tensors, or PDP_TEST_DEVICE=cuda")
        return "cuda"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("PDP_TEST_DEVICE=cuda but torch.cuda.is_available() is False: "
                         "unset PDP_TEST_DEVICE (CPU tensors) or run on a machine with a GPU")
    return wanted or "cpu"


def get_pool(world_size: int) -> "Pool":
    """The session's pool for ``world_size`` (its processes start with its first job)."""
    if world_size not in _pools:
        backend = choose_backend(world_size)
        _pools[world_size] = Pool(world_size, backend, choose_device(backend))
    return _pools[world_size]


@atexit.register
def close_all() -> None:
    """Stop every pool; called at the end of the pytest session and again at exit."""
    for pool in _pools.values():
        pool.stop()


#: What the fork server imports once for every rank of the session: ``launch``'s list, then the third-party model
#: packages that rank bodies import (tests/graph, tests/spectral, tests/examples, the benchmark suite's
#: ``third_party``): ~0.6 s and ~0.7 s of CPU per rank otherwise, in every worker of every pool (again after each
#: restart) and every launched benchmark rank. A package that is not installed is passed over (the fork server
#: ignores an ImportError; the tests that need it skip).
PRELOAD = ["torch", "torch.distributed", "physicsnemo_dp", "torch_geometric", "neuralop"]


def _mp_context():
    """Forkserver with torch, the library and the optional model packages preloaded (POSIX only, like the rest of
    the harness).

    One fork server serves the whole session, ``physicsnemo_dp.launch``'s ranks included (the first to start it
    sets its preload): ``launch``'s list and the third-party packages of :data:`PRELOAD`, so every worker of every
    pool, and of every pool restarted after a failure, starts with them imported instead of importing them itself
    (~1.5 s per rank here for ``physicsnemo_dp``). The library reads its environment variables when called, not on
    import; importing the packages starts no thread (checked for ``torch_geometric`` and ``neuralop``).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


class Pool:
    """``world_size`` worker processes forming one process group."""

    def __init__(self, world_size: int, backend: str, device_type: str = "cpu"):
        self.world_size = world_size
        self.backend = backend
        self.device_type = "cuda" if backend == "nccl" else device_type
        self._processes: list = []
        self._conns: list = []
        self._lifeline = None  # write end of a pipe the workers watch: closing it ends them
        self._dir: str | None = None

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def start(self) -> None:
        """Start the workers and wait until all joined the process group (no-op if running)."""
        if self._processes:
            return
        if REPO_ROOT not in sys.path:  # workers import test modules as ``tests.…``
            sys.path.insert(0, REPO_ROOT)
        context = _mp_context()
        self._dir = tempfile.mkdtemp(prefix=f"pdp-pool{self.world_size}-")
        lifeline, self._lifeline = context.Pipe(duplex=False)
        try:
            for rank in range(self.world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=worker.main,
                    args=(child_end, lifeline, rank, self.world_size, self.backend, self.device_type,
                          os.path.join(self._dir, "store"), self._output_path(rank), COLLECTIVE_TIMEOUT),
                    name=f"pdp-rank{rank}-of-{self.world_size}",
                )
                process.start()
                child_end.close()
                self._processes.append(process)
                self._conns.append(parent_end)
            lifeline.close()
            outcomes = self._gather(STARTUP_TIMEOUT, DEFAULT_GRACE)
        except BaseException:
            self.stop()
            raise
        if any(outcome.status != "ok" for outcome in outcomes):
            self.stop()
            report = self._report(outcomes, STARTUP_TIMEOUT, DEFAULT_GRACE)
            raise RankFailure(f"pool start-up failed: {report}", outcomes)

    def run(self, job: Job, timeout: float = DEFAULT_TIMEOUT, grace: float = DEFAULT_GRACE) -> list[Outcome]:
        """Run ``job`` on every rank; return the outcomes or raise :class:`RankFailure`.

        Waits at most ``timeout`` seconds in all, and at most ``grace`` seconds
        after the first rank failed. On any failure the pool is stopped, and the
        next job starts a new one.
        """
        self.start()
        try:
            for conn in self._conns:
                try:
                    conn.send(job)
                except OSError:  # that worker died since the last job; _gather reports it
                    pass
            outcomes = self._gather(timeout, grace)
        except BaseException:  # Ctrl-C or pytest-timeout while ranks run: nothing is left running
            self.stop()
            raise
        if all(outcome.status in ("ok", "skipped") for outcome in outcomes):
            return outcomes
        self.stop()
        raise RankFailure(self._report(outcomes, timeout, grace), outcomes)

    def stop(self) -> None:
        """Terminate then kill every worker's process group; remove the pool's files."""
        processes, self._processes = self._processes, []
        for conn in [*self._conns, self._lifeline]:
            if conn is not None:
                conn.close()
        self._conns, self._lifeline = [], None
        for process in processes:
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.exitcode is None:
                _signal_group(process.pid, signal.SIGKILL)
                process.join()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _output_path(self, rank: int) -> str:
        return os.path.join(self._dir, f"rank{rank}.out")

    def _gather(self, timeout: float, grace: float) -> list[Outcome]:
        """One outcome per rank: its reply, ``died``, or ``unfinished`` at the deadline."""
        deadline = time.monotonic() + timeout
        outcomes: dict[int, Outcome] = {}
        waiting = {}
        for rank, (conn, process) in enumerate(zip(self._conns, self._processes)):
            waiting[conn] = waiting[process.sentinel] = rank
        while len(outcomes) < self.world_size and time.monotonic() < deadline:
            pending = [handle for handle, rank in waiting.items() if rank not in outcomes]
            for handle in wait(pending, max(0.0, deadline - time.monotonic())):
                rank = waiting[handle]
                if rank not in outcomes:
                    outcomes[rank] = self._receive(rank)
                    if outcomes[rank].status not in ("ok", "skipped"):
                        deadline = min(deadline, time.monotonic() + grace)
        unfinished = [rank for rank in range(self.world_size) if rank not in outcomes]
        self._dump_stacks(unfinished)
        for rank in unfinished:
            outcomes[rank] = Outcome(rank, "unfinished")
        for rank, outcome in outcomes.items():
            outcome.output = self._read_output(rank)
        return [outcomes[rank] for rank in range(self.world_size)]

    def _receive(self, rank: int) -> Outcome:
        conn, process = self._conns[rank], self._processes[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        process.join(STOP_WAIT)  # its pipe closed: the process is exiting
        return Outcome(rank, "died", detail=_describe_exit(process.exitcode))

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask hung ranks for their Python stacks (faulthandler writes them into their output)."""
        for rank in ranks:
            try:
                os.kill(self._processes[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if ranks:
            time.sleep(0.5)

    def _read_output(self, rank: int) -> str:
        try:
            text = Path(self._output_path(rank)).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        if len(text) > MAX_OUTPUT:
            return f"[... {len(text) - MAX_OUTPUT} characters cut ...]\n" + text[-MAX_OUTPUT:]
        return text

    def _report(self, outcomes: list[Outcome], timeout: float, grace: float) -> str:
        """Every rank's status, causes first and identical ones grouped, then every rank's output.

        The first line names the first cause: it is what pytest's short summary shows.
        """
        failed = [o.rank for o in outcomes if o.status in ("raised", "died")]
        groups: dict[tuple[str, str, str], list[int]] = {}
        for outcome in sorted(outcomes, key=lambda o: _REPORT_ORDER.index(o.status)):
            groups.setdefault((outcome.status, outcome.error, outcome.detail), []).append(outcome.rank)
        lines = []
        for (status, error, detail), ranks in groups.items():
            who = _names(ranks)
            if status == "ok":
                lines.append(f"{who} finished ok")
            elif status == "skipped":
                lines.append(f"{who} skipped: {detail}")
            elif status == "raised":
                lines.append(f"{who} raised {error}\n{_indent(detail)}")
            elif status == "died":
                lines.append(f"{who} died before replying: {detail}")
            elif failed:
                lines.append(f"{who} did not finish within {grace:g} s after {_names(failed)} failed "
                             f"(likely waiting in a collective); their stacks are in the output below")
            else:
                lines.append(f"{who} did not finish within the {timeout:g} s deadline; "
                             f"their stacks are in the output below")
        lines.append(f"(world size {self.world_size}, backend {self.backend}, device {self.device_type}: "
                     f"pool stopped, the next job starts a new one)")
        for outcome in outcomes:
            if outcome.output.strip():
                lines.append(f"----- rank {outcome.rank} output -----\n{outcome.output.rstrip()}")
        return "\n".join(lines)


def _signal_group(pid: int, sig: int) -> None:
    """Signal the worker's process group (the worker and its children), or the worker alone
    if it has not made its group yet."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "pipe closed but the process has not exited"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _names(ranks: list[int]) -> str:
    names = [f"rank {rank}" for rank in ranks]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
