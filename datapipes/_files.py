"""File handling shared by readers and writers: path lists, HDF5 opens with clear errors, atomic writes."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from pathlib import Path
from typing import Iterator

import h5py

from .errors import DataPipeError, MissingDataError

__all__ = ["atomic_path", "expand_paths", "open_h5"]


def expand_paths(paths) -> list[str]:
    """Absolute paths from a path, a glob pattern or a sequence of them (globs sorted)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = []
    for item in items:
        item = str(item)
        if glob.has_magic(item):
            found = sorted(glob.glob(item))
            if not found:
                raise MissingDataError(f"{item}: the pattern matches no file")
            out.extend(found)
        else:
            out.append(item)
    if not out:
        raise ValueError("paths must name at least one file")
    return [str(Path(p).resolve()) for p in out]


def open_h5(path: str) -> h5py.File:
    """Open an HDF5 file read-only; a missing or unreadable file raises naming it."""
    if not os.path.exists(path):
        raise MissingDataError(f"{path}: no such file")
    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise DataPipeError(f"{path}: cannot be opened as HDF5 ({err})") from None


@contextlib.contextmanager
def atomic_path(path) -> Iterator[str]:
    """Yield a temporary name next to ``path``; rename it to ``path`` only if the block succeeds.

    Readers never see a half-written file, and a failure leaves nothing
    behind: the temporary file (or directory, for Zarr stores) is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield str(tmp)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
