"""Filling batch buffers: in the caller, in a background thread, or in a reader process.

h5py serializes every call in a process under one global lock, so reader
threads never read in parallel with each other or with h5py use elsewhere in
the process. HDF5 itself runs without the GIL, but the Python glue around each
read needs it: a training loop that holds the GIL makes a reader thread wait
up to the interpreter's switch interval (5 ms) at every hand-off. A reader
*process* per rank has its own HDF5 library, lock and GIL: it reads into
shared memory while the training process computes, and the batch reaches the
training process without a copy (the buffer is shared; see
:mod:`datapipes._buffers`). Measured figures are in ``datapipes/README.md``.

The caller reads with :func:`fill` itself; the two background readers run
the same :func:`fill`, answer in submission order, and report how long each
read took (the pipe's :class:`~datapipes._pacing.ReadAhead` compares it with
the consumer's step to decide whether reading ahead pays). After a read, a
thread of the training process (the reader thread, or the reader process's
relay thread) runs the task's ``finish``: the pipe builds the batch there, so
the training thread only takes a finished one.
The reader process is forked, like ``torch.utils.data.DataLoader`` workers,
so the source and the transforms need not pickle; a process closes its
sources' files before it forks, so no reader inherits one (see
:mod:`datapipes._fork_guard`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Callable, Sequence

import numpy as np
import torch

from . import _fork_guard
from ._buffers import ArraySpec, view_arrays
from .errors import InvalidValuesError
from .source import Box, Source

__all__ = ["ReadTask", "fill", "timed_fill", "make_reader", "READERS"]

Transform = Callable[[dict[str, torch.Tensor]], None]
#: Run by a background reader after a successful read, on its thread (the pipe builds the batch there).
Finish = Callable[[], object]
#: Run by a background reader on its thread before the read: the task, the memory to fill and its finish.
#: The pipe prepares the read there (buffer, layout, task), so submitting costs the training thread a queue put.
Prepare = Callable[[], tuple["ReadTask", object, Finish | None]]


@dataclass(frozen=True)
class ReadTask:
    """Read ``samples`` (one box per variable each) into the arrays of one buffer."""

    seq: int
    buffer: str | None  # shared-memory name, for the reader process
    arrays: tuple[ArraySpec, ...]  # (batch, *local shape with halo) per variable
    samples: tuple[int, ...]
    boxes: tuple[dict[str, Box], ...]  # per sample: variable -> box (halo included)
    detach: tuple[str, ...] = ()  # shared buffers the parent freed; the reader process forgets them


def fill(source: Source, task: ReadTask, memory, transforms: Sequence[Transform], validate: bool,
         rank: str = "") -> int:
    """Read every sample of ``task`` into ``memory``, check and transform it; return bytes read.

    The source's files are checked after the reads (:meth:`Source.check_files`): a file that
    changed under the run raises :class:`~datapipes.errors.FileChangedError` here, in whichever
    reader, and the pipe hands it to the consumer like any read error.

    ``rank`` names the reading rank in validation errors (e.g. ``"rank 3 (ddp 1, domain 1)"``): the
    error is shared with every rank (:func:`datapipes.check_all_ranks`), so it must say whose slab failed.
    """
    arrays = view_arrays(memory, task.arrays)
    nbytes = 0
    with _fork_guard.reading():  # a fork in another thread closes the source's files, but not mid-read
        for row, (index, boxes) in enumerate(zip(task.samples, task.boxes)):
            for name, array in arrays.items():
                nbytes += source.read(index, name, boxes[name], array[row])
                if validate:
                    _check_finite(array[row], source, index, name, boxes[name], rank)
        # after the reads: a file truncated or replaced before or while they ran is seen here
        source.check_files(task.samples)
    if transforms:
        tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
        for transform in transforms:
            transform(tensors)
    return nbytes


def _check_finite(values: np.ndarray, source: Source, index: int, name: str, box: Box, rank: str) -> None:
    if not np.issubdtype(values.dtype, np.inexact):
        return
    bad = ~np.isfinite(values)
    if bad.any():
        first = tuple(int(i) + s.start for i, s in zip(np.argwhere(bad)[0], box))
        raise InvalidValuesError(
            f"{source.where(index, name)}: {int(bad.sum())} NaN or infinite value(s) in the box "
            f"{'read by ' + rank + ' ' if rank else ''}"
            f"{tuple((s.start, s.stop) for s in box)} of shape {values.shape}; the first at index {first}"
        )


# --------------------------------------------------------------------------- #
# Background readers: submit(prepare) in order; result() -> (bytes read, seconds, finish()'s value),
# in order. prepare() and finish() run on the background thread; an error in prepare() or in the read is
# raised by that task's result()
# --------------------------------------------------------------------------- #
def timed_fill(*args) -> tuple[int, float]:
    """:func:`fill`, and the seconds it took (wall clock: what a consumer's step can hide)."""
    start = time.perf_counter()
    nbytes = fill(*args)
    return nbytes, time.perf_counter() - start


class _ThreadReader:
    """One background thread per pipe: it reads, then runs the task's ``finish`` (the pipe builds the batch)."""

    def __init__(self, source, transforms, validate, rank):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._serve, args=(source, transforms, validate, rank), name="datapipes-reader", daemon=True
        )
        self._thread.start()

    def _serve(self, source, transforms, validate, rank) -> None:
        while (prepare := self._tasks.get()) is not None:
            try:
                task, memory, finish = prepare()
                nbytes, seconds = timed_fill(source, task, memory, transforms, validate, rank)
            except Exception as err:  # handed to the consumer, which raises it
                self._results.put(((0, 0.0, None), err))
            else:
                self._results.put(((nbytes, seconds, _finished(finish)), None))
            prepare = finish = None  # this frame must not keep the pipe alive (its finalizer closes this reader)

    def submit(self, prepare: Prepare) -> None:
        self._tasks.put(prepare)

    def result(self) -> tuple[int, float, object]:
        done, err = self._results.get()
        if err is not None:
            raise err
        return done

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()


class _ProcessReader:
    """One forked reader process per pipe, filling shared-memory buffers, and a relay thread that talks to it.

    Forked with ``os.fork`` rather than ``multiprocessing.Process``, which
    refuses to start children from daemonic processes (such as the ranks of
    ``physicsnemo_dp.launch``); the reader dies with its parent instead
    (``PR_SET_PDEATHSIG`` on Linux, a parent check elsewhere).

    The relay thread (in the training process) prepares and sends the tasks,
    receives the replies and runs each task's ``finish``, so the training
    thread neither prepares nor pickles a task, nor wakes the reader process,
    nor builds the batch: it only puts the read's ``prepare`` on a queue and
    takes the finished batch from another. The
    relay needs the training process's GIL to send a task and build a batch
    (the read itself runs in the reader process, without it); with a step
    that holds the GIL (``benchmarks/io_bench.py --steps python``, P = 1,
    three runs each) the speed-up over serial reads was 0.84-0.88 with the
    relay against 0.74-0.93 with the task sent by the training thread.
    """

    def __init__(self, source, transforms, validate, rank):
        self._conn, child = multiprocessing.Pipe()
        parent = os.getpid()
        self._pid = os.fork()
        if self._pid == 0:  # the reader process: never returns
            code = 1
            try:
                self._conn.close()
                _detach_from(parent)
                _serve_process(child, source, transforms, validate, rank, parent)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        child.close()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._fatal: BaseException | None = None  # the relay stopped: every later result() raises this
        self._relay = threading.Thread(target=self._serve_relay, name="datapipes-relay", daemon=True)
        self._relay.start()

    def submit(self, prepare: Prepare) -> None:
        self._tasks.put(prepare)

    def result(self) -> tuple[int, float, object]:
        if self._fatal is not None and self._results.empty():
            raise self._fatal
        done, err, where = self._results.get()
        if err is not None:
            if where:
                err.add_note(f"raised in the datapipes reader process:\n{where}")
            raise err
        return done

    def _serve_relay(self) -> None:
        """Prepare and send tasks in order, receive their replies in order, finish each batch; stop at None."""
        pending: deque = deque()  # per task not answered yet, in order: its finish, or the error preparing it
        try:
            while True:
                item = self._tasks.get() if not pending else _queued(self._tasks)
                while item is not None and item is not _EMPTY:
                    try:
                        task, _, finish = item()
                    except Exception as err:  # raised by this task's result(), after the earlier tasks' results
                        pending.append(_Failed(err))
                    else:
                        self._conn.send(task)
                        pending.append(finish)
                    finish = None  # this frame must not keep the pipe alive (its finalizer closes this reader)
                    item = _queued(self._tasks)
                if item is None:  # close(): the process answers what it holds, then stops
                    self._conn.send(None)
                    return
                self._report_failed(pending)
                if not pending:
                    continue
                try:
                    (nbytes, seconds), err, where = self._conn.recv()
                except EOFError:
                    raise RuntimeError(
                        f"the datapipes reader process (pid {self._pid}) died ({self._exit_status()})"
                    ) from None
                finish = pending.popleft()
                if err is not None:
                    self._results.put((None, err, where))
                else:
                    self._results.put(((nbytes, seconds, _finished(finish)), None, ""))
                finish = None  # this frame must not keep the pipe alive (its finalizer closes this reader)
                self._report_failed(pending)
        except BaseException as err:  # the process died or the pipe broke: every waiting result() raises it
            self._fatal = err
            self._results.put((None, err, ""))

    def _report_failed(self, pending: deque) -> None:
        """Results for the tasks at the head of ``pending`` that failed before they were sent."""
        while pending and isinstance(pending[0], _Failed):
            self._results.put((None, pending.popleft().error, ""))

    def close(self) -> None:
        self._tasks.put(None)
        self._relay.join(timeout=5)
        deadline = time.monotonic() + 5
        while os.waitpid(self._pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
                break
            time.sleep(0.01)
        self._relay.join()  # the process is gone: a relay still waiting for it got EOF
        self._conn.close()

    def _exit_status(self) -> str:
        pid, status = os.waitpid(self._pid, os.WNOHANG)
        return "still running" if pid == 0 else f"wait status {status}"


_EMPTY = object()


class _Failed:
    """A task whose preparation raised ``error`` (it was never sent)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _queued(tasks: queue.SimpleQueue):
    """The next queued item without waiting, or ``_EMPTY``."""
    try:
        return tasks.get_nowait()
    except queue.Empty:
        return _EMPTY


def _finished(finish: Finish | None):
    """``finish()`` on the background thread (None without one). It must not raise: the pipe's catches its own errors."""
    return None if finish is None else finish()


def _detach_from(parent: int) -> None:
    """In the reader: die with the parent, and leave Ctrl-C to it (it closes the reader)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _serve_process(conn, source, transforms, validate, rank, parent_pid: int) -> None:
    """Reader process body: fill buffers until told to stop or the parent is gone."""
    torch.set_num_threads(1)  # the training process owns the cores
    attached: dict[str, shared_memory.SharedMemory] = {}
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return
            continue
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        for name in task.detach:
            if name in attached:
                attached.pop(name).close()
        if task.buffer not in attached:
            attached[task.buffer] = shared_memory.SharedMemory(name=task.buffer)
        try:
            conn.send((timed_fill(source, task, attached[task.buffer].buf, transforms, validate, rank), None, ""))
        except Exception as err:
            conn.send(((0, 0.0), _portable(err), traceback.format_exc()))


def _portable(err: Exception) -> Exception:
    """The exception itself if it pickles, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


READERS = {"thread": _ThreadReader, "process": _ProcessReader}


def make_reader(kind: str, source: Source, transforms: Sequence[Transform], validate: bool, rank: str = ""):
    """A background reader of ``kind`` (``"thread"`` or ``"process"``); ``rank`` as in :func:`fill`."""
    return READERS[kind](source, tuple(transforms), validate, rank)
