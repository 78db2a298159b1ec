"""Structured fields stored in HDF5, read one rank's hyperslab at a time.

Three layouts are understood (``layout=``):

* ``"stacked"`` — each variable is one dataset ``/<var>`` with a leading
  sample dim, ``(n_samples, *grid)``. Several files are concatenated.
* ``"groups"`` — one group per sample, ``/<group>/<var>`` of shape ``grid``
  (all top-level groups in name order unless ``groups=`` lists them).
* ``"files"`` — one file per sample, ``/<var>`` of shape ``grid``.

Each read is one ``H5Dread`` of the rank's box (halo included) into a buffer
the pipe preallocated, as ``Dataset.read_direct`` does but with the box's
dataspaces built once (see :class:`_BoxReader`), so no temporary array is
created and the bytes requested from h5py are exactly the box's. ``dtype=`` converts while
reading (HDF5 does it in its own loop), e.g. float64 files to float32.

Chunking advice
---------------
A read touches every HDF5 chunk its box intersects, and a compressed chunk is
decompressed whole. Rank slabs therefore cost no more than their own bytes
only when chunk boundaries fall on shard boundaries:

* contiguous (unchunked) datasets are always aligned; use them for data
  written once and read as slabs, without compression;
* chunked datasets should use :func:`aligned_chunks`: along each split dim the
  chunk extent divides every shard boundary (for a split of 1024 rows over 4
  ranks any divisor of 256), along other dims anything;
* a halo reaches into the neighbour's chunk and decompresses all of it
  (measured here: a 2-row halo with 256-row gzip chunks cost 2.4x the slab),
  so with halos keep chunks thin along split dims or skip compression;
* keep the sample dim's chunk extent at 1 so a sample is read alone.
"""

from __future__ import annotations

import bisect
from math import gcd, prod
from typing import Sequence

import h5py
import numpy as np

from . import _checksums
from ._files import expand_paths, open_h5
from ._identity import FileWatch, check_allocated, check_header, dataset_header, virtual_source_files
from .decomposition import DomainDecomposition
from .errors import DataPipeError, MissingDataError
from .source import Box, GridSource

__all__ = ["HDF5Fields", "aligned_chunks", "default_chunks"]

LAYOUTS = ("stacked", "groups", "files")


class HDF5Fields(GridSource):
    """Grid variables of many samples in HDF5 files (see the module docs for layouts).

    Args:
        paths: a file, a glob pattern, or a sequence of them (sorted when globbed).
        variables: names of the datasets to read, one per variable.
        layout: ``"stacked"``, ``"groups"`` or ``"files"``.
        groups: with ``layout="groups"``, the sample groups in order (default:
            every top-level group of each file, sorted by name).
        dtype: read every variable as this dtype (default: each dataset's own).
        verify_checksums: verify the chunks' Fletcher-32 checksums where the
            file has them (the default; HDF5 does it as it reads a chunk, and
            a mismatch raises :class:`~datapipes.errors.ChecksumError` naming
            file, variable and sample). False skips the check (to measure its
            cost or salvage a damaged file). Files without checksums read alike.

    Every file is opened once here to check that the variables exist and share
    one grid shape; errors name the file, the variable and the shapes. Each
    file's identity (size, mtime, inode) and each dataset's header are
    recorded then, and a file that changes afterwards raises
    :class:`~datapipes.errors.FileChangedError` at the next batch read from it
    (see :mod:`datapipes._identity`). A dataset whose data was never written
    (HDF5 would read its fill value) and a virtual dataset mapping a missing
    file are refused here.
    """

    def __init__(self, paths, variables: Sequence[str], *, layout: str = "stacked",
                 groups: Sequence[str] | None = None, dtype=None, verify_checksums: bool = True):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if groups is not None and layout != "groups":
            raise ValueError('groups= only applies to layout="groups"')
        self.variables = tuple(variables)
        if not self.variables:
            raise ValueError("variables must name at least one dataset")
        self.paths = expand_paths(paths)
        self.layout = layout
        self._samples: list[tuple[int, str]] = []  # "groups"/"files": (file index, group prefix)
        self._starts: list[int] = [0]  # "stacked": first sample of each file
        self._dtypes = {}
        self.sample_shape = None
        self.verify_checksums = bool(verify_checksums)
        self._watch = FileWatch()
        self._files: list[list[str]] = []  # per file: its path and the files its virtual datasets map
        self._headers: dict[tuple[int, str], tuple] = {}  # (file index, dataset) -> header at the first open
        for file_index, path in enumerate(self.paths):
            self._scan(file_index, path, groups, dtype)
        if len(self) == 0:
            raise DataPipeError(f"{self}: the files hold no samples")

    # ---------------------------------------------------------------- scan
    def _scan(self, file_index: int, path: str, groups, dtype) -> None:
        self._watch.record(path)
        self._files.append([path])
        with open_h5(path) as f:
            if self.layout == "stacked":
                n = None
                for var in self.variables:
                    dset = _dataset(f, path, "", var)
                    if dset.ndim < 1 or (n is not None and dset.shape[0] != n):
                        raise DataPipeError(
                            f"{path}: dataset '{var}' has shape {dset.shape}; with layout='stacked' "
                            f"every variable needs the same leading sample dim ({n} samples)"
                        )
                    n = dset.shape[0]
                    self._note(var, dset, dset.shape[1:], f"{path}:/{var}", dtype)
                    self._identify(file_index, var, dset, path)
                self._starts.append(self._starts[-1] + n)
                return
            prefixes = [""] if self.layout == "files" else _groups(f, path, groups)
            for prefix in prefixes:
                for var in self.variables:
                    dset = _dataset(f, path, prefix, var)
                    self._note(var, dset, dset.shape, f"{path}:/{prefix}{var}", dtype)
                    self._identify(file_index, prefix + var, dset, path)
                self._samples.append((file_index, prefix))

    def _note(self, var: str, dset: h5py.Dataset, shape, where: str, dtype) -> None:
        """Record the first sample's grid shape and dtypes; check later samples against them."""
        if self.sample_shape is None:
            self.sample_shape = tuple(shape)
        self._check_shape(shape, f"dataset {where} (shape {dset.shape})")
        self._dtypes.setdefault(var, np.dtype(dtype or dset.dtype))

    def _identify(self, file_index: int, name: str, dset: h5py.Dataset, path: str) -> None:
        """Record the dataset's header and the files it maps; refuse unwritten storage and missing sources."""
        check_allocated(dset, f"{path}:/{name}")
        self._headers[(file_index, name)] = dataset_header(dset)
        for source in virtual_source_files(dset, path):
            if source not in self._files[file_index]:
                self._watch.record(source)
                self._files[file_index].append(source)

    # ------------------------------------------------------------- locate
    def __len__(self) -> int:
        return self._starts[-1] if self.layout == "stacked" else len(self._samples)

    def _locate(self, index: int) -> tuple[int, str, int | None]:
        """``(file index, group prefix, index along the leading dim or None)``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {self} ({len(self)} samples)")
        if self.layout == "stacked":
            file_index = bisect.bisect_right(self._starts, index) - 1
            return file_index, "", index - self._starts[file_index]
        file_index, prefix = self._samples[index]
        return file_index, prefix, None

    def where(self, index: int, variable: str) -> str:
        file_index, prefix, lead = self._locate(index)
        at = "" if lead is None else f"[{lead}]"
        return (f"variable '{variable}' of sample {index} ({self.paths[file_index]}:/{prefix}{variable}{at}, "
                f"sample shape {self.sample_shape})")

    # ---------------------------------------------------------------- read
    def read(self, index: int, variable: str, box: Box, out: np.ndarray) -> int:
        file_index, prefix, lead = self._locate(index)
        handles = self._handles()
        key = (file_index, prefix + variable)
        if key not in handles:
            path = self.paths[file_index]
            if path not in handles:  # (re)opened, e.g. after a fork: the file must still be the one scanned
                self._watch.check(self._files[file_index], f" (reopening it for {self.where(index, variable)})")
                handles[path] = open_h5(path)
            dset = handles[path][prefix + variable]
            check_header(dset, self._headers.get(key), self.where(index, variable))
            handles[key] = _BoxReader(dset, self.verify_checksums)
        reader = handles[key]
        if out.size:
            try:
                reader.read(box, lead, out)
            except OSError as err:
                raise _checksums.read_error(err, reader.dset, self.paths[file_index], self.where(index, variable)) from err
        return out.size * reader.itemsize

    def check_files(self, indices) -> None:
        if self.layout == "stacked" and len(self.paths) == 1:
            self._watch.check(self._files[0], " by the pipe")
            return
        seen = set()
        for index in indices:
            file_index = self._locate(index)[0]
            if file_index not in seen:
                seen.add(file_index)
                self._watch.check(self._files[file_index], " by the pipe")

    def close(self) -> None:
        for handle in self._handles().values():
            if isinstance(handle, h5py.File):
                handle.close()
        super().close()

    def __repr__(self) -> str:
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return f"HDF5Fields({self.paths[0]}{more}, layout={self.layout!r})"


class _BoxReader:
    """An open dataset, read box by box with the dataspaces of each box built once.

    Why not ``Dataset.read_direct`` on every read: it rebuilds the file and
    memory selections in Python on every call (about 25 us, as long as
    copying a 100 KiB slab from the page cache), while a rank reads the same box of
    every sample. The dataspaces are therefore made once per box (per process:
    the reader lives in :meth:`Source._handles`) and each read is the single
    ``H5Dread`` that ``read_direct`` issues, with the same dtype conversion
    (the memory type follows ``out``; made once per dtype, as ``H5Dread``
    would otherwise make and register a new one per call, ~6 us). A box or
    buffer this fast path does not cover (steps, a shape other than the
    box's) goes through ``read_direct``, with its checks and errors.

    The box read last is recognised by identity (a pipe hands the same box
    object for every sample of a layout), so a repeated read skips building
    the cache key. Every such microsecond counts more than it seems: the
    Python between two reads of a few MiB runs with caches the copy has just
    flushed, at 3-5x its warm cost.
    """

    def __init__(self, dset: h5py.Dataset, verify_checksums: bool = True):
        if not verify_checksums:
            dset._dxpl = _checksums.unverified_dxpl()  # both paths below read with the dataset's dxpl
        self.dset = dset
        self.itemsize = dset.dtype.itemsize
        self._spaces: dict = {}  # (box, out shape) -> (file space, memory space, starts, counts) or None
        self._last: tuple | None = None  # (box, out shape, its spaces): holding the box keeps its id unique
        self._memory_types: dict = {}  # out dtype -> HDF5 memory type, as H5Dread would make it (h5t.py_create)

    def read(self, box: Box, lead: int | None, out: np.ndarray) -> None:
        last = self._last
        if last is not None and last[0] is box and last[1] == out.shape:
            spaces = last[2]
        else:
            spaces = self._spaces_of(box, lead, out.shape)
            self._last = (box, out.shape, spaces)
        if spaces is None:
            self.dset.read_direct(out, source_sel=box if lead is None else (lead, *box))
            return
        fspace, mspace, starts, counts = spaces
        mtype = self._memory_types.get(out.dtype)
        if mtype is None:
            mtype = self._memory_types[out.dtype] = h5py.h5t.py_create(out.dtype)
        with h5py._objects.phil:  # the selection and the read, atomically (a thread may share the source)
            if lead is not None:
                fspace.select_hyperslab((lead, *starts), (1, *counts))
            self.dset.id.read(mspace, fspace, out, mtype, dxpl=self.dset._dxpl)

    def _spaces_of(self, box: Box, lead: int | None, shape: tuple[int, ...]):
        """The cached dataspaces for ``box`` into an array of ``shape`` (see :meth:`_make_spaces`)."""
        try:  # slices are unhashable before Python 3.12
            key = (tuple([(s.start, s.stop, s.step) for s in box]), shape)
        except AttributeError:  # not a box of slices
            key = None
        spaces = self._spaces.get(key, False)
        if spaces is False:
            if len(self._spaces) >= 256:  # callers reading many different boxes: keep it bounded
                self._spaces.clear()
            spaces = self._spaces[key] = self._make_spaces(box, lead, shape)
        return spaces

    def _make_spaces(self, box: Box, lead: int | None, shape: tuple[int, ...]):
        """Dataspaces for reading ``box`` into an array of ``shape``; None where read_direct must do it."""
        grid = self.dset.shape if lead is None else self.dset.shape[1:]
        if len(box) != len(grid) or len(shape) != len(grid) or not all(
            isinstance(s, slice) and s.step in (None, 1) and isinstance(s.start, int) and isinstance(s.stop, int)
            and 0 <= s.start <= s.stop <= n for s, n in zip(box, grid)
        ):
            return None
        starts = tuple(s.start for s in box)
        counts = tuple(s.stop - s.start for s in box)
        if counts != tuple(shape):
            return None
        with h5py._objects.phil:
            fspace = self.dset.id.get_space()
            if lead is None:
                fspace.select_hyperslab(starts, counts)
            mspace = h5py.h5s.create_simple(counts)
        return fspace, mspace, starts, counts


def aligned_chunks(decomposition: DomainDecomposition, *, itemsize: int, leading: Sequence[int] = (1,),
                   max_bytes: int = 4 << 20) -> tuple[int, ...]:
    """An HDF5 chunk shape whose boundaries fall on the decomposition's shard boundaries.

    Along each split dim the extent divides every interior shard boundary;
    the chunk is then shrunk (largest dim first, split dims by divisors only)
    until it holds at most ``max_bytes``. ``leading`` is prepended (1 for the
    sample dim of a stacked dataset).
    """
    chunk = list(decomposition.global_shape)
    split = set(decomposition.split_dims)
    for d, sizes in zip(decomposition.split_dims, decomposition.sizes):
        boundaries = [b for b in np.cumsum(sizes[:-1]).tolist() if 0 < b < chunk[d]]
        step = 0
        for b in boundaries:
            step = gcd(step, b)
        chunk[d] = step or chunk[d]
    chunk = [max(1, c) for c in chunk]
    while prod(chunk) * itemsize > max_bytes and max(chunk) > 1:
        d = max(range(len(chunk)), key=lambda k: chunk[k])
        chunk[d] = chunk[d] // _smallest_factor(chunk[d]) if d in split else -(-chunk[d] // 2)
    return (*leading, *chunk)


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _dataset(f: h5py.File, path: str, prefix: str, var: str) -> h5py.Dataset:
    name = prefix + var
    obj = f.get(name)
    if obj is None:
        parent = f[prefix] if prefix else f
        found = sorted(k for k, v in parent.items() if isinstance(v, h5py.Dataset))
        raise MissingDataError(f"{path}: no variable '{var}' in /{prefix} (datasets there: {found})")
    if not isinstance(obj, h5py.Dataset):
        raise DataPipeError(f"{path}: /{name} is a group, not a dataset holding variable '{var}'")
    return obj


def _groups(f: h5py.File, path: str, groups) -> list[str]:
    if groups is None:
        names = sorted(k for k, v in f.items() if isinstance(v, h5py.Group))
    else:
        names = [str(g).strip("/") for g in groups]
        missing = [g for g in names if not isinstance(f.get(g), h5py.Group)]
        if missing:
            raise MissingDataError(f"{path}: no sample group(s) {missing}")
    return [f"{name}/" for name in names]


def default_chunks(shape: Sequence[int], itemsize: int, *, leading: int = 1, max_bytes: int = 1 << 20) -> tuple[int, ...]:
    """Chunks for a dataset that must be chunked (checksums) when no decomposition is known.

    One sample per chunk along the ``leading`` sample dims; the grid's first
    dim is halved until a chunk holds at most ``max_bytes``, then the next
    one: chunks of whole rows. The pipe splits the leading grid dims by
    default, so a rank's box then reads whole chunks of its own rows (save
    at shard boundaries that fall inside a chunk), each one contiguous run of
    its buffer. Use :func:`aligned_chunks` when the decomposition is known.
    """
    chunk = [1] * leading + [max(1, int(n)) for n in shape[leading:]]
    for d in range(leading, len(chunk)):
        while prod(chunk) * itemsize > max_bytes and chunk[d] > 1:
            chunk[d] = -(-chunk[d] // 2)
    return tuple(chunk)


def _smallest_factor(n: int) -> int:
    k = 2
    while k * k <= n:
        if n % k == 0:
            return k
        k += 1
    return n
