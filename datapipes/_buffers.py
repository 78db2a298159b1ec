"""Reusable batch buffers, returned to the pool when the last tensor viewing them dies.

Why a pool: allocating a fresh multi-megabyte buffer per batch costs page
faults comparable to the read itself, and copying a batch out of a shared
buffer costs a memcpy. The pipe instead reads straight into a buffer from
this pool and hands the user tensors that *view* it, with no copy.

Why reuse is safe: each buffer holds one numpy array per variable of its
layout, made once (its *views*), and a batch's tensors come from
``torch.from_numpy`` on them. Every tensor storage made that way keeps a
reference to its array for as long as any tensor (or view of one, or a
tensor autograd saved) uses the memory, and so does any dict of the arrays
handed out; a numpy view of an array refers to the one array all of them
view (their ``base``). A buffer handed out is therefore in use exactly
while one of these arrays has more references than the buffer's own (``sys.getrefcount``
against the count taken when they were made); the pool looks at the buffers
handed out whenever it needs one and takes back those no longer in use, so a
batch a user keeps is never overwritten: the pool simply grows instead.
Why not a finalizer per batch (as before): making a fresh array per variable
and a ``weakref.finalize`` per batch, and tearing them down, cost the
relay thread ~90 us and the training thread ~20 us per batch right after a
step (cold caches, P = 2); reusing a buffer's arrays costs neither.

Buffers are private memory, or POSIX shared memory when a reader process fills
them (the process attaches by name, see :mod:`datapipes.prefetch`).

Why private buffers are mapped here rather than taken from ``np.empty``:
``malloc`` serves a large request from free space of its heap when it has
any, and a training process's heap has plenty once tensors of earlier steps
were freed. That memory was touched before with 4 KiB pages, so it gets no
huge pages, and filling a buffer of 4 KiB pages from the page cache cost
~1.35x the time here (16 MiB: 1.2 vs 0.85 ms a copy; the pipe at P = 1
dropped from 0.9-1.0 of a bare ``read_direct`` loop to 0.7 after other
work in the same process). :func:`private_memory` maps every buffer of at
least :data:`HUGE_PAGE` bytes on its own (anonymous, private, aligned to
2 MiB and advised ``MADV_HUGEPAGE``), so its speed does not depend on the
heap's past; the mapping is returned to the system when its last view dies.

Why huge pages are restored after a fork: a fork (the pipe's reader process,
or any other) shares every private page with the child copy-on-write, and the
kernel breaks a shared huge page at the parent's next write into 4 KiB pages,
which stay so until ``khugepaged`` happens to collapse them back (its default
pace: 4096 pages every 10 s). Measured here: a 16 MiB copy into a buffer went
from 0.62 ms to 0.74 ms after a fork, for the rest of the run. :class:`HugePages` collapses a
mapping back (``MADV_COLLAPSE``, Linux 6.1 and later; a no-op elsewhere) the
first time it is handed out after a fork, once it is written and the child
keeps its own copy: one copy of the buffer per fork.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

__all__ = ["ArraySpec", "Buffer", "BufferPool", "HugePages", "layout_arrays", "private_memory", "view_arrays"]

_ALIGN = 64  # bytes; every array starts on a cache line
#: Buffers at least this large get a mapping of their own, aligned to it (the x86-64 / arm64 huge page size).
HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class ArraySpec:
    """One array inside a buffer."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize  # math.prod: a few us less than np.prod, per batch


def layout_arrays(arrays: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[tuple[ArraySpec, ...], int]:
    """Place named ``(shape, dtype)`` arrays one after another; return the specs and total bytes."""
    specs, offset = [], 0
    for name, (shape, dtype) in arrays.items():
        spec = ArraySpec(name, offset, tuple(shape), np.dtype(dtype).str)
        specs.append(spec)
        offset += -(-spec.nbytes // _ALIGN) * _ALIGN
    return tuple(specs), offset


def view_arrays(memory, specs: tuple[ArraySpec, ...]) -> dict[str, np.ndarray]:
    """numpy views of the arrays inside ``memory`` (no ownership tracking)."""
    return {s.name: np.ndarray(s.shape, np.dtype(s.dtype), buffer=memory, offset=s.offset) for s in specs}


def private_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` of private memory (uint8, uninitialised), on huge pages where the system gives them.

    From :data:`HUGE_PAGE` bytes up: an anonymous private mapping of its own,
    started on a huge-page boundary and advised ``MADV_HUGEPAGE`` (used when
    transparent huge pages are ``always`` or ``madvise``), never recycled heap
    memory (see the module docstring). Smaller sizes, and systems without
    private anonymous mappings, get ``np.empty``. The mapping is unmapped when
    the array and every view of it are gone.
    """
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MAP_PRIVATE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.empty(nbytes, dtype=np.uint8)
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapped, np.uint8)  # keeps the mapping alive (views of it too)
    start = -whole.ctypes.data % HUGE_PAGE  # a multiple of the page size: mmap returns page-aligned memory
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE, start, len(mapped) - start)
    return whole[start : start + nbytes]


#: Forks of this process so far (see the module docstring); a mapping collapsed at an older count may be split.
_FORKS = [0]
#: ``madvise`` advice that collapses a range into huge pages now (Linux >= 6.1); Python 3.11's mmap lacks the name.
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)


def _count_fork() -> None:
    _FORKS[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_count_fork)


def _collapse(array: np.ndarray) -> bool:
    """Ask the kernel to back ``array``'s whole huge pages with huge pages again; whether it did (never raises)."""
    if not sys.platform.startswith("linux"):
        return False
    start = -array.ctypes.data % HUGE_PAGE  # only whole huge pages inside the array
    length = (array.nbytes - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(array.ctypes.data + start), ctypes.c_size_t(length), _MADV_COLLAPSE) == 0
    except (OSError, AttributeError):
        return False


class HugePages:
    """A private mapping (from :func:`private_memory`) kept on huge pages across forks of this process.

    :meth:`restore` is cheap when nothing forked since the last call; after a
    fork it collapses the mapping once (see the module docstring). Call it once
    the memory was written after the fork (the write is what splits the pages).
    """

    def __init__(self, array: np.ndarray):
        self._array = array
        self._forks = _FORKS[0]

    def restore(self) -> None:
        if self._forks != _FORKS[0]:
            self._forks = _FORKS[0]
            _collapse(self._array)


class Buffer:
    """A block of bytes; ``name`` is set when it lives in shared memory."""

    def __init__(self, capacity: int, shared: bool):
        # (specs, (owner, *arrays over the memory), their reference counts with only this buffer holding them). First
        # attribute: a buffer dropped without free() releases its arrays before its shared memory, which
        # cannot be closed while they view it
        self._views: tuple[tuple[ArraySpec, ...], tuple[np.ndarray, ...], list[int]] | None = None
        self.capacity = max(capacity, 1)
        if shared:
            self._shm = shared_memory.SharedMemory(create=True, size=self.capacity)
            self.name, self.memory = self._shm.name, self._shm.buf
            self._huge = None
        else:
            self._shm = None
            self.name, self.memory = None, private_memory(self.capacity)
            self._huge = HugePages(self.memory) if self.capacity >= HUGE_PAGE else None

    def views(self, specs: tuple[ArraySpec, ...]) -> tuple[np.ndarray, ...]:
        """This buffer's arrays for ``specs``, made once per layout (the buffer must not be in use)."""
        views = self._views
        if views is None or (views[0] is not specs and views[0] != specs):
            # views of one array over a new memoryview, which holds an export of the memory: shared memory
            # cannot be unmapped under them (np.ndarray(buffer=...) would keep no export)
            owner = np.frombuffer(memoryview(self.memory), np.uint8)
            arrays = tuple(
                owner[s.offset : s.offset + s.nbytes].view(np.dtype(s.dtype)).reshape(s.shape) for s in specs
            )
            # owner too: numpy makes it the base of any view of these arrays (the arrays do not see those)
            tracked = (owner, *arrays)
            del owner, arrays  # the counts are taken with only `tracked` holding them
            self._views = views = (specs, tracked, _references(tracked))
        return views[1][1:]

    def in_use(self) -> bool:
        """Whether anything but this buffer refers to one of its arrays (a batch's tensors, a dict of them)."""
        views = self._views
        return views is not None and _references(views[1]) != views[2]

    def free(self) -> None:
        """Give the memory back to the system (shared memory is unlinked at once)."""
        self._views = None  # the memory stays mapped while a user's array views it
        if self._shm is not None:
            self._shm.unlink()
            self.memory = None
            _unmapped.append(self._shm)
            self._shm = None
        _unmap_unviewed()


def _references(arrays: tuple[np.ndarray, ...]) -> list[int]:
    """Reference counts of ``arrays`` (compared only with counts taken by this same function)."""
    return [sys.getrefcount(a) for a in arrays]


#: Shared memory unlinked but maybe still mapped. Unmapping fails while a view
#: of it lives (a batch a user keeps after its pool was closed or trimmed);
#: retried at every free.
_unmapped: list[shared_memory.SharedMemory] = []


def _unmap_unviewed() -> None:
    """Unmap every unlinked shared block that no view uses any more."""
    for shm in list(_unmapped):
        try:
            shm.close()
        except BufferError:
            continue
        _unmapped.remove(shm)


class BufferPool:
    """Buffers handed out for batches, taken back once nothing uses their arrays (see the module docstring)."""

    def __init__(self, shared: bool, max_idle: int):
        self.shared = shared
        self.max_idle = max_idle  # idle buffers kept for reuse; more are freed (after a user let go of many)
        self._lock = threading.Lock()
        self._free: list[Buffer] = []
        self._out: list[Buffer] = []  # handed out, in that order: back in the pool once not in use
        self._freed_names: list[str] = []  # shared buffers freed since the last `take_freed_names`
        self._closed = False
        if shared:
            resource_tracker.ensure_running()  # before any fork: children share this tracker

    def acquire(self, nbytes: int) -> Buffer:
        """A buffer of at least ``nbytes``: the latest released one that is large enough, else a new one."""
        with self._lock:
            self._take_back()
            for i in range(len(self._free) - 1, -1, -1):  # most recently used first: warm in cache
                if self._free[i].capacity >= nbytes:
                    return self._free.pop(i)
            if self._free:  # free but too small (a larger batch layout): replace it
                self._drop(self._free.pop())
        return Buffer(nbytes, self.shared)

    def release(self, buf: Buffer) -> None:
        """Take back a buffer that was never handed out (a read that failed or was not used)."""
        with self._lock:
            self._keep(buf)

    def hand_out(self, buf: Buffer, specs: tuple[ArraySpec, ...]) -> dict[str, np.ndarray]:
        """The arrays of ``buf`` for the user; ``buf`` returns to the pool once nothing uses them.

        The arrays are the buffer's own (:meth:`Buffer.views`, made once), in
        a new dict: while the dict, or any tensor made from one of its arrays,
        lives, the buffer is in use and never handed out again. Nothing is
        registered per batch and nothing runs when the batch dies: the pool
        sees it the next time it needs a buffer (:meth:`acquire`, :meth:`trim`).
        """
        if not specs:
            self.release(buf)
            return {}
        if buf._huge is not None:  # the buffer was just written: after a fork, its pages are split now
            buf._huge.restore()
        arrays = dict(zip([s.name for s in specs], buf.views(specs)))
        with self._lock:
            if self._closed:  # the pool is gone: the memory lives while the user's arrays do
                buf.free()
            else:
                self._out.append(buf)
        return arrays

    def trim(self) -> None:
        """Free every idle buffer (the pipe stopped using this pool for now); the pool stays usable."""
        with self._lock:
            self._take_back()
            idle, self._free = self._free, []
            for buf in idle:
                self._drop(buf)

    def take_freed_names(self) -> tuple[str, ...]:
        """Names of shared buffers freed since the last call (a reader process detaches them)."""
        with self._lock:
            names, self._freed_names = tuple(self._freed_names), []
        return names

    def close(self) -> None:
        """Free every buffer now; one still in use stays mapped until its last array dies."""
        with self._lock:
            self._closed = True
            idle, self._free, out, self._out = self._free, [], self._out, []
        for buf in idle + out:
            buf.free()

    def _take_back(self) -> None:
        """Buffers handed out that nothing uses any more become idle (in the order handed out: the latest last)."""
        if not self._out:
            return
        out, self._out = self._out, []
        for buf in out:
            if buf.in_use():
                self._out.append(buf)
            else:
                self._keep(buf)

    def _keep(self, buf: Buffer) -> None:
        if self._closed or len(self._free) >= self.max_idle:
            self._drop(buf)
        else:
            self._free.append(buf)

    def _drop(self, buf: Buffer) -> None:
        if buf.name is not None:
            self._freed_names.append(buf.name)
        buf.free()
