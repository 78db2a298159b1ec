"""What a data file was when a source first opened it, and the check that it still is.

Why: a file that changes under a run is read wrong without any error. HDF5
(and netCDF, which reads through it) fills a read past the end of a file
truncated under an open handle with zeros; a file copied or renamed over the
one being read yields the other file's values, finite and plausible. Neither
is caught by a NaN scan. So every source records, when it first opens a file,
its :class:`FileIdentity` (size, modification time, inode and device) and
checks it again after every batch it reads (one ``os.stat`` per file of the
batch: 2-5 us here) and before every (re)open, e.g. in a reader process after
a fork. A change raises :class:`~datapipes.errors.FileChangedError` naming
the file and what changed.

HDF5 sources also record each dataset's header (:func:`dataset_header`:
storage offset, shape, dtype, chunking, filters) and compare it whenever the
dataset is opened again, which needs no extra I/O. Datasets whose storage was
never (fully) written read as fill values (zeros), so :func:`check_allocated`
refuses them when a source is built.

Not seen: a file rewritten in place keeping its size and modification time
(``touch -r``, ``cp -p`` of a same-size file onto it) and a change to a
chunk file inside a Zarr store (only the store directory is watched). Chunk
checksums (:mod:`datapipes._checksums`) catch changed bytes where the file
has them. See ``docs/reliability.md``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Iterable

import h5py

from .errors import DataPipeError, FileChangedError, MissingDataError

__all__ = ["FileIdentity", "FileWatch", "check_allocated", "check_header", "dataset_header", "resolve_virtual_source",
           "virtual_source_files"]


@dataclass(frozen=True)
class FileIdentity:
    """A file's size, modification time, inode and device, from one ``os.stat``."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: str) -> "FileIdentity":
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise MissingDataError(f"{path}: no such file") from None
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def changes(self, now: "FileIdentity") -> list[str]:
        """What differs from ``now``, in words (empty when nothing does)."""
        out = []
        if (self.inode, self.device) != (now.inode, now.device):
            out.append(f"replaced by another file (inode {self.inode} -> {now.inode}: renamed or moved over it)")
        if self.size != now.size:
            how = "truncated" if now.size < self.size else "grew"
            out.append(f"size {self.size} -> {now.size} bytes ({how})")
        if self.mtime_ns != now.mtime_ns:
            out.append(f"modified at {_time(now.mtime_ns)} (was {_time(self.mtime_ns)})")
        return out


def _time(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(timespec="microseconds")


class FileWatch:
    """The identities of the files a source reads, recorded once, checked on every batch.

    Recorded in the process that builds the source and inherited by forked
    readers (and pickled along), so every process compares against the file
    as it was when the source was built, not as it was when that process
    happened to open it.
    """

    def __init__(self):
        self._known: dict[str, FileIdentity] = {}

    def record(self, path: str) -> None:
        """Remember ``path`` as it is now (the first call per path wins)."""
        if path not in self._known:
            self._known[path] = FileIdentity.of(path)

    def check(self, paths: Iterable[str], context: str = "") -> None:
        """Raise :class:`FileChangedError` naming the first of ``paths`` that changed since recorded."""
        for path in paths:
            before = self._known.get(path)
            if before is None:
                continue
            try:  # the common case, unchanged, without building a FileIdentity (a few us per batch)
                st = os.stat(path)
            except FileNotFoundError:
                pass
            else:
                if (st.st_mtime_ns == before.mtime_ns and st.st_size == before.size and st.st_ino == before.inode
                        and st.st_dev == before.device):
                    continue
            try:
                now = FileIdentity.of(path)
            except MissingDataError:
                raise FileChangedError(
                    f"{path}: the file was deleted or moved away while it was being read{context}; "
                    "values read from it may be wrong. Restore it, or restart the run on the new data"
                ) from None
            changes = before.changes(now)
            if changes:
                raise FileChangedError(
                    f"{path}: the file changed while it was being read{context}: {'; '.join(changes)}. "
                    "Values read from it may be wrong (HDF5 returns zeros past a truncated end; a replaced "
                    "file gives its own values). Restore the file, or restart the run on the new data"
                )


def dataset_header(dset: h5py.Dataset) -> tuple:
    """What an open HDF5 dataset's object header says about its data: a few metadata calls, no data read."""
    plist = dset.id.get_create_plist()
    filters = tuple(plist.get_filter(i)[0] for i in range(plist.get_nfilters()))
    return (dset.id.get_offset(), dset.shape, dset.dtype.str, dset.chunks, filters, dset.is_virtual)


def check_header(dset: h5py.Dataset, recorded: tuple | None, where: str) -> None:
    """Raise :class:`FileChangedError` if ``dset``'s header differs from the one recorded at the first open."""
    if recorded is None:
        return
    now = dataset_header(dset)
    if now != recorded:
        names = ("storage offset", "shape", "dtype", "chunks", "filters", "virtual")
        diff = "; ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, recorded, now) if a != b)
        raise FileChangedError(
            f"{where}: the dataset was rewritten since the source was built ({diff}); restart the run on the new data"
        )


def check_allocated(dset: h5py.Dataset, where: str) -> None:
    """Refuse a dataset whose storage was never (fully) written: HDF5 reads fill values (zeros) there."""
    if dset.is_virtual or dset.size == 0:
        return
    layout = dset.id.get_create_plist().get_layout()
    if layout == h5py.h5d.CONTIGUOUS and dset.id.get_storage_size() == 0:
        raise DataPipeError(
            f"{where}: the dataset's data was never written (no storage allocated), so every read would return "
            "its fill value; the file is incomplete: write it again"
        )
    if layout == h5py.h5d.CHUNKED:
        grid = [-(-n // c) for n, c in zip(dset.shape, dset.chunks)]
        expected = 1
        for g in grid:
            expected *= g
        written = dset.id.get_num_chunks()
        if written < expected:
            raise DataPipeError(
                f"{where}: {expected - written} of {expected} chunks of the dataset were never written, so reads "
                "there return its fill value; the file is incomplete: write it again"
            )


def virtual_source_files(dset: h5py.Dataset, path: str) -> list[str]:
    """The files an HDF5 virtual dataset maps (absolute paths), checked to exist.

    A missing source file reads as the virtual dataset's fill value (NaN,
    or 0 for integers) without an error, and so does one HDF5 cannot open
    (truncated): both are refused here, and the files found are watched
    like the virtual file itself.
    """
    if not dset.is_virtual:
        return []
    out = []
    for vmap in dset.virtual_sources():
        name = vmap.file_name
        if name == ".":
            continue
        full = resolve_virtual_source(name, path)
        if full in out:
            continue
        if not os.path.exists(full):
            raise MissingDataError(
                f"{path}: virtual dataset /{dset.name.lstrip('/')} maps {name}, which does not exist "
                f"(looked for {full}); HDF5 would read its fill value there"
            )
        try:
            h5py.File(full, "r").close()
        except OSError as err:
            raise DataPipeError(
                f"{path}: virtual dataset /{dset.name.lstrip('/')} maps {full}, which HDF5 cannot open ({err}); "
                "HDF5 would read its fill value there"
            ) from None
        out.append(full)
    return out


def resolve_virtual_source(name: str, path: str) -> str:
    """The file a virtual dataset of ``path`` maps as ``name`` (relative names: next to ``path``, as HDF5 looks)."""
    if name == ".":
        return path
    return os.path.normpath(name if os.path.isabs(name) else os.path.join(os.path.dirname(path), name))
