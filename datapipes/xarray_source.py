"""Structured fields from netCDF or Zarr, through xarray.

The file is opened with ``xarray.open_dataset`` (netCDF, any installed
engine) or with the ``zarr`` engine for ``*.zarr`` stores, without dask. Named
selections (``sel=`` by label, ``isel=`` by position, e.g. a ``level`` or a
``lat`` band) are applied lazily when the file is opened, so the sample grid
is the selection. Each read is a lazy ``isel`` of one rank's box followed by
``.values``: xarray's lazy indexing fetches only that box from the backend,
never the full array.

The file is opened in each reading process separately, and closed after the
metadata checks in the constructor, because netCDF handles (HDF5 underneath)
must not cross a fork.

The file's identity (size, mtime, inode; for a Zarr store, its directory's)
is recorded in the constructor and checked after every batch and before
every reopen: a file truncated, replaced or rewritten under the run raises
:class:`~datapipes.errors.FileChangedError` (see :mod:`datapipes._identity`).
netCDF-4 variables written with Fletcher-32 checksums
(:func:`datapipes.synthetic.write_netcdf` does by default) are verified by
the netCDF library; a read that fails raises
:class:`~datapipes.errors.DataPipeError` naming file, variable and sample.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import xarray as xr

from ._identity import FileWatch
from .errors import DataPipeError, MissingDataError
from .source import Box, GridSource

__all__ = ["XarrayFields"]


class XarrayFields(GridSource):
    """Variables of a netCDF file or Zarr store, split over named dims.

    Args:
        path: the netCDF file or Zarr store.
        variables: data variables to read.
        sample_dim: dim that indexes samples (e.g. ``"time"``); ``None`` means
            the file is one sample.
        dims: the grid dims in the order the arrays are laid out for the
            model (default: the first variable's dims without ``sample_dim``).
            ``split_dims`` of the pipe index into this order.
        sel: named selections by label, applied first.
        isel: named selections by position, applied first.
        engine: xarray engine (default: ``"zarr"`` for ``*.zarr`` or directories,
            else xarray's choice).
        dtype: read every variable as this dtype (default: the decoded dtype).
    """

    def __init__(self, path, variables: Sequence[str], *, sample_dim: str | None = None,
                 dims: Sequence[str] | None = None, sel: Mapping | None = None,
                 isel: Mapping | None = None, engine: str | None = None, dtype=None):
        self.path = str(Path(path).resolve())
        self.variables = tuple(variables)
        if not self.variables:
            raise ValueError("variables must name at least one data variable")
        self.sample_dim = sample_dim
        self._sel = dict(sel or {})
        self._isel = dict(isel or {})
        self._engine = engine or ("zarr" if self.path.endswith(".zarr") or os.path.isdir(self.path) else None)
        self.dims = None if dims is None else tuple(dims)
        self.sample_shape = None
        self._watch = FileWatch()
        if os.path.exists(self.path):
            self._watch.record(self.path)
        ds = self._open()
        try:
            self._inspect(ds, dtype)
        finally:
            ds.close()

    def _open(self) -> xr.Dataset:
        if not os.path.exists(self.path):
            raise MissingDataError(f"{self.path}: no such file or store")
        try:
            ds = xr.open_dataset(self.path, engine=self._engine, chunks=None)
        except (OSError, ValueError) as err:
            raise DataPipeError(f"{self.path}: xarray cannot open it ({err})") from None
        missing = [v for v in self.variables if v not in ds.data_vars]
        if missing:
            ds.close()
            raise MissingDataError(
                f"{self.path}: no variable(s) {missing} (data variables: {sorted(ds.data_vars)})"
            )
        try:
            return ds[list(self.variables)].isel(self._isel).sel(self._sel)
        except (KeyError, ValueError, IndexError) as err:
            ds.close()
            raise DataPipeError(f"{self.path}: selection sel={self._sel} isel={self._isel} failed: {err}") from None

    def _inspect(self, ds: xr.Dataset, dtype) -> None:
        first = ds[self.variables[0]]
        if self.sample_dim is not None and self.sample_dim not in first.dims:
            raise DataPipeError(
                f"{self.path}: variable '{first.name}' has dims {first.dims}, without the sample dim "
                f"'{self.sample_dim}'"
            )
        if self.dims is None:
            self.dims = tuple(d for d in first.dims if d != self.sample_dim)
        expected = set(self.dims) | ({self.sample_dim} if self.sample_dim else set())
        self.sample_shape = tuple(ds.sizes[d] for d in self.dims)
        self._dtypes = {}
        for var in self.variables:
            da = ds[var]
            if set(da.dims) != expected:
                raise DataPipeError(
                    f"{self.path}: variable '{var}' has dims {da.dims} and shape {da.shape}; "
                    f"expected dims {sorted(expected)} like '{first.name}'"
                )
            self._dtypes[var] = np.dtype(dtype or da.dtype)
        self._num_samples = 1 if self.sample_dim is None else ds.sizes[self.sample_dim]
        if self._num_samples == 0:
            raise DataPipeError(f"{self.path}: the selection leaves no samples along '{self.sample_dim}'")

    def _dataset(self) -> xr.Dataset:
        handles = self._handles()
        if "ds" not in handles:  # (re)opened, e.g. after a fork: the file must still be the one inspected
            self._watch.check([self.path], " (reopening it)")
            handles["ds"] = self._open()
        return handles["ds"]

    def __len__(self) -> int:
        return self._num_samples

    def where(self, index: int, variable: str) -> str:
        at = f"{self.sample_dim}={index}" if self.sample_dim else "the only sample"
        return (f"variable '{variable}' at {at} of {self.path} (dims {self.dims}, "
                f"sample shape {self.sample_shape})")

    def read(self, index: int, variable: str, box: Box, out: np.ndarray) -> int:
        da = self._dataset()[variable]
        if self.sample_dim is not None:
            da = da.isel({self.sample_dim: index})
        try:
            values = da.transpose(*self.dims).isel(dict(zip(self.dims, box))).values
        except (OSError, RuntimeError) as err:  # netCDF: a checksum mismatch or a damaged chunk ("HDF error")
            raise DataPipeError(
                f"{self.where(index, variable)}: reading the box {tuple((b.start, b.stop) for b in box)} failed "
                f"({type(err).__name__}: {err}); the file may be damaged (a chunk that fails its checksum) or "
                "changed: restore it from a good copy"
            ) from err
        np.copyto(out, values, casting="unsafe")
        return values.nbytes

    def check_files(self, indices) -> None:
        self._watch.check([self.path], " by the pipe")

    def coords(self, box: Box) -> dict[str, np.ndarray]:
        """Coordinate values of the cells in ``box``, for coordinates over grid dims only."""
        ds = self._dataset()
        selection = dict(zip(self.dims, box))
        out = {}
        for name, coord in ds.coords.items():
            if coord.dims and set(coord.dims) <= set(self.dims):
                out[name] = coord.isel({d: selection[d] for d in coord.dims}).values
        return out

    def close(self) -> None:
        ds = self._handles().get("ds")
        if ds is not None:
            ds.close()
        super().close()

    def __repr__(self) -> str:
        return f"XarrayFields({self.path})"
