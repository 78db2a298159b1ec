"""Checksums of the data in HDF5 files: HDF5's Fletcher-32 filter, one checksum per chunk.

Why per chunk and not per sample: a rank reads only its box of a sample, so a
checksum over a whole sample could be verified only by reading the whole
sample on every rank (P times the I/O of a domain-parallel read). HDF5's
``fletcher32`` filter stores a 4-byte checksum with every chunk and verifies
it whenever the chunk is read, i.e. for exactly the chunks a box touches,
and any HDF5 tool can read and check such a file. The price is that the
dataset must be chunked (checksummed writers chunk it; see
:func:`datapipes.hdf5.default_chunks` and :func:`~datapipes.hdf5.aligned_chunks`):
a box reads whole chunks, so chunk boundaries should fall on shard boundaries.
Measured costs are in ``docs/reliability.md``.

The writers (:func:`datapipes.synthetic.write_hdf5`, ``write_netcdf``,
:func:`datapipes.write_shards`) add the filter by default
(``checksums=False`` to write without). The readers verify wherever a file
has it; a file without checksums reads as before. HDF5 has no switch for this
in h5py: ``verify_checksums=False`` on :class:`~datapipes.HDF5Fields` sets
``H5Pset_edc_check`` on the transfer property list through ctypes (Linux), to
measure the cost or to salvage a damaged file.
"""

from __future__ import annotations

import ctypes
import functools
import os

import h5py

from ._identity import resolve_virtual_source
from .errors import ChecksumError, DataPipeError

__all__ = ["FILTER_OPTIONS", "read_error", "unverified_dxpl"]

FILTER_OPTIONS = {"fletcher32": True}  # h5py create_dataset keywords of the checksum filter


def has_checksums(dset: h5py.Dataset, path: str) -> bool:
    """Whether ``dset`` (or, for a virtual dataset, a dataset it maps) has Fletcher-32 checksums."""
    if dset.is_virtual:  # only on an error path: opening the mapped files costs nothing that matters
        for vmap in dset.virtual_sources():
            full = resolve_virtual_source(vmap.file_name, path)
            try:
                with h5py.File(full, "r") as f:
                    if vmap.dset_name in f and has_checksums(f[vmap.dset_name], full):
                        return True
            except OSError:
                continue
        return False
    plist = dset.id.get_create_plist()
    return any(plist.get_filter(i)[0] == h5py.h5z.FILTER_FLETCHER32 for i in range(plist.get_nfilters()))


def read_error(err: OSError, dset: h5py.Dataset, path: str, where: str) -> DataPipeError:
    """The error to raise for an HDF5 read of ``path`` that failed: a checksum mismatch says so, naming ``where``."""
    text = str(err)
    if "filter returned failure" in text or "checksum" in text.lower():
        if has_checksums(dset, path):
            return ChecksumError(
                f"{where}: a chunk read does not match its Fletcher-32 checksum (HDF5: {text}); bytes of the "
                "file changed after it was written (disk, copy or transfer error): restore the file from a good copy"
            )
        return DataPipeError(
            f"{where}: a chunk cannot be decoded (HDF5: {text}); the file is damaged: restore it from a good copy"
        )
    return DataPipeError(f"{where}: HDF5 read failed ({text})")


@functools.lru_cache(maxsize=1)
def unverified_dxpl() -> h5py.h5p.PropDXID:
    """A dataset transfer property list with checksum verification off (``H5Pset_edc_check(H5Z_DISABLE_EDC)``)."""
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    setter = _hdf5_function("H5Pset_edc_check")
    setter.argtypes = [ctypes.c_int64, ctypes.c_int]
    if setter(dxpl.id, h5py.h5z.DISABLE_EDC) < 0:
        raise DataPipeError("H5Pset_edc_check failed: checksum verification cannot be turned off")
    return dxpl


def _hdf5_function(name: str):
    """``name`` from the HDF5 library h5py loaded (h5py does not wrap every HDF5 call)."""
    libraries = []
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            libraries = sorted({line.split()[-1] for line in maps if "/libhdf5" in line and "_hl" not in line})
    for library in libraries:
        try:
            return getattr(ctypes.CDLL(library), name)
        except (OSError, AttributeError):
            continue
    raise DataPipeError(
        f"cannot find {name} in the HDF5 library h5py loaded (looked in {libraries or 'none: not Linux'}); "
        "verify_checksums=False is not available here"
    )
