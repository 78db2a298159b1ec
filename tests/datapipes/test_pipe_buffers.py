"""The pipe's buffer pool: a buffer returns only when the last array or tensor viewing it is gone."""

import gc
import sys

import numpy as np
import pytest
import torch

from datapipes._buffers import BufferPool, layout_arrays


@pytest.mark.parametrize("shared", [False, True])
def test_a_buffer_returns_when_the_last_view_of_any_array_dies(shared):
    pool = BufferPool(shared=shared, max_idle=4)
    try:
        specs, nbytes = layout_arrays({"a": ((3, 4), np.float32), "b": ((5,), np.float64), "empty": ((0, 2), np.int32)})
        buf = pool.acquire(nbytes)
        arrays = pool.hand_out(buf, specs)
        arrays["a"][:] = 1.0
        arrays["b"][:] = 2.0
        kept = torch.from_numpy(arrays["b"])[1:3]  # a view of a tensor of one array: all the user keeps
        del arrays
        gc.collect()
        other = pool.acquire(nbytes)
        assert other is not buf  # still viewed: a new buffer, never this one
        pool.release(other)
        assert kept.tolist() == [2.0, 2.0]
        del kept
        gc.collect()
        again = pool.acquire(nbytes)
        assert again is buf  # the last view is gone: reused (the most recently released first)
        pool.release(again)
    finally:
        pool.close()


@pytest.mark.parametrize("shared", [False, True])
def test_trim_frees_idle_buffers_and_leaves_handed_out_ones_alone(shared):
    pool = BufferPool(shared=shared, max_idle=4)
    try:
        specs, nbytes = layout_arrays({"a": ((8,), np.float32)})
        idle = [pool.acquire(nbytes) for _ in range(2)]
        held = pool.acquire(nbytes)
        arrays = pool.hand_out(held, specs)
        arrays["a"][:] = 3.0
        for buf in idle:
            pool.release(buf)
        pool.trim()
        assert all(buf.memory is None for buf in idle) == shared  # shared memory is unlinked at once
        assert sorted(pool.take_freed_names()) == (sorted(b.name for b in idle) if shared else [])
        fresh = pool.acquire(nbytes)
        assert all(fresh is not buf for buf in idle)  # trimmed buffers are never handed out again
        assert arrays["a"].tolist() == [3.0] * 8
        pool.release(fresh)
        del arrays
        gc.collect()
        assert pool.acquire(nbytes) is held  # the batch let go after the trim: its buffer is reused
    finally:
        pool.close()


def test_a_batch_that_outlives_its_pool_is_unmapped_quietly(monkeypatch):
    """The last array's finalizer frees the shared block while numpy still views it: unmapping waits."""
    from datapipes import _buffers

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    pool = BufferPool(shared=True, max_idle=1)
    specs, nbytes = layout_arrays({"a": ((16,), np.float32)})
    buf = pool.acquire(nbytes)
    shm = buf._shm
    arrays = pool.hand_out(buf, specs)
    arrays["a"][:] = 5.0
    pool.close()  # the user still holds the batch
    assert arrays["a"].tolist() == [5.0] * 16
    del arrays
    gc.collect()
    assert unraisable == []
    assert shm in _buffers._unmapped  # unlinked, still mapped: its view was alive when it was freed
    other = BufferPool(shared=True, max_idle=0)
    other.release(other.acquire(8))  # any later free unmaps what no view uses any more
    assert shm not in _buffers._unmapped and unraisable == []


def _mappings() -> list[tuple[int, int, str, set[str], int]]:
    """``(start, end, name, VmFlags, AnonHugePages in KiB)`` of every mapping of this process (Linux)."""
    out, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = [lo, hi, head[5] if len(head) > 5 else "", set(), 0]
                out.append(current)
            elif head[0] == "VmFlags:":
                current[3].update(head[1:])
            elif head[0] == "AnonHugePages:":
                current[4] = int(head[1])
    return [tuple(m) for m in out]


def _mapping_of(address: int):
    return next((m for m in _mappings() if m[0] <= address < m[1]), None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_large_private_buffers_get_a_mapping_of_their_own_advised_for_huge_pages():
    """Never heap memory malloc recycles (4 KiB pages once touched): a training process's heap made the pipe 0.7x."""
    from datapipes._buffers import HUGE_PAGE

    pool = BufferPool(shared=False, max_idle=2)
    try:
        specs, nbytes = layout_arrays({"u": ((3, 1000, 1000), np.float32)})  # not a multiple of the huge page
        buf = pool.acquire(nbytes)
        address = buf.memory.ctypes.data
        assert address % HUGE_PAGE == 0 and buf.memory.nbytes == nbytes
        lo, hi, name, flags, _ = _mapping_of(address)
        assert name != "[heap]" and hi >= address + nbytes
        assert "hg" in flags  # MADV_HUGEPAGE: huge pages where transparent huge pages are "madvise" or "always"
        arrays = pool.hand_out(buf, specs)
        arrays["u"][:] = 7.0
        kept = torch.from_numpy(arrays["u"])[1]
        del arrays, buf
        pool.close()  # the buffer is still viewed: it stays mapped and keeps its values
        gc.collect()
        assert kept.eq(7.0).all() and _mapping_of(address) is not None
        del kept
        gc.collect()
        assert _mapping_of(address) is None  # the last view is gone: the mapping went back to the system
    finally:
        pool.close()


def test_small_private_buffers_come_from_numpy():
    from datapipes._buffers import HUGE_PAGE, private_memory

    small = private_memory(HUGE_PAGE - 1)
    assert small.dtype == np.uint8 and small.nbytes == HUGE_PAGE - 1 and small.flags.owndata
    assert not private_memory(HUGE_PAGE).flags.owndata  # a view of its own mapping


def _hand_out_filled(pool, specs, nbytes, value):
    buf = pool.acquire(nbytes)
    arrays = pool.hand_out(buf, specs)
    for array in arrays.values():
        array[:] = value
    return buf, arrays


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("hold", ["dict", "tensor view", "numpy view", "autograd graph", "numpy of a tensor"])
def test_a_buffer_anything_still_uses_is_never_handed_out_again(shared, hold):
    """The pool reuses a buffer's own arrays for every batch: whatever a user keeps of a batch keeps the buffer
    out of reuse, and the kept values stay intact while new batches are written (fails if a buffer is reused
    while in use: the writes below would overwrite the kept values)."""
    pool = BufferPool(shared=shared, max_idle=4)
    try:
        specs, nbytes = layout_arrays({"a": ((4, 3), np.float32), "b": ((6,), np.float64)})
        buf, arrays = _hand_out_filled(pool, specs, nbytes, 1.0)
        if hold == "dict":
            kept = arrays
        elif hold == "tensor view":
            kept = torch.from_numpy(arrays["a"])[1:, 1]
        elif hold == "numpy view":
            kept = arrays["b"][2:]
        elif hold == "numpy of a tensor":
            kept = torch.from_numpy(arrays["a"]).numpy()[0]
        else:  # only autograd holds the tensor: backward reads it
            leaf = torch.from_numpy(arrays["b"]).requires_grad_()
            kept = (leaf * leaf).sum()
            del leaf
        del arrays  # freed at once by reference counting
        for value in (2.0, 3.0, 4.0):  # batches come and go while the user keeps one
            other, arrays = _hand_out_filled(pool, specs, nbytes, value)
            assert other is not buf
            del arrays
        if hold == "autograd graph":
            leaf = kept.grad_fn.next_functions[0][0].next_functions[0][0].variable  # the graph's own reference
            kept.backward()
            assert leaf.grad.eq(2.0).all() and leaf.eq(1.0).all()
        elif hold == "dict":
            assert all(np.all(a == 1.0) for a in kept.values())
        else:
            assert np.all(np.asarray(kept) == 1.0)
        del kept
        leaf = None
        reused = pool.acquire(nbytes)  # nothing uses it any more: back in the pool
        assert reused is buf or buf in pool._free
    finally:
        pool.close()


def test_batches_reuse_the_buffers_own_arrays_until_the_layout_changes():
    pool = BufferPool(shared=False, max_idle=2)
    try:
        specs, nbytes = layout_arrays({"a": ((8,), np.float32)})
        buf = pool.acquire(nbytes)
        first = pool.hand_out(buf, specs)["a"]
        del first
        assert pool.acquire(nbytes) is buf
        again = pool.hand_out(buf, specs)
        assert again["a"] is buf.views(specs)[0]  # no new array per batch
        del again
        smaller, _ = layout_arrays({"a": ((2, 3), np.float32)})
        assert pool.acquire(nbytes) is buf
        assert pool.hand_out(buf, smaller)["a"].shape == (2, 3)
    finally:
        pool.close()


def _huge_kib(array: np.ndarray) -> int:
    """KiB of huge pages in the mappings that hold ``array`` (the kernel merges neighbouring ones)."""
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    return sum(m[4] for m in _mappings() if m[0] < end and start < m[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc/self/smaps and MADV_COLLAPSE")
def test_a_fork_splits_a_buffers_huge_pages_and_hugepages_restores_them():
    """The kernel breaks a copy-on-write huge page at the parent's first write after a fork; restore() collapses
    the mapping back (the measured cost of split pages: 0.62 -> 0.74 ms per 16 MiB copy, for the rest of a run)."""
    import os
    import time

    from datapipes import _buffers
    from datapipes._buffers import HUGE_PAGE, HugePages, private_memory

    memory = private_memory(8 * HUGE_PAGE)
    pages = HugePages(memory)
    memory[:] = 1
    if _huge_kib(memory) == 0:
        pytest.skip("no transparent huge pages on this system")
    pages.restore()  # nothing forked: nothing to do
    child = os.fork()
    if child == 0:  # holds the pages shared until the parent wrote
        time.sleep(1.0)
        os._exit(0)
    try:
        memory[:] = 2  # the write that splits the shared huge pages
        assert _huge_kib(memory) < 8 * HUGE_PAGE // 1024
        pages.restore()
        restored = _huge_kib(memory)
        if restored < 8 * HUGE_PAGE // 1024 and not _buffers._collapse(memory):
            pytest.skip("the kernel refuses MADV_COLLAPSE (Linux < 6.1): restore() can only leave the pages as they are")
        assert restored == 8 * HUGE_PAGE // 1024
        assert (memory == 2).all()
    finally:
        os.waitpid(child, 0)


@pytest.mark.parametrize("shared", [False, True])
def test_the_pool_restores_a_private_buffers_huge_pages_at_its_first_hand_out_after_a_fork(shared, monkeypatch):
    """After the read that split them, before the user sees the batch; once per fork; never for shared memory."""
    from datapipes import _buffers

    collapsed = []
    monkeypatch.setattr(_buffers, "_collapse", lambda array: collapsed.append(array.ctypes.data) or True)
    pool = BufferPool(shared=shared, max_idle=2)
    try:
        specs, nbytes = layout_arrays({"u": ((4, _buffers.HUGE_PAGE // 4), np.float32)})
        buf = pool.acquire(nbytes)
        pool.hand_out(buf, specs)
        assert collapsed == []  # no fork since the buffer was made
        gc.collect()
        _buffers._count_fork()  # what os.register_at_fork calls in the parent
        buf = pool.acquire(nbytes)
        pool.hand_out(buf, specs)
        gc.collect()
        buf = pool.acquire(nbytes)
        pool.hand_out(buf, specs)
        assert collapsed == ([] if shared else [buf.memory.ctypes.data])  # once per fork
    finally:
        pool.close()
