"""Reusable batch buffers, returned to the pool when the last tensor viewing them dies.

Why a pool: allocating a fresh multi-megabyte buffer per batch costs page
faults comparable to the read itself, and copying a batch out of a shared
buffer costs a memcpy. The pipe instead reads straight into a buffer from
this pool and hands the user tensors that *view* it, with no copy.

Why reuse is safe: every array handed out is a fresh numpy array object over
the buffer, and ``torch.from_numpy`` keeps that object alive for as long as
any tensor (or view of one) uses its memory. A ``weakref.finalize`` on each
array returns the buffer once all of a batch's arrays are gone, so a batch a
user keeps is never overwritten; the pool simply grows instead.

Buffers are plain memory, or POSIX shared memory when a reader process fills
them (the process attaches by name, see :mod:`datapipes.prefetch`).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

__all__ = ["ArraySpec", "Buffer", "BufferPool", "layout_arrays", "view_arrays"]

_ALIGN = 64  # bytes; every array starts on a cache line


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


class Buffer:
    """A block of bytes; ``name`` is set when it lives in shared memory."""

    def __init__(self, capacity: int, shared: bool):
        self.capacity = max(capacity, 1)
        if shared:
            self._shm = shared_memory.SharedMemory(create=True, size=self.capacity)
            self.name, self.memory = self._shm.name, self._shm.buf
        else:
            self._shm = None
            self.name, self.memory = None, np.empty(self.capacity, dtype=np.uint8)

    def free(self) -> None:
        """Give the memory back to the system (shared memory is unlinked at once)."""
        if self._shm is not None:
            self._shm.unlink()
            self.memory = None
            _unmapped.append(self._shm)
            self._shm = None
        _unmap_unviewed()


#: Shared memory unlinked but maybe still mapped. Unmapping fails while a view
#: of it lives, and it does while a batch's finalizer runs (the last array
#: releases its memory only after its weakref callbacks); retried at every free.
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
    """Buffers handed out for batches and taken back when their tensors die."""

    def __init__(self, shared: bool, max_idle: int):
        self.shared = shared
        self.max_idle = max_idle  # idle buffers kept for reuse; more are freed (after a user let go of many)
        self._lock = threading.Lock()
        self._free: list[Buffer] = []
        self._freed_names: list[str] = []  # shared buffers freed since the last `take_freed_names`
        self._closed = False
        if shared:
            resource_tracker.ensure_running()  # before any fork: children share this tracker

    def acquire(self, nbytes: int) -> Buffer:
        """A buffer of at least ``nbytes``: the latest released one that is large enough, else a new one."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # most recently used first: warm in cache
                if self._free[i].capacity >= nbytes:
                    return self._free.pop(i)
            if self._free:  # free but too small (a larger batch layout): replace it
                self._drop(self._free.pop())
        return Buffer(nbytes, self.shared)

    def release(self, buf: Buffer) -> None:
        with self._lock:
            if self._closed or len(self._free) >= self.max_idle:
                self._drop(buf)
            else:
                self._free.append(buf)

    def hand_out(self, buf: Buffer, specs: tuple[ArraySpec, ...]) -> dict[str, np.ndarray]:
        """Views of ``buf`` for the user; ``buf`` returns to the pool when all of them are gone.

        Every array is a view of one per-batch ``owner`` array (numpy makes
        ``owner`` their ``base``: it does not collapse a view's base past an
        array whose own base is not an array, here a fresh ``memoryview``), so
        a single finalizer on ``owner`` fires when the last array, or tensor
        made from one, is gone. One finalizer per batch instead of one per
        array with a shared counter and lock: that bookkeeping cost as much
        as reading a small slab.
        """
        if not specs:
            self.release(buf)
            return {}
        owner = np.frombuffer(memoryview(buf.memory), np.uint8)
        arrays = {s.name: owner[s.offset : s.offset + s.nbytes].view(np.dtype(s.dtype)).reshape(s.shape) for s in specs}
        weakref.finalize(owner, self.release, buf)
        return arrays

    def trim(self) -> None:
        """Free every idle buffer (the pipe stopped using this pool for now); the pool stays usable."""
        with self._lock:
            idle, self._free = self._free, []
            for buf in idle:
                self._drop(buf)

    def take_freed_names(self) -> tuple[str, ...]:
        """Names of shared buffers freed since the last call (a reader process detaches them)."""
        with self._lock:
            names, self._freed_names = tuple(self._freed_names), []
        return names

    def close(self) -> None:
        """Free every idle buffer now; buffers still viewed are freed when released."""
        with self._lock:
            self._closed = True
            idle, self._free = self._free, []
        for buf in idle:
            buf.free()

    def _drop(self, buf: Buffer) -> None:
        if buf.name is not None:
            self._freed_names.append(buf.name)
        buf.free()
