"""The lock by which one training run owns its output folder (``OUT/run.lock``).

Two jobs given the same ``--out`` would write the same ``step_<n>`` folders
(each overwriting the other's), prune each other's checkpoints and interleave
``train.log``, and both would report success. A run therefore holds
``OUT/run.lock`` from start to end: a JSON file naming its host, pid, start
time and command line. It is created atomically — written under a private
name, then hard-linked to ``run.lock``, which fails if the file exists — so
exactly one of two jobs starting together gets it, and a lock file never
holds half its content. A second job is refused with a message naming the
holder. A lock whose holder is gone (same host, no such pid: a job killed
with SIGKILL, or ended by the step watchdog's ``os._exit``) is taken over,
and the caller reports that; a holder on another host cannot be checked from
here, so its lock is never taken over automatically.

Plain file operations, no torch: the training loop has rank 0 call
:func:`acquire` and shares the outcome with every rank.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "run.lock"


class OutputBusyError(RuntimeError):
    """``--out`` is held by another run (or its lock cannot be read); the message names the holder."""


@dataclass(frozen=True)
class Held:
    """A lock this process holds; ``note`` says whose stale lock it took over, if any."""

    path: Path
    token: str
    note: str | None = None


def acquire(out: Path, attempts: int = 5) -> Held:
    """Create ``out/run.lock`` for this process, taking over a stale one; :class:`OutputBusyError` if held."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv), "token": secrets.token_hex(8)}
    note = None
    for _ in range(attempts):
        if _create(path, mine):
            return Held(path, mine["token"], note)
        text = _read(path)
        if text is None:  # released between our attempt and the read: try again
            continue
        holder = _parse(text)
        if holder is None:
            raise OutputBusyError(f"{out} has a lock file {path} that cannot be read as a run's lock; if no other "
                                  "run uses this folder, delete it")
        if not _stale(holder):
            raise OutputBusyError(_busy(out, path, holder))
        if _take_over(path, text, mine["token"]):
            note = (f"took over the stale lock of {out}: its holder, pid {holder['pid']} on {holder['host']} "
                    f"(started {holder.get('started', '?')}), is no longer running")
    raise OutputBusyError(f"{out}: could not take {path} in {attempts} attempts (other runs are starting on this "
                          "folder at the same moment); try again")


def release(held: Held) -> None:
    """Remove the lock if it is still this one (never another run's)."""
    text = _read(held.path)
    holder = _parse(text) if text is not None else None
    if holder is not None and holder.get("token") == held.token:
        held.path.unlink(missing_ok=True)


def _create(path: Path, content: dict) -> bool:
    """Atomically create ``path`` with ``content``: written under a private name, then hard-linked."""
    private = path.with_name(f".{path.name}.{content['token']}")
    private.write_text(json.dumps(content))
    try:
        os.link(private, path)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink(missing_ok=True)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _parse(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(holder, dict) and isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str)
    return holder if ok else None


def _stale(holder: dict) -> bool:
    """Whether the holder is known to be gone: on this host, and its pid is not running."""
    if holder["host"] != socket.gethostname():
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _take_over(path: Path, text: str, token: str) -> bool:
    """Remove the stale lock whose content is ``text``; False if another run got there first.

    The lock is renamed away (atomic: of two runs taking over at once, one
    moves it); if what was moved is not the stale lock read before — another
    run has just taken it over and written its own — it is put back.
    """
    moved = path.with_name(f".{path.name}.stale.{token}")
    try:
        os.rename(path, moved)
    except FileNotFoundError:
        return False
    try:
        if moved.read_text() == text:
            return True
        try:
            os.link(moved, path)
        except FileExistsError:
            pass
        return False
    finally:
        moved.unlink(missing_ok=True)


def _busy(out: Path, path: Path, holder: dict) -> str:
    where = holder["host"]
    if where != socket.gethostname():
        where += " (another host: whether it still runs cannot be checked from here)"
    command = f", command: {holder['command']}" if holder.get("command") else ""
    return (f"{out} is in use by another run: {path} names pid {holder['pid']} on {where}, started "
            f"{holder.get('started', '?')}{command}. Two runs writing one folder overwrite each other's "
            f"checkpoints and log; wait for that run to end or pass another --out (if it is gone, delete {path})")
