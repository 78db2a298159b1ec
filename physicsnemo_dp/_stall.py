"""A collective that waits too long: find out whether the ranks' programs diverged, and say so on every rank.

In the default mode nothing compares what the ranks ask for before they
communicate (the checking mode does, at one all-gather per construction or
redistribution). So a rank whose arguments differ either raises alone (its
``from_local`` check fails) while the others wait for it in their next
collective, or enters another collective than its peers (a ``redistribute``
whose target differs on one rank); either way the job used to hang until the
process group's timeout, or the waiting ranks died with gloo's "Connection
closed by peer" while only one rank said why.

Nothing is added to a collective that completes. Each eager collective is
waited for in slices of :func:`interval` seconds (``PDP_STALL_SECONDS``,
default 10; 0 turns this off); only when a slice runs out, or the backend
reports a lost peer, does the rank look outside the process group, in the
job's key-value store:

* a rank that raised alone leaves its message there before raising
  (:func:`raised_alone`); a waiting peer that finds it raises the same
  :class:`~physicsnemo_dp.PlacementError`, so every rank reports the one cause;
* a waiting rank leaves a note of the call it waits in: the process group,
  how many of the library's collectives it has issued on that group (group
  members match collectives in issue order), the collective's kind, and the
  layout operation in progress (:func:`activity`). When every other member
  of the group waits on the same group too, and the notes disagree on the call
  number, the kind or the operation, the programs diverged: every member
  raises the same ``PlacementError`` listing each rank's note. Notes that
  agree (the group waits for something else) or a member still computing
  mean "keep waiting".

What it cannot see: collectives that complete although the ranks asked for
different things (two all-to-alls whose sizes differ move bytes the
receiver did not expect; gloo aborts the process when more arrive than
expected and leaves memory unwritten when fewer do). The checking mode
(:func:`physicsnemo_dp.debug.checks`) compares layouts before any data moves.
Only backends whose ``wait`` blocks the CPU (gloo) give a slice to time;
NCCL's work completes on the stream, and NCCL's own watchdog covers hangs.
Collectives inside compiled graphs are waited for by the graph itself.
After a stall is reported the process group still has the unmatched
collective posted, so the group cannot be used again: end the job.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import time
from contextvars import ContextVar
from typing import Iterator

import torch.distributed as dist

from . import _torch_compat
from .errors import PlacementError

__all__ = ["activity", "interval", "raised_alone", "wait", "waited"]

_ENV = "PDP_STALL_SECONDS"
_DEFAULT_SECONDS = 10.0
_PREFIX = "physicsnemo_dp/stall"

#: (process group name) -> collectives this rank issued on it through the library.
_issued: dict[str, int] = {}
#: the layout operation in progress (a short description), for the notes.
_ACTIVITY: ContextVar[object] = ContextVar("physicsnemo_dp_activity", default="")
#: whether this rank left a failure note that later collectives should clear.
_left_failure = False


def interval() -> float:
    """Seconds a collective waits before looking for a diverged or failed peer (0: never)."""
    return _parsed(os.environ.get(_ENV, ""))[0]


@functools.lru_cache(maxsize=8)
def _parsed(value: str) -> tuple[float, datetime.timedelta]:
    """``(seconds, the same as a timedelta)`` of a ``PDP_STALL_SECONDS`` value (read at every collective)."""
    seconds = _seconds(value.strip())
    return seconds, datetime.timedelta(seconds=seconds)


def _seconds(value: str) -> float:
    if not value:
        return _DEFAULT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{_ENV}={value!r}: give a number of seconds (0 turns the stall check off)") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{_ENV}={value!r}: give a finite number of seconds >= 0 (0 turns the stall check off)")
    return seconds


@contextlib.contextmanager
def activity(description: object) -> Iterator[None]:
    """Name the layout operation whose collectives run in the block (what a divergence report quotes).

    ``description`` is formatted with ``str`` only when a collective stalls,
    so naming an operation costs nothing on the way through.
    """
    token = _ACTIVITY.set(description)
    try:
        yield
    finally:
        _ACTIVITY.reset(token)


def raised_alone(error: BaseException) -> BaseException:
    """Leave ``error``'s message for the peers before this rank raises it; returns the error to raise.

    For checks that read only this rank's arguments: the peers go on to
    their next collective, and when it stalls they raise the same message.
    On one rank, or without a job store, the error is returned unchanged.
    """
    global _left_failure
    store = _store()
    if store is None or dist.get_world_size() == 1:
        return error
    rank = dist.get_rank()
    text = _alone(rank, str(error) if str(error).startswith("rank ") else f"rank {rank}: {error}")
    store.set(f"{_PREFIX}/failed/{rank}", text)
    _left_failure = True
    return type(error)(text) if type(error) in (PlacementError, TypeError, ValueError) else error


def _alone(rank: int, message: str) -> str:
    """What the rank that failed and each peer that finds its note raise: the same text everywhere."""
    return f"{message}\n(raised on rank {rank} alone; the other ranks raise it when their next collective stalls)"


#: The clocks summing the time this thread waits in collectives (:func:`physicsnemo_dp.collectives.wait_clock`);
#: empty (the usual case) costs one truthiness test per wait.
CLOCKS: list = []


def waited(kind: str, start: float) -> None:
    """Add ``perf_counter() - start`` seconds of waiting in a ``kind`` collective to every active clock."""
    seconds = time.perf_counter() - start
    for clock in CLOCKS:
        clock.add(kind, seconds)


def wait(work, group, kind: str) -> None:
    """Wait for a posted collective ``work`` on ``group``; diagnose if it stalls (see the module docstring)."""
    if not CLOCKS:
        _wait(work, group, kind)
        return
    start = time.perf_counter()
    try:
        _wait(work, group, kind)
    finally:
        waited(kind, start)


def _wait(work, group, kind: str) -> None:
    global _left_failure
    name = group.group_name
    call = _issued[name] = _issued.get(name, 0) + 1
    seconds, slice_ = _parsed(os.environ.get(_ENV, ""))
    if not seconds or not _blocks_cpu(name, group):
        work.wait()
        return
    try:
        work.wait(timeout=slice_)
    except RuntimeError as error:
        _stalled(work, group, kind, call, slice_, error)
    if _left_failure:  # this rank went on after raising alone: its old message must not blame it later
        _left_failure = False
        store = _store()
        if store is not None:
            store.delete_key(f"{_PREFIX}/failed/{dist.get_rank()}")


def _stalled(work, group, kind: str, call: int, slice_: datetime.timedelta, first: RuntimeError) -> None:
    store = _store()
    if store is None:
        raise first
    members = dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    note = {"group": group.group_name, "ranks": members, "call": call, "kind": kind, "activity": str(_ACTIVITY.get())}
    key = f"{_PREFIX}/waiting/{rank}"
    store.set(key, json.dumps(note))
    error = first
    while True:
        verdict = _diagnose(store, members, note)
        if verdict is not None:  # the note stays: a peer that reads it later reaches the same verdict
            _linger(store, note, len(members), slice_)
            raise PlacementError(verdict) from error
        if not _timed_out(error):  # a peer is gone and left no word: the backend's error stands
            raise error
        try:
            work.wait(timeout=slice_)
        except RuntimeError as again:
            error = again
        else:
            store.delete_key(key)  # it was only slow: the note must not describe a later wait
            return


def _linger(store, note: dict, members: int, slice_: datetime.timedelta) -> None:
    """Stay until every member has its verdict (at most two slices), before raising ends this process.

    The job's store may live in this process (``launch`` hosts it in rank 0):
    leaving at once would take the notes away from a peer that has not read
    them yet, which would then report the backend's "connection closed".
    """
    try:
        counter = f"{_PREFIX}/verdicts/{note['group']}/{note['call']}"
        store.add(counter, 1)
        deadline = time.monotonic() + 2 * slice_.total_seconds()
        while store.add(counter, 0) < members and time.monotonic() < deadline:
            time.sleep(0.02)
    except RuntimeError:  # the store went away: nothing to wait for
        pass


def _diagnose(store, members: list[int], note: dict) -> str | None:
    """The message every member raises, or None to keep waiting. Reads only notes, so every member agrees."""
    try:
        return _verdict(store, members, note)
    except RuntimeError:  # the store is gone (its host process ended): nothing to learn
        return None


def _verdict(store, members: list[int], note: dict) -> str | None:
    failures = _read(store, "failed", members)
    if failures:
        return failures[min(failures)]
    waiting = _read(store, "waiting", members)
    if len(waiting) < len(members) or any(w["group"] != note["group"] for w in waiting.values()):
        return None  # someone is still computing, or waits on another group: not (yet) a divergence
    if len({(w["call"], w["kind"], w["activity"]) for w in waiting.values()}) == 1:
        return None  # the same call everywhere: the group waits for something outside it
    lines = "\n".join(
        f"  rank {r}: collective #{w['call']} on this group, {w['kind']}"
        + (f", during {w['activity']}" if w["activity"] else "")
        for r, w in sorted(waiting.items())
    )
    return (
        f"the ranks of process group {members} are waiting in different collectives; their programs diverged "
        f"(an argument, a placement or a condition that differs between ranks):\n{lines}\n"
        "Make every rank make the same calls; physicsnemo_dp.debug.checks() compares layouts before any data moves"
    )


def _read(store, what: str, members: list[int]) -> dict:
    found = {}
    for member in members:
        key = f"{_PREFIX}/{what}/{member}"
        if store.check([key]):
            text = store.get(key).decode()
            found[member] = json.loads(text) if what == "waiting" else text
    return found


def _timed_out(error: RuntimeError) -> bool:
    return "timed out" in str(error).lower()


def _blocks_cpu(name: str, group) -> bool:
    if name not in _BLOCKING:
        _BLOCKING[name] = str(dist.get_backend(group)) == "gloo"
    return _BLOCKING[name]


#: process group name -> whether its ``work.wait`` blocks the CPU (asked once per group).
_BLOCKING: dict[str, bool] = {}


def _store():
    """The job's key-value store, or None (no default process group: nowhere to leave notes)."""
    if not dist.is_initialized():
        return None
    try:
        return _torch_compat.default_store()
    except (RuntimeError, ValueError):
        return None
