"""A process closes its sources' files before it forks (datapipes._fork_guard).

Each test reads in this process (files open), forks, and checks both sides:
the parent's handles are closed at the fork and reopen on the next read; the
child, which starts with nothing open, reads the same values.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from datapipes import MeshSource, _fork_guard, prepare_mesh
from datapipes._buffers import ArraySpec
from datapipes.prefetch import ReadTask, fill
from datapipes.synthetic import point_cloud

from ._data import GRID_FORMATS, VARIABLES, grid_fields, open_grid, write_grid

_FULL = (slice(0, 16), slice(0, 16))


def _read(source, index: int) -> np.ndarray:
    out = np.empty((16, 16), np.float32)
    source.read(index, "pressure", _FULL, out)
    return out


def _forked(child, timeout: float = 60.0) -> int:
    """Run ``child()`` in a forked process; its exit code (0: it returned True; -9: it hung and was killed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    return os.waitstatus_to_exitcode(done[1])


def _open_handles(source) -> list:
    """The library objects this process holds open for ``source`` (files and datasets)."""
    return list(source.__dict__.get("_handle_cache", {}).values())


@pytest.mark.parametrize("fmt", GRID_FORMATS)
def test_a_fork_closes_the_files_read_here_and_the_child_reads_the_same_values(fmt, tmp_path):
    source = open_grid(fmt, write_grid(fmt, tmp_path))
    want = grid_fields()["pressure"]
    assert np.array_equal(_read(source, 1), want[1])
    held = _open_handles(source)
    assert held, "the read opened nothing to guard"
    assert _forked(lambda: np.array_equal(_read(source, 2), want[2]) and _open_handles(source) != []) == 0
    assert _open_handles(source) == []  # closed at the fork, in the parent
    for handle in held:  # and really closed, not only forgotten
        if hasattr(handle, "id"):  # h5py File / Dataset
            assert not handle.id.valid
    assert np.array_equal(_read(source, 3), want[3])  # reopened lazily
    assert _open_handles(source)
    assert _forked(lambda: np.array_equal(_read(source, 4), want[4])) == 0  # tracked again after reopening
    assert _open_handles(source) == []


def test_xarray_keeps_no_file_of_the_parent_in_its_cache(tmp_path):
    """xarray's process-wide file cache is where the CI hang's netCDF handle lived."""
    from xarray.backends.file_manager import FILE_CACHE

    source = open_grid("netcdf", write_grid("netcdf", tmp_path))
    before = len(FILE_CACHE)
    _read(source, 0)
    assert len(FILE_CACHE) == before + 1
    assert _forked(lambda: len(FILE_CACHE) == before and np.array_equal(_read(source, 5), grid_fields()["pressure"][5])) == 0
    assert len(FILE_CACHE) == before


def test_a_fork_waits_for_a_read_in_another_thread_and_never_breaks_it(tmp_path):
    """A reader thread keeps reading while the main thread forks: every batch it reads is right, and
    every child can read too (a fork in the middle of an h5py call would leave the child's h5py lock held)."""
    source = open_grid("hdf5-chunked", write_grid("hdf5-chunked", tmp_path))
    want = grid_fields()
    arrays = tuple(ArraySpec(v, i * 1024, (1, 16, 16), "float32") for i, v in enumerate(VARIABLES))
    memory = bytearray(2 * 16 * 16 * 4)
    stop, reads, errors = threading.Event(), [0], []

    def reader():
        try:
            while not stop.is_set():
                index = reads[0] % 6
                fill(source, ReadTask(1, None, arrays, (index,), ({v: _FULL for v in VARIABLES},)), memory, (), False)
                got = np.frombuffer(memory, np.float32).reshape(2, 16, 16)
                if not (np.array_equal(got[0], want["permeability"][index]) and np.array_equal(got[1], want["pressure"][index])):
                    errors.append(f"sample {index} read wrong")
                reads[0] += 1
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for k in range(20):
            assert _forked(lambda: np.array_equal(_read(source, k % 6), want["pressure"][k % 6])) == 0
    finally:
        stop.set()
        thread.join()
    assert errors == [] and reads[0] > 0


def test_the_guard_is_reentrant_and_fresh_in_the_child():
    """A fork from inside a read (a transform that forks) must not deadlock on the guard."""
    with _fork_guard.reading():
        assert _forked(lambda: _fork_guard.reading().acquire(blocking=False)) == 0
    assert _fork_guard.reading().acquire(blocking=False)  # released again in the parent
    _fork_guard.reading().release()


def test_a_mesh_source_is_closed_at_a_fork_too(tmp_path):
    mesh = point_cloud(120, kind="volume", seed=4)
    source = MeshSource(prepare_mesh(tmp_path / "v.h5", mesh.points, mesh.fields))
    n = source.num_points(0)

    def points() -> np.ndarray:
        out = np.empty((n, 3), source.dtype("points"))
        source.read(0, "points", (slice(0, n), slice(0, 3)), out)
        return out

    want = points()
    held = _open_handles(source)
    assert held
    assert _forked(lambda: np.array_equal(points(), want)) == 0
    assert _open_handles(source) == [] and not held[0].id.valid
    assert np.array_equal(points(), want)


def test_a_source_that_fails_to_close_leaves_the_others_closed(tmp_path):
    broken, fine = (open_grid("hdf5", write_grid("hdf5", tmp_path / name)) for name in ("a", "b"))
    _read(broken, 0), _read(fine, 0)

    def refuse():
        raise OSError("device busy")

    broken.close = refuse
    with pytest.warns(RuntimeWarning, match="closing .* before a fork failed: OSError"):
        assert _forked(lambda: True) == 0
    assert _open_handles(fine) == []
    del broken.close  # closes normally again
