"""Start several ranks from a script or a notebook and run one function on each.

Domain parallelism needs several processes; a notebook or a plain script is
one. :func:`launch` starts ``nprocs`` ranks, gives each a process group and a
device mesh, runs ``fn(mesh, *args, **kwargs)`` on every rank and returns rank
0's result (or every rank's). Ranks' printed output is streamed back with a
``[rank r]`` prefix, so it shows up in the notebook cell.

What the launcher guarantees:

* A failing rank never leaves the caller hanging. ``launch`` returns or raises
  as soon as every rank is accounted for (returned, raised or exited); only
  while some ranks are still running after a failure does it wait, for a short
  grace period (they may be blocked in a collective the failed rank never
  reached). A global ``timeout`` bounds the whole run.
* :class:`RankError` names the rank whose failure came first and caused the
  others: a rank that died (exit code or signal, no exception), raised an
  error of its own, or is stopped (SIGSTOP: the process state, where
  ``/proc`` shows it), not a rank whose collective merely broke because a
  peer died, nor one that timed out after another rank had failed or
  stopped. Ranks of that second kind are listed as waiting, with their
  errors. Failures are ordered by when they happened: a rank stamps its
  error with its wall-clock time, the launcher stamps exits and stops when
  it sees them.
* No process outlives the call: on return, on an exception, on Ctrl-C, and
  when the calling process itself is killed (even by SIGKILL), every rank and
  every process a rank started is stopped (a stopped rank is killed at
  once); the fork server and resource tracker that multiprocessing started
  then exit on their own.

Functions are shipped with ``cloudpickle`` so that functions defined in a
notebook cell work; ranks start from a fork server that has already imported
torch, so only the first launch pays for the import. POSIX only (forkserver).
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, NamedTuple, Sequence

__all__ = ["launch", "RankError", "process_state"]

_GRACE_SECONDS = 10.0  # how long ranks still running may take after another rank failed
_STOP_WAIT = 5.0  # seconds ranks get to end by themselves before the launcher kills them
_POLL = 1.0  # seconds between looks at the ranks' process states (is one stopped?)
# Lower-case fragments of the messages of a collective (or the store) that broke because a peer died or gave
# up (gloo, NCCL, TCPStore): a rank raising one of these was waiting for another rank, not the cause.
_PEER_FAILURES = (
    "connection reset by peer",
    "connection closed by peer",
    "connection was likely closed",
    "broken pipe",
    "communicator was aborted",
)
# Fragments of a timeout's message. A timeout is waiting on a peer only if another rank failed or stopped first:
# a rank that times out before anything else went wrong raised an error of its own.
_TIMEOUTS = ("timed out", "timeout")


class RankError(RuntimeError):
    """A rank raised, died or stopped; the message holds its traceback (or state) and what the other ranks did."""

    def __init__(self, rank: int, detail: str, others: str = "") -> None:
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}{others}")


def process_state(pid: int) -> str | None:
    """``"stopped"``, ``"gone"``, ``"running"``, or None where the state cannot be read (no ``/proc``).

    ``"stopped"`` is state ``T`` of ``/proc/<pid>/stat``: stopped by a signal
    (SIGSTOP, SIGTSTP), which no timeout or SIGTERM ends. A process stopped by
    a debugger (``t``, tracing stop) counts as running: someone is looking at
    it. ``"gone"``: no such process, or one that exited and was not reaped
    yet (a zombie). Used by :func:`launch` and by the training examples'
    watchdog to tell a rank that is stopped or dead from one that is slow.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone" if os.path.isdir("/proc/self") else None
    except OSError:
        return None
    state = stat[stat.rindex(b")") + 2:][:1]  # after "pid (comm) "; comm may hold spaces and parentheses
    return "stopped" if state == b"T" else "gone" if state in (b"Z", b"X", b"x") else "running"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Channel:
    """A rank's end of its pipe to the launcher; the lock keeps messages sent from several threads whole."""

    def __init__(self, conn) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            self._conn.send(message)


class _Stream(io.TextIOBase):
    """File-like object that forwards whole lines to the launcher, which adds the rank prefix."""

    def __init__(self, channel: _Channel, kind: str) -> None:
        self._channel, self._kind, self._buf = channel, kind, ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._channel.send(("out", self._kind, line))
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self._channel.send(("out", self._kind, self._buf))
            self._buf = ""


def _to_cpu(value):
    import torch
    from ._torch_compat import pytree

    def move(x):
        if isinstance(x, torch.Tensor):
            from .shard_tensor import ShardTensor

            if isinstance(x, ShardTensor):
                raise TypeError("return x.full_tensor() or x.to_local() from a launched function, not a ShardTensor")
            return x.detach().cpu()
        return x

    return pytree.tree_map(move, value)


def _die_with_launcher(lifeline) -> None:
    """Make this rank, and every process it starts, end when the launching process ends or lets go.

    Why not ``PR_SET_PDEATHSIG``: a rank is a child of multiprocessing's fork
    server, not of the caller, and every rank holds the fork server's "alive"
    pipe open, so the fork server outlives a killed caller exactly as long as
    the ranks do; a parent-death signal would never fire. Instead ``lifeline``
    is the read end of a pipe whose write end only the caller holds: it reads
    EOF when the caller exits in any way (even SIGKILL) or closes it when
    ``launch`` ends. A daemon thread waits for that and kills this rank's
    process group, which holds the rank and whatever it started, wherever the
    main thread is stuck (collectives and sleeps release the GIL). Nothing
    here is Linux-specific. With the ranks gone, the fork server and the
    resource tracker read EOF on their own pipes and exit.

    The rank leads its own process group, so Ctrl-C at a terminal reaches only
    the caller, which then stops the ranks in order.
    """
    os.setpgrp()

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="launch-lifeline", daemon=True).start()


def _waiting_on_a_peer(exc: BaseException) -> str | None:
    """``"peer"``: a collective that broke because another rank died or gave up; ``"timeout"``: a timeout.

    A timeout may be a collective that waited for a rank that stopped or
    failed, or an error of the rank's own; the launcher tells them apart by
    what happened first (see :func:`_culprit`).
    """
    if not isinstance(exc, (RuntimeError, TimeoutError)):
        return None
    message = str(exc).lower()
    if any(p in message for p in _PEER_FAILURES):
        return "peer"
    return "timeout" if isinstance(exc, TimeoutError) or any(t in message for t in _TIMEOUTS) else None


def _rank_main(rank, world, port, backend, mesh_shape, mesh_names, payload, conn, lifeline, timeout_s):
    _die_with_launcher(lifeline)
    import cloudpickle
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    channel = _Channel(conn)
    channel.send(("started",))
    out, err = _Stream(channel, "stdout"), _Stream(channel, "stderr")
    sys.stdout, sys.stderr = out, err
    joining = True
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        device_type = "cpu" if backend == "gloo" else "cuda"
        if device_type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:  # one thread pool per core, not per rank: ranks share the CPU
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        mesh = init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=tuple(mesh_names))
        # no rank runs fn before every rank has joined: a failed join leaves nothing run
        dist.barrier(device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None)
        joining = False
        outcome = ("result", cloudpickle.dumps(_to_cpu(fn(mesh, *args, **kwargs))))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        outcome = ("error", time.time(), traceback.format_exc(), _waiting_on_a_peer(exc), joining)
    out.flush()  # output first: the launcher may stop this rank as soon as it has the outcome
    err.flush()
    channel.send(outcome)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is ending anyway
        pass


def _default_backend(nprocs: int) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def launch(
    fn: Callable[..., Any],
    nprocs: int = 4,
    *,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    backend: str | None = None,
    timeout: float = 600.0,
    return_all: bool = False,
    echo: bool = True,
):
    """Run ``fn(mesh, *args, **kwargs)`` on ``nprocs`` ranks and return rank 0's result.

    Args:
        fn: the function each rank runs; its first argument is the DeviceMesh.
        nprocs: number of ranks.
        mesh_shape: mesh shape (default ``(nprocs,)``); its product must be ``nprocs``.
        mesh_dim_names: default ``("domain",)`` for 1-D and ``("ddp", "domain")`` for 2-D meshes.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank); default picks
            nccl when enough GPUs are visible, else gloo.
        timeout: seconds for the whole run before every rank is stopped.
        return_all: return the list of every rank's result instead of rank 0's.
        echo: print ranks' output (prefixed with ``[rank r]``) as it arrives.

    If the ranks fail while forming their process group (before ``fn``
    runs anywhere: say the rendezvous port was taken), they are started
    once more on a new port.

    Raises:
        RankError: a rank raised, died or is stopped (SIGSTOP); ``.rank`` is
            the rank that failed first, the message carries its traceback
            (or exit status, or "rank r is stopped (SIGSTOP)") and the errors
            of the ranks that were waiting for it. A rank still stopped when
            the run ends is named even when the run ended at ``timeout``.
        TimeoutError: the run did not finish within ``timeout``, and no rank
            failed or is stopped.
    """
    import cloudpickle

    mesh_shape = tuple(mesh_shape) if mesh_shape is not None else (nprocs,)
    if mesh_dim_names is None:
        mesh_dim_names = ("domain",) if len(mesh_shape) == 1 else ("ddp", "domain") if len(mesh_shape) == 2 else None
    if mesh_dim_names is None or len(mesh_dim_names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names must name each of the {len(mesh_shape)} mesh dims")
    size = 1
    for n in mesh_shape:
        size *= n
    if size != nprocs:
        raise ValueError(f"mesh_shape {mesh_shape} has {size} ranks but nprocs={nprocs}")
    backend = backend or _default_backend(nprocs)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))

    for attempt in range(_JOIN_ATTEMPTS):
        try:
            return _run_once(nprocs, payload, backend, mesh_shape, mesh_dim_names, timeout, return_all, echo)
        except _NotJoined as failed:
            if attempt + 1 == _JOIN_ATTEMPTS:
                raise failed.error from None


#: Tries to form the process group. The rendezvous port is picked free, closed, then bound by rank 0's
#: store; another process can take it in between, or a gloo connection of the full mesh can be refused
#: ("Connection closed by peer" while joining, seen on a loaded machine). The ranks pass a barrier before
#: the caller's function, so a rank that fails to join makes the others fail while joining too: nothing of
#: the function has run anywhere then, and the ranks are started again on a new port.
_JOIN_ATTEMPTS = 2


class _NotJoined(Exception):
    """Every failure happened while the ranks formed their process group: safe to start again."""

    def __init__(self, error: RankError) -> None:
        self.error = error


def _run_once(nprocs, payload, backend, mesh_shape, mesh_dim_names, timeout, return_all, echo):
    """Start the ranks once, on a fresh port; return :func:`_collect`'s result."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "physicsnemo_dp"])
    port = _free_port()
    lifeline_r, lifeline_w = ctx.Pipe(duplex=False)  # only this process holds the write end
    procs, conns = [], []
    try:
        for r in range(nprocs):
            conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(r, nprocs, port, backend, mesh_shape, mesh_dim_names, payload, child_conn, lifeline_r, timeout),
                daemon=False,  # ranks may start their own workers (e.g. a datapipe reader); _stop ends them
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(conn)
        lifeline_r.close()
        return _collect(procs, conns, timeout, return_all, echo)
    finally:
        lifeline_r.close()
        _stop(procs, lifeline_w)
        for conn in conns:
            conn.close()


def _stop(procs, lifeline) -> None:
    """End every rank and the processes it started.

    Closing the lifeline makes each rank kill its own process group (see
    :func:`_die_with_launcher`); a rank still there after ``_STOP_WAIT`` (its
    watcher thread could not run, or it had not started it yet) is killed from
    here, with its group. A stopped rank cannot run its watcher: it is killed
    at once.
    """
    lifeline.close()
    for p in procs:
        if p.exitcode is None and process_state(p.pid) == "stopped":
            _kill(p)
    deadline = time.monotonic() + _STOP_WAIT
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            _kill(p)


def _kill(p) -> None:
    """SIGKILL rank process ``p`` with its process group, and reap it."""
    for kill in (os.killpg, os.kill):  # os.kill: the rank has not made its group yet
        try:
            kill(p.pid, signal.SIGKILL)
            break
        except ProcessLookupError:
            continue
    p.join()


class _Failure(NamedTuple):
    when: float  # time.time(): the rank's clock when it raised, or the launcher's when it saw the exit or the stop
    detail: str  # the traceback, or how the process ended
    waiting: str | None  # "peer": a collective broken by a peer's failure; "timeout": a timeout; None: its own
    joining: bool = False  # raised while forming the process group, before the function ran


def _collect(procs, conns, timeout, return_all, echo):
    """Gather every rank's outcome; return the results or raise for the failure that came first.

    Waits on each rank's pipe and on its process at once, so an exit is seen
    as promptly as an error report, and stops as soon as every rank has
    returned, raised or exited; after the first failure, ranks still running
    get ``_GRACE_SECONDS`` more. Every ``_POLL`` seconds it also reads the
    running ranks' process states: when a rank is first seen stopped is its
    time of failure, should the run not finish (a stopped rank may be
    continued, so it alone does not end the run).
    """
    import cloudpickle

    nprocs = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    stopped: dict[int, float] = {}  # rank -> time.time() when first seen stopped (and not continued since)
    started: set[int] = set()
    open_conns = set(conns)
    owner = {}
    for r, (conn, p) in enumerate(zip(conns, procs)):
        owner[conn] = owner[p.sentinel] = r
    deadline = time.monotonic() + timeout
    grace_end = float("inf")

    def unaccounted() -> list[int]:
        return [r for r in range(nprocs) if r not in results and r not in failures]

    def receive(r: int) -> None:
        """Handle whatever rank ``r`` has sent so far."""
        conn = conns[r]
        while conn in open_conns and conn.poll():
            try:
                kind, *rest = conn.recv()
            except (EOFError, OSError):
                open_conns.discard(conn)
                return
            if kind == "started":
                started.add(r)
            elif kind == "out":
                if echo:
                    print(f"[rank {r}] {rest[1]}", file=sys.stdout if rest[0] == "stdout" else sys.stderr, flush=True)
            elif kind == "result":
                results[r] = cloudpickle.loads(rest[0])
            else:
                failures[r] = _Failure(*rest)

    next_look = 0.0

    def look_for_stopped(now: float) -> None:
        """Every ``_POLL`` seconds (output can wake the loop far more often): which running ranks are stopped."""
        nonlocal next_look
        if now < next_look:
            return
        next_look = now + _POLL
        for r in unaccounted():
            if process_state(procs[r].pid) == "stopped":
                stopped.setdefault(r, time.time() - _POLL)  # it stopped at most one poll before it was seen
            else:
                stopped.pop(r, None)

    while unaccounted():
        now = time.monotonic()
        if now >= min(deadline, grace_end):
            break
        pending = unaccounted()
        handles = [conns[r] for r in pending if conns[r] in open_conns] + [procs[r].sentinel for r in pending]
        for handle in wait(handles, min(deadline, grace_end, now + _POLL) - now):
            r = owner[handle]
            receive(r)  # for an exit too: whatever the rank sent before it died is in its pipe
            if handle == procs[r].sentinel and r not in results and r not in failures:
                failures[r] = _Failure(time.time(), _describe_exit(r, procs[r].exitcode, r in started), None)
        look_for_stopped(time.monotonic())
        if failures and grace_end == float("inf"):
            grace_end = time.monotonic() + _GRACE_SECONDS
    timed_out = time.monotonic() >= deadline
    look_for_stopped(math.inf)
    for r, when in stopped.items():
        if r not in failures and r not in results:
            failures[r] = _Failure(when, _describe_stop(r, procs[r].pid, when), None)
    if failures:
        error = _rank_error(failures, unaccounted(), timed_out=timed_out, timeout=timeout)
        if not results and all(f.joining for f in failures.values()):
            raise _NotJoined(error)
        raise error
    if unaccounted():
        raise TimeoutError(f"ranks {unaccounted()} did not finish within {timeout:.0f} s; all ranks were stopped")
    return [results[r] for r in range(nprocs)] if return_all else results[0]


def _describe_stop(rank: int, pid: int, when: float) -> str:
    return (f"rank {rank} is stopped (SIGSTOP): process {pid} was in state T (stopped by a signal) since "
            f"{time.strftime('%H:%M:%S', time.localtime(when))} and did not continue; the launcher killed it")


def _describe_exit(rank: int, code: int, started: bool) -> str:
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if not started:
        return (
            f"rank {rank} {how} before running your function. If you launch from a script, guard the call "
            "with `if __name__ == '__main__':` (new processes re-import the main module)."
        )
    return f"rank {rank} {how} without raising or returning a result"


def _rank_error(failures: dict[int, _Failure], unfinished: list[int], timed_out: bool, timeout: float) -> RankError:
    """The error for the culprit (:func:`_culprit`), listing the ranks that were waiting for it and the rest."""
    first = _culprit(failures)
    waiting = sorted(r for r in failures if r != first and _excused(r, failures))
    others = sorted(r for r in failures if r != first and r not in waiting)
    text = ""
    if waiting:
        verb, errors = ("was", "its error follows") if len(waiting) == 1 else ("were", "their errors follow")
        text += f"\n\n{_names(waiting)} {verb} waiting in a collective; {errors}:{_details(failures, waiting)}"
    if others:
        text += f"\n\n{_names(others)} also failed:{_details(failures, others)}"
    if unfinished:
        when = f"within the {timeout:.0f} s timeout" if timed_out else f"{_GRACE_SECONDS:.0f} s after rank {first} failed"
        text += (
            f"\n\n({_names(unfinished)} had not finished {when} — probably waiting in a collective "
            f"rank {first} never reached — and were stopped)"
        )
    return RankError(first, failures[first].detail, text)


def _culprit(failures: dict[int, _Failure]) -> int:
    """The rank whose failure came first among those that are not a consequence of another's (:func:`_excused`).

    Only if every failure is a consequence (say, every rank timed out at
    once) does the earliest of them count.
    """
    roots = [r for r in failures if not _excused(r, failures)] or list(failures)
    return min(roots, key=lambda r: (failures[r].when, r))


def _excused(rank: int, failures: dict[int, _Failure]) -> bool:
    """Whether rank ``rank``'s failure was caused by another rank's.

    A collective broken by a peer ("Connection closed by peer", ...) is,
    whenever any other rank failed: the dead peer's exit can reach the
    launcher after the broken collective's report. A timeout is only when
    another rank failed or stopped before it (a rank that times out first
    raised an error of its own, even if a peer dies later); exits and stops
    are stamped when the launcher saw them, so they are at most as early as
    they really were.
    """
    mine = failures[rank]
    if mine.waiting == "peer":
        return len(failures) > 1
    if mine.waiting == "timeout":
        return any(r != rank and f.when < mine.when for r, f in failures.items())
    return False


def _details(failures: dict[int, _Failure], ranks: list[int]) -> str:
    return "".join(f"\n----- rank {r} -----\n{failures[r].detail.rstrip()}" for r in ranks)


def _names(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
