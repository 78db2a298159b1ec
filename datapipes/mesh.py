"""Unstructured meshes and point clouds: prepare once, then read one contiguous range per rank.

Preparation (:func:`prepare_mesh`, or ``python -m datapipes.prepare_cli``)
sorts the points along a space-filling curve (:mod:`datapipes.sfc`) and writes
an HDF5 file in which any contiguous range of points is a spatially compact
piece of the domain. A domain of ``P`` ranks then needs no partitioner at
training time: rank ``r`` reads points ``[start_r, stop_r)`` with near-equal
counts (:func:`~datapipes.decomposition.balanced_sizes`), for any ``P``.

File layout (``format`` attribute ``"datapipes.mesh/1"``), all contiguous so
any range is one aligned read:

* ``/points``        ``(n_points, ndim)``, in curve order;
* ``/fields/<name>`` ``(n_points, ...)``, per-point fields in the same order;
* ``/cells``         ``(n_cells, k)`` int64, renumbered to the new point order
  and sorted by their smallest point index (their *owner*);
* ``/cell_owner``    ``(n_cells,)``, that smallest index, ascending.

A cell belongs to the rank that owns its smallest point, so each rank's cells
are a contiguous range too, found by a binary search of ``/cell_owner`` (a few
element reads, not the whole array). Cells keep *global* point indices; a
cell near a partition boundary can reference points of the next rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np
from tqdm import tqdm

from ._files import atomic_path, expand_paths, open_h5
from .decomposition import DomainDecomposition, balanced_sizes
from .errors import DataPipeError, DecompositionError, MissingDataError
from .sfc import DEFAULT_BITS, curve_order
from .source import Box, Source, Split

__all__ = ["FORMAT", "MeshSource", "load_mesh_input", "prepare_mesh"]

FORMAT = "datapipes.mesh/1"
POINTS, CELLS, OWNER, FIELDS = "points", "cells", "cell_owner", "fields"
_WRITE_ROWS = 1 << 18  # rows gathered and written per step (bounds the temporary copy)


def prepare_mesh(path, points: np.ndarray, fields: Mapping[str, np.ndarray] | None = None,
                 cells: np.ndarray | None = None, *, curve: str = "hilbert", bits: int = DEFAULT_BITS,
                 progress: bool = False) -> Path:
    """Write a mesh sorted along a space-filling curve to ``path`` (atomically).

    Args:
        points: ``(n_points, ndim)`` coordinates.
        fields: per-point arrays, each with ``n_points`` rows.
        cells: optional ``(n_cells, k)`` connectivity (indices into ``points``).
        curve: ``"hilbert"`` (default, more compact ranges) or ``"morton"``.
        bits: quantization bits per axis for the curve.
        progress: show a tqdm progress bar.
    """
    points = np.asarray(points)
    fields = {name: np.asarray(a) for name, a in (fields or {}).items()}
    cells = None if cells is None else np.asarray(cells)
    _check_mesh(points, fields, cells)
    n = len(points)
    total = n * (2 + len(fields)) + (0 if cells is None else 2 * len(cells))
    with tqdm(total=total, unit="row", desc=Path(path).name, disable=not progress) as bar:
        order = curve_order(points, curve, bits)
        bar.update(n)
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            f.attrs.update(format=FORMAT, curve=curve, bits=bits, num_points=n,
                           num_cells=0 if cells is None else len(cells))
            _write_permuted(f, POINTS, points, order, bar)
            group = f.create_group(FIELDS)
            for name, values in fields.items():
                _write_permuted(group, name, values, order, bar)
            if cells is not None:
                inverse = np.empty(n, dtype=np.int64)
                inverse[order] = np.arange(n)
                renumbered = inverse[cells.astype(np.int64)]
                owner = renumbered.min(axis=1) if renumbered.shape[1] else np.zeros(len(cells), np.int64)
                cell_order = np.argsort(owner, kind="stable")
                bar.update(len(cells))
                _write_permuted(f, CELLS, renumbered, cell_order, None)
                f[OWNER] = owner[cell_order]
                bar.update(len(cells))
    return Path(path)


def _check_mesh(points: np.ndarray, fields: dict, cells: np.ndarray | None) -> None:
    if points.ndim != 2 or len(points) == 0:
        raise DataPipeError(f"points must have shape (n_points, ndim) with n_points >= 1, got {points.shape}")
    for name, values in fields.items():
        if name in (POINTS, CELLS) or "/" in name:
            raise DataPipeError(f"a field cannot be named {name!r} (reserved, or not a plain name)")
        if values.ndim < 1 or len(values) != len(points):
            raise DataPipeError(
                f"field '{name}' has shape {values.shape}; a per-point field needs {len(points)} rows"
            )
    if cells is not None:
        if cells.ndim != 2 or not np.issubdtype(cells.dtype, np.integer):
            raise DataPipeError(f"cells must be an integer array (n_cells, k), got {cells.dtype} {cells.shape}")
        if cells.size and (cells.min() < 0 or cells.max() >= len(points)):
            raise DataPipeError(
                f"cells reference point indices in [{cells.min()}, {cells.max()}] but there are "
                f"{len(points)} points"
            )


def _write_permuted(group: h5py.Group, name: str, values: np.ndarray, order: np.ndarray, bar) -> None:
    dset = group.create_dataset(name, shape=values.shape, dtype=values.dtype)
    for start in range(0, len(order), _WRITE_ROWS):
        stop = min(start + _WRITE_ROWS, len(order))
        dset[start:stop] = values[order[start:stop]]
        if bar is not None:
            bar.update(stop - start)


def load_mesh_input(path) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
    """Read an unprepared mesh: ``.npz`` or HDF5 with ``points``, optional ``cells``, and fields.

    Fields are the other arrays of an ``.npz``, or the datasets in ``/fields``
    (else the other top-level datasets) of an HDF5 file.
    """
    path = Path(path)
    if not path.exists():
        raise MissingDataError(f"{path}: no such file")
    if path.suffix == ".npz":
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
    else:
        with open_h5(str(path)) as f:
            source = f[FIELDS] if FIELDS in f else f
            arrays = {k: v[()] for k, v in source.items() if isinstance(v, h5py.Dataset)}
            for key in (POINTS, CELLS):
                if key in f and key not in arrays:
                    arrays[key] = f[key][()]
    if POINTS not in arrays:
        raise MissingDataError(f"{path}: no 'points' array (found: {sorted(arrays)})")
    return arrays.pop(POINTS), arrays, arrays.pop(CELLS, None)


class MeshSource(Source):
    """Prepared meshes (one per sample file), read as point ranges per rank.

    Variables are ``"points"``, the requested per-point fields, and ``"cells"``
    when the files have cells and ``cells=True``. Point variables are split
    over the 1-D domain mesh into near-equal contiguous ranges; ``"cells"`` is
    split into the owner ranges of those point ranges.

    Args:
        paths: prepared files (or glob patterns), one sample each.
        fields: per-point fields to read (default: all fields of the first file).
        cells: also read the connectivity.
        dtype: read points and fields as this dtype (cells stay int64).
    """

    def __init__(self, paths, fields: Sequence[str] | None = None, *, cells: bool = True, dtype=None):
        self.paths = expand_paths(paths)
        self._counts: list[tuple[int, int]] = []
        self._shapes: dict[str, tuple[int, ...]] = {}  # per variable: shape after the point/cell dim
        self._dtypes: dict[str, np.dtype] = {}
        self._cell_splits: dict[tuple[int, int], tuple[int, ...]] = {}
        for path in self.paths:
            with open_h5(path) as f:
                if f.attrs.get("format") != FORMAT:
                    raise DataPipeError(
                        f"{path} is not a prepared mesh (format attribute {f.attrs.get('format')!r}); "
                        "write it with datapipes.prepare_mesh or `python -m datapipes.prepare_cli`"
                    )
                if fields is None:
                    fields = sorted(f[FIELDS])
                names = [POINTS, *(f"{FIELDS}/{name}" for name in fields)]
                if cells and CELLS in f and (not self._counts or CELLS in self._shapes):
                    names.append(CELLS)
                for name in names:
                    self._note(f, path, name, dtype)
                self._counts.append((f[POINTS].shape[0], f.attrs["num_cells"]))
        self._datasets = {_variable(name): name for name in self._shapes}
        self.variables = tuple(self._datasets)

    def _note(self, f: h5py.File, path: str, name: str, dtype) -> None:
        if name not in f:
            raise MissingDataError(f"{path}: no dataset /{name} (variable '{_variable(name)}')")
        dset = f[name]
        expected_rows = f[CELLS].shape[0] if name == CELLS else f[POINTS].shape[0]
        if dset.ndim < 1 or dset.shape[0] != expected_rows:
            raise DataPipeError(f"{path}: /{name} has shape {dset.shape}, expected {expected_rows} rows")
        trailing = self._shapes.setdefault(name, dset.shape[1:])
        if dset.shape[1:] != trailing:
            raise DataPipeError(
                f"{path}: /{name} has shape {dset.shape}; earlier samples have (n, *{trailing})"
            )
        keep = name == CELLS or dtype is None
        self._dtypes.setdefault(_variable(name), np.dtype(dset.dtype if keep else dtype))

    def __len__(self) -> int:
        return len(self.paths)

    def dtype(self, variable: str) -> np.dtype:
        return self._dtypes[variable]

    def num_points(self, index: int) -> int:
        return int(self._counts[index][0])

    def where(self, index: int, variable: str) -> str:
        name = self._datasets[variable]
        n = self._counts[index][1 if name == CELLS else 0]
        return f"variable '{variable}' of mesh sample {index} ({self.paths[index]}:/{name}, shape {(n, *self._shapes[name])})"

    def decompose(self, index: int, mesh_shape: tuple[int, ...], split: Split) -> dict[str, DomainDecomposition]:
        if len(mesh_shape) != 1:
            raise DecompositionError(
                f"{self.paths[index]}: a mesh splits its point dim over a 1-D domain mesh, got mesh shape {mesh_shape}"
            )
        if split != Split() and split != Split(split_dims=(0,)):
            raise DecompositionError(
                f"{self.paths[index]}: meshes are split into point ranges; split_dims, halo and sizes "
                f"do not apply (got {split})"
            )
        parts = mesh_shape[0]
        n_points, n_cells = self._counts[index]
        if n_points < parts:
            raise DecompositionError(
                f"{self.paths[index]}: {n_points} points cannot be split over {parts} ranks"
            )
        point_sizes = balanced_sizes(n_points, parts)
        out = {}
        for variable, name in self._datasets.items():
            rows, sizes = (n_cells, self._cell_sizes(index, point_sizes)) if name == CELLS else (n_points, point_sizes)
            out[variable] = DomainDecomposition(
                (rows, *self._shapes[name]), mesh_shape, (0,), sizes=(sizes,), label=self.where(index, variable)
            )
        return out

    def _cell_sizes(self, index: int, point_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Cells owned by each point range: a binary search of ``/cell_owner`` per boundary."""
        key = (index, len(point_sizes))
        if key not in self._cell_splits:
            with open_h5(self.paths[index]) as f:  # closed again: nothing open across a later fork
                owner = f[OWNER]
                bounds, start = [0], 0
                for size in point_sizes[:-1]:
                    start += size
                    bounds.append(_search(owner, start, bounds[-1]))
                bounds.append(owner.shape[0])
            self._cell_splits[key] = tuple(int(b - a) for a, b in zip(bounds, bounds[1:]))
        return self._cell_splits[key]

    def read(self, index: int, variable: str, box: Box, out: np.ndarray) -> int:
        handles = self._handles()
        path = self.paths[index]
        if path not in handles:
            handles[path] = open_h5(path)
        dset = handles[path][self._datasets[variable]]
        if out.size:
            dset.read_direct(out, source_sel=box)
        return out.size * dset.dtype.itemsize

    def close(self) -> None:
        for handle in self._handles().values():
            handle.close()
        super().close()

    def __repr__(self) -> str:
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return f"MeshSource({self.paths[0]}{more})"


def _variable(dataset_name: str) -> str:
    return dataset_name.rsplit("/", 1)[-1]


def _search(sorted_dset: h5py.Dataset, value: int, lo: int) -> int:
    """First index ``>= lo`` whose value is ``>= value`` (reads ~log2(n) single elements)."""
    hi = sorted_dset.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_dset[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo
