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
  and sorted by their smallest point index (their *owner*); mixed meshes pad
  smaller cells with ``-1`` (see :mod:`datapipes.mesh_formats`);
* ``/cell_owner``    ``(n_cells,)``, that smallest index, ascending;
* ``/cell_type``     ``(n_cells,)`` uint8 VTK cell type ids, when the input has them;
* ``/cell_fields/<name>`` ``(n_cells, ...)``, per-cell fields in the order of ``/cells``.

A cell belongs to the rank that owns its smallest point, so each rank's cells
(and their types and fields) are a contiguous range too, found by a binary
search of ``/cell_owner`` (a few element reads, not the whole array). Cells
keep *global* point indices; a cell near a partition boundary can reference
points of the next rank.

The order is defined as a stable sort: points by curve key, ties by input
position; cells by owner, ties by input position. Preparation in memory, out
of core under ``max_memory`` (:mod:`datapipes._external_sort`) and on many
ranks (:mod:`datapipes._sample_sort`) all produce it, so their files have the
same content.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np
from tqdm import tqdm

from . import _point_checks as pc
from . import _sample_sort as ss
from ._external_sort import external_sort
from ._files import atomic_path, expand_paths, open_h5
from ._identity import FileWatch, check_header, dataset_header
from .agreement import check_all_ranks
from .decomposition import DomainDecomposition, balanced_sizes
from .errors import DataPipeError, DecompositionError, MissingDataError
from .mesh_formats import MeshArrays, MeshInput, _even_parts, _pad, _slice, open_mesh_input, read_mesh
from .sfc import CURVES, DEFAULT_BITS, bounding_cube
from .source import Box, Source, Split

__all__ = ["FORMAT", "MeshSource", "load_mesh_input", "parse_memory", "prepare_mesh"]

FORMAT = "datapipes.mesh/1"
POINTS, CELLS, OWNER, FIELDS = "points", "cells", "cell_owner", "fields"
CELL_TYPE, CELL_FIELDS = "cell_type", "cell_fields"
_RESERVED = (POINTS, CELLS, OWNER, CELL_TYPE, FIELDS, CELL_FIELDS)
_WRITE_ROWS = 1 << 18  # rows gathered and written per step (bounds the temporary copy)
_NO_OWNER = np.iinfo(np.int64).max


def prepare_mesh(path, points, fields: Mapping[str, np.ndarray] | None = None, cells: np.ndarray | None = None, *,
                 cell_types: np.ndarray | None = None, cell_fields: Mapping[str, np.ndarray] | None = None,
                 curve: str = "hilbert", bits: int = DEFAULT_BITS, progress: bool = False,
                 max_memory: int | str | None = None, group=None, allow_duplicate_points: bool = False) -> Path:
    """Write a mesh sorted along a space-filling curve to ``path`` (atomically).

    The mesh is given as arrays, or as a file: ``points`` is then the input
    path (any format of :mod:`datapipes.mesh_formats`) and ``fields``,
    ``cells``, ``cell_types`` and ``cell_fields`` stay None. Three ways to
    run, with the same file content:

    * in memory (default);
    * out of core (``max_memory``): sorted in chunks spilled to a temporary
      HDF5 file next to ``path``; never holds the whole mesh when the input
      can be read in parts (HDF5, ``.pvtu`` pieces; meshio reads single-file
      formats whole);
    * on the ranks of ``group`` (collective; every rank passes the same
      arguments): each rank reads a part of the input file, a parallel
      sample sort moves every row once, and the ranks write the file in rank
      order. A format meshio reads whole is read by rank 0, which sends each
      rank its part. ``group`` is explicit because callers often prepare on
      rank 0 alone while a process group exists.

    Args:
        path: the prepared file to write.
        points: ``(n_points, ndim)`` coordinates, or the path of an input mesh file.
        fields: per-point arrays, each with ``n_points`` rows.
        cells: optional ``(n_cells, k)`` connectivity (indices into ``points``;
            ``-1`` pads cells with fewer than ``k`` nodes).
        cell_types: optional ``(n_cells,)`` VTK cell type ids.
        cell_fields: per-cell arrays, each with ``n_cells`` rows.
        curve: ``"hilbert"`` (default, more compact ranges) or ``"morton"``.
        bits: quantization bits per axis for the curve.
        progress: show a tqdm progress bar (on the first rank of ``group``).
        max_memory: memory budget of an out-of-core preparation, bytes or a
            string such as ``"4GB"`` or ``"512MiB"``.
        group: a ``torch.distributed`` process group (``dist.group.WORLD`` for
            all ranks) to prepare on many ranks.
        allow_duplicate_points: keep points with equal coordinates (by
            default refused: the cells on either side of them share no node,
            see :mod:`datapipes._point_checks`).

    Raises:
        DataPipeError: bad input (shapes, cell indices, names, an unreadable
            file, no points, NaN/inf coordinates, duplicate points), raised on
            every rank of ``group`` alike, before anything is written.
    """
    if curve not in CURVES:
        raise ValueError(f"curve must be one of {sorted(CURVES)}, got {curve!r}")
    budget = None if max_memory is None else parse_memory(max_memory)
    from_file = isinstance(points, (str, os.PathLike))
    if from_file and any(a is not None for a in (fields, cells, cell_types, cell_fields)):
        raise DataPipeError("prepare_mesh: with an input file as `points`, leave fields, cells, cell_types and "
                            "cell_fields unset (they come from the file)")
    if group is not None and _world(group) > 1:
        if not from_file:
            raise DataPipeError("prepare_mesh(group=...): preparation on many ranks reads an input file; "
                                "pass its path as `points`")
        if budget is not None:
            raise DataPipeError("prepare_mesh: give either max_memory (one process) or group (many ranks), not both")
        return _prepare_distributed(Path(path), Path(points), group, curve, bits, progress, allow_duplicate_points)
    if from_file:
        source = open_mesh_input(points)
    else:
        mesh = MeshArrays(np.asarray(points), {k: np.asarray(v) for k, v in (fields or {}).items()},
                          None if cells is None else np.asarray(cells),
                          None if cell_types is None else np.asarray(cell_types),
                          {k: np.asarray(v) for k, v in (cell_fields or {}).items()})
        _check_mesh(mesh, "prepare_mesh")
        if budget is None:
            return _prepare_in_memory(Path(path), mesh, curve, bits, progress, allow_duplicate_points, "prepare_mesh")
        source = _ArraysInput(mesh)
    try:
        if budget is not None:
            return _prepare_out_of_core(Path(path), source, budget, curve, bits, progress, allow_duplicate_points)
        mesh = source.read_all()
        _check_mesh(mesh, str(source.path))
        return _prepare_in_memory(Path(path), mesh, curve, bits, progress, allow_duplicate_points, str(source.path))
    finally:
        source.close()


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string like ``"4GB"``, ``"512 MiB"``, ``"1e9"``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        found = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?i?[bB]?)\s*", str(value))
        if not found:
            raise DataPipeError(f"max_memory={value!r}: expected bytes or a size such as '4GB' or '512MiB'")
        number, unit = float(found.group(1)), found.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in scale or number <= 0:
        raise DataPipeError(f"max_memory={value!r}: expected a positive size such as '4GB' or '512MiB'")
    return int(number * scale[unit])


def _world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def _check_mesh(mesh: MeshArrays, where: str) -> None:
    points, cells = mesh.points, mesh.cells
    if points.ndim != 2:
        raise DataPipeError(f"{where}: points must have shape (n_points, ndim), got {points.shape}")
    if len(points) == 0:
        raise DataPipeError(f"{where}: no points (an empty mesh cannot be prepared)")
    pc.check_finite(points, where)
    _check_names([*mesh.point_data, *mesh.cell_data], where)
    if cells is not None and (cells.ndim != 2 or not np.issubdtype(cells.dtype, np.integer)):
        raise DataPipeError(f"{where}: cells must be an integer array (n_cells, k), got {cells.dtype} {cells.shape}")
    mesh.check(where)
    if cells is not None:
        _check_cells(cells, len(points), where)


def _check_names(names: Sequence[str], where: str) -> None:
    for name in names:
        if name in _RESERVED or "/" in name:
            raise DataPipeError(f"{where}: a field cannot be named {name!r} (reserved, or not a plain name)")


def _check_cells(cells: np.ndarray, n_points: int, where: str) -> None:
    if cells.size and (cells.min() < -1 or cells.max() >= n_points):
        raise DataPipeError(f"{where}: cells reference point indices in [{cells.min()}, {cells.max()}] but there "
                            f"are {n_points} points (-1 pads cells with fewer nodes)")


def _owner(cells: np.ndarray) -> np.ndarray:
    """Each cell's smallest point index (padding ignored)."""
    if cells.shape[1] == 0:
        return np.zeros(len(cells), np.int64)
    return np.where(cells < 0, _NO_OWNER, cells).min(axis=1)


def _renumber(cells: np.ndarray, new_ids) -> np.ndarray:
    """``new_ids[cells]`` (any indexable: array or memory map), padding kept."""
    out = np.full(cells.shape, -1, np.int64)
    valid = cells >= 0
    out[valid] = new_ids[cells[valid]]
    return out


class _Layout:
    """The prepared file's datasets: names, dtypes and row shapes, in payload order.

    Every way of preparing creates its file through this class, so they
    cannot differ in names, dtypes or attributes.
    """

    def __init__(self, mesh: MeshArrays, width: int | None = None):
        self.point_names = [POINTS, *(f"{FIELDS}/{k}" for k in mesh.point_data)]
        self.point_spec = ss.specs([mesh.points, *mesh.point_data.values()])
        self.has_cells = mesh.cells is not None
        self.cell_names, self.cell_spec = [], []
        if self.has_cells:
            width = mesh.cells.shape[1] if width is None else width
            self.cell_names = [CELLS, *([CELL_TYPE] if mesh.cell_types is not None else []),
                               *(f"{CELL_FIELDS}/{k}" for k in mesh.cell_data)]
            self.cell_spec = [(np.dtype(np.int64), (width,)),
                              *([(np.dtype(np.uint8), ())] if mesh.cell_types is not None else []),
                              *ss.specs(list(mesh.cell_data.values()))]

    def point_arrays(self, mesh: MeshArrays) -> list[np.ndarray]:
        return [mesh.points, *mesh.point_data.values()]

    def cell_arrays(self, mesh: MeshArrays, renumbered: np.ndarray) -> list[np.ndarray]:
        types = [mesh.cell_types.astype(np.uint8)] if mesh.cell_types is not None else []
        return [renumbered, *types, *mesh.cell_data.values()]

    def create(self, f: h5py.File, n_points: int, n_cells: int, curve: str, bits: int) -> None:
        f.attrs.update(format=FORMAT, curve=curve, bits=bits, num_points=n_points, num_cells=n_cells)
        f.create_group(FIELDS)
        for name, (dtype, shape) in zip(self.point_names, self.point_spec):
            f.create_dataset(name, shape=(n_points, *shape), dtype=dtype)
        if self.has_cells:
            for name, (dtype, shape) in zip(self.cell_names, self.cell_spec):
                f.create_dataset(name, shape=(n_cells, *shape), dtype=dtype)
            f.create_dataset(OWNER, shape=(n_cells,), dtype=np.int64)

    def write(self, f: h5py.File, names: Sequence[str], spec, start: int, payload: np.ndarray) -> None:
        for name, values in zip(names, ss.unpack(payload, spec)):
            f[name][start:start + len(values)] = values


def _prepare_in_memory(path: Path, mesh: MeshArrays, curve: str, bits: int, progress: bool,
                       allow_duplicates: bool, where: str) -> Path:
    """The reference: one stable argsort of the curve keys, one of the cell owners."""
    n = len(mesh.points)
    n_cells = 0 if mesh.cells is None else len(mesh.cells)
    layout = _Layout(mesh)
    with tqdm(total=n * (1 + len(layout.point_names)) + 2 * n_cells, unit="row", desc=path.name,
              disable=not progress) as bar:
        keys = CURVES[curve](mesh.points, bits)
        order = np.argsort(keys, kind="stable")  # = curve_order(mesh.points, curve, bits)
        if not allow_duplicates:
            found = pc.first_duplicate(keys[order], order, lambda rows: mesh.points[order[rows]])
            if found is not None:
                raise pc.duplicate_error(where, found)
        del keys
        bar.update(n)
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            layout.create(f, n, n_cells, curve, bits)
            for name, values in zip(layout.point_names, layout.point_arrays(mesh)):
                _write_permuted(f[name], values, order, bar)
            if mesh.cells is not None:
                inverse = np.empty(n, dtype=np.int64)
                inverse[order] = np.arange(n)
                renumbered = _renumber(mesh.cells.astype(np.int64), inverse)
                owner = _owner(renumbered)
                cell_order = np.argsort(owner, kind="stable")
                bar.update(n_cells)
                for name, values in zip(layout.cell_names, layout.cell_arrays(mesh, renumbered)):
                    _write_permuted(f[name], values, cell_order, None)
                f[OWNER][...] = owner[cell_order]
                bar.update(n_cells)
    return path


def _write_permuted(dset: h5py.Dataset, values: np.ndarray, order: np.ndarray, bar) -> None:
    for start in range(0, len(order), _WRITE_ROWS):
        stop = min(start + _WRITE_ROWS, len(order))
        dset[start:stop] = values[order[start:stop]]
        if bar is not None:
            bar.update(stop - start)


class _ArraysInput(MeshInput):
    """Arrays already in memory (or array-likes such as memory maps), read by row slices."""

    def __init__(self, mesh: MeshArrays):
        self.path, self._mesh = Path("<arrays>"), mesh
        self.n_points, self.n_cells = len(mesh.points), 0 if mesh.cells is None else len(mesh.cells)

    def read(self, points, cells) -> MeshArrays:
        return _slice(self._mesh, slice(*points), slice(*cells))


# --------------------------------------------------------------------------- #
# Out of core: one process, a memory budget
# --------------------------------------------------------------------------- #
def _rows_for(budget: int, row_bytes: int, ndim: int = 0) -> int:
    """Rows per chunk: input, curve-key temporaries (~12 uint64 per point), packed and sorted copies."""
    return max(1, budget // (3 * (row_bytes + 16) + 8 * (12 + ndim)))


def _prepare_out_of_core(path: Path, source: MeshInput, budget: int, curve: str, bits: int, progress: bool,
                         allow_duplicates: bool) -> Path:
    n, n_cells = source.n_points, source.n_cells
    with tqdm(total=3 * n + 2 * n_cells, unit="row", desc=f"{path.name}: bounds", disable=not progress) as bar:
        probe = source.read((0, min(n, 1)), (0, min(n_cells, 1)))
        layout = _Layout(probe)
        # a cached input piece (twice its bytes: meshio's parse) is not the sort's to use
        piece_points, piece_cells = source.resident_rows()
        resident = 2 * (piece_points * ss.row_bytes(layout.point_spec) + piece_cells * ss.row_bytes(layout.cell_spec))
        if resident > budget // 2:
            raise DataPipeError(f"{source.path}: max_memory={budget} bytes is too small for its largest piece "
                                f"(~{resident} bytes when read); give at least {2 * resident} bytes or more pieces")
        budget -= resident
        point_rows = _rows_for(budget, ss.row_bytes(layout.point_spec), probe.points.shape[1])
        low, high, width = None, None, 0
        for a, b, c, _ in source.chunks(point_rows):
            part = source.read((a, b), (c, c))
            _check_part(part, probe, source.path)
            pc.check_finite(part.points, str(source.path), a)
            if len(part.points):
                lo, hi = part.points.min(axis=0), part.points.max(axis=0)
                low = lo if low is None else np.minimum(low, lo)
                high = hi if high is None else np.maximum(high, hi)
            width = max(width, 0 if part.cells is None else part.cells.shape[1])
            bar.update(b - a)
        if low is None:
            raise DataPipeError(f"{source.path}: no points (an empty mesh cannot be prepared)")
        cube = bounding_cube(low, high)
        layout = _Layout(probe, width)
        with (tempfile.TemporaryDirectory(dir=path.parent, prefix=".datapipes-prepare-") as tmp,
              atomic_path(path) as out_tmp, h5py.File(out_tmp, "w") as f):
            layout.create(f, n, n_cells, curve, bits)
            inverse = np.lib.format.open_memmap(Path(tmp) / "inverse.npy", mode="w+", dtype=np.int64, shape=(n,))

            def point_chunks():
                for a, b, c, _ in source.chunks(point_rows):
                    part = source.read((a, b), (c, c))
                    keys = CURVES[curve](part.points, bits, cube)
                    yield keys, np.arange(a, b, dtype=np.int64), ss.pack(layout.point_arrays(part))

            duplicates = None if allow_duplicates else pc.DuplicateScan()

            def emit_points(start, keys, index, payload):
                if duplicates is not None:
                    found = duplicates.add(keys, index, lambda rows: _points_of(payload, layout, rows))
                    if found is not None:
                        raise pc.duplicate_error(str(source.path), found)
                layout.write(f, layout.point_names, layout.point_spec, start, payload)
                inverse[index] = np.arange(start, start + len(index))
                bar.update(len(index))

            bar.set_description(f"{path.name}: sort points")
            external_sort(point_chunks(), point_rows, emit_points, directory=tmp, bar=bar)
            if layout.has_cells:
                cell_rows = _rows_for(budget, ss.row_bytes(layout.cell_spec) + 8 * width)

                def cell_chunks():
                    for _, _, c, d in source.chunks(cell_rows):
                        part = source.read((0, 0), (c, d))
                        _check_cells(part.cells, n, str(source.path))
                        renumbered = _renumber(_pad(part.cells, width), inverse)
                        owner = _owner(renumbered).astype(np.uint64)
                        yield owner, np.arange(c, d, dtype=np.int64), ss.pack(layout.cell_arrays(part, renumbered))

                def emit_cells(start, keys, index, payload):
                    layout.write(f, layout.cell_names, layout.cell_spec, start, payload)
                    f[OWNER][start:start + len(keys)] = keys.astype(np.int64)
                    bar.update(len(keys))

                bar.set_description(f"{path.name}: sort cells")
                external_sort(cell_chunks(), cell_rows, emit_cells, directory=tmp, bar=bar)
            bar.set_description(f"{path.name}: done")
    return path


def _check_part(part: MeshArrays, probe: MeshArrays, where) -> None:
    """A part must have the fields, dtypes and row shapes of the first part (pieces of one mesh)."""
    for kind, mine, first in (("point", part.point_data, probe.point_data), ("cell", part.cell_data, probe.cell_data)):
        got = {k: (v.dtype, v.shape[1:]) for k, v in mine.items()}
        want = {k: (v.dtype, v.shape[1:]) for k, v in first.items()}
        if got != want:
            raise DataPipeError(f"{where}: parts of the mesh have different {kind} fields: {got} and {want}")
    if (part.cell_types is None) != (probe.cell_types is None) or part.points.shape[1:] != probe.points.shape[1:]:
        raise DataPipeError(f"{where}: parts of the mesh differ in point dimensions or in having cell types")


# --------------------------------------------------------------------------- #
# Many ranks: a parallel sample sort
# --------------------------------------------------------------------------- #
def _prepare_distributed(path: Path, input_path: Path, group, curve: str, bits: int, progress: bool,
                         allow_duplicates: bool) -> Path:
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    path = path.resolve()
    bar = tqdm(total=6, unit="phase", desc=f"{path.name}: read", disable=not progress or rank != 0)
    part, info, error = None, None, None
    try:
        part, info = _read_part(input_path, rank, world, group)
    except Exception as err:  # every rank raises it below
        error = err
    check_all_ranks(error, group)
    n, n_cells, point_start, cell_start, part_starts = info
    summary = (None if not len(part.points) else (part.points.min(axis=0), part.points.max(axis=0)),
               0 if part.cells is None else part.cells.shape[1],
               pc.nonfinite(part.points, point_start),
               {k: (v.dtype, v.shape[1:]) for k, v in part.point_data.items()},
               {k: (v.dtype, v.shape[1:]) for k, v in part.cell_data.items()},
               part.cell_types is not None, part.cells is not None, part.points.shape[1:])
    summaries: list = [None] * world
    dist.all_gather_object(summaries, summary, group=group)
    error = None
    try:  # the same verdict on every rank: computed from the gathered summaries only
        if any(s[3:] != summaries[0][3:] for s in summaries):
            raise DataPipeError(f"{input_path}: the parts read by the ranks differ in fields, point dimensions "
                                f"or cells: {[s[3:] for s in summaries]}")
        if not n:
            raise DataPipeError(f"{input_path}: no points (an empty mesh cannot be prepared)")
        bad = [s[2] for s in summaries if s[2][0]]
        if bad:
            raise pc.nonfinite_error(str(input_path), sum(b[0] for b in bad), bad[0][1], bad[0][2])
        _check_names([*part.point_data, *part.cell_data], str(input_path))
        if part.cells is not None:
            _check_cells(part.cells, n, str(input_path))
    except Exception as err:
        error = err
    check_all_ranks(error, group)
    bounds = [s[0] for s in summaries if s[0] is not None]
    cube = bounding_cube(np.min([b[0] for b in bounds], axis=0), np.max([b[1] for b in bounds], axis=0))
    width = max(s[1] for s in summaries)
    layout = _Layout(part, width)

    bar.set_description(f"{path.name}: sort points")
    bar.update()
    rows = [CURVES[curve](part.points, bits, cube), np.arange(point_start, point_start + len(part.points)),
            ss.pack(layout.point_arrays(part))]
    part.points, part.point_data = part.points[:0], {k: v[:0] for k, v in part.point_data.items()}
    keys, index, payload = ss.sample_sort(rows, group)
    if not allow_duplicates:
        _check_duplicates_on_ranks(keys, index, lambda rows: _points_of(payload, layout, rows), str(input_path),
                                   group)
    del keys
    out_start, _, counts = ss.exclusive_offsets(len(index), group)
    tmp = path.with_name(f".{path.name}.tmp-prepare")
    error = None
    if rank == 0:  # one file, its datasets created at full size; the ranks fill their rows in turn
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with h5py.File(tmp, "w") as f:
                layout.create(f, n, n_cells, curve, bits)
        except Exception as err:
            error = err
            tmp.unlink(missing_ok=True)
    check_all_ranks(error, group)
    bar.set_description(f"{path.name}: write points")
    bar.update()
    _in_turns(tmp, group, lambda f: layout.write(f, layout.point_names, layout.point_spec, out_start, payload))
    payload = None  # written: free it before the cells' exchange

    if layout.has_cells:
        bar.set_description(f"{path.name}: renumber cells")
        bar.update()
        # the inverse permutation, held by the rank that read each point
        dest = np.searchsorted(part_starts, index, side="right") - 1
        order = np.argsort(dest, kind="stable")
        pairs = np.stack([index[order], out_start + order], axis=1)
        del index
        received, _ = ss.exchange(pairs, np.bincount(dest, minlength=world), group)
        del pairs, order, dest
        inverse = np.empty(int(_part_size(part_starts, rank, n)), np.int64)
        inverse[received[:, 0] - point_start] = received[:, 1]
        del received
        # ask the readers of the points my cells use for their new numbers
        renumbered = _pad(part.cells, width)  # renumbered in place below: this rank's own copy
        part.cells = None
        wanted = renumbered[renumbered >= 0]
        wanted.sort()  # in place: np.unique would hold several more copies
        wanted = wanted[np.r_[True, wanted[1:] != wanted[:-1]]] if len(wanted) else wanted
        dest = np.searchsorted(part_starts, wanted, side="right") - 1
        asked, asked_counts = ss.exchange(wanted, np.bincount(dest, minlength=world), group)
        answers, _ = ss.exchange(inverse[asked - point_start], asked_counts, group)
        del inverse, asked, dest
        _lookup_in_place(renumbered, wanted, answers)
        del answers, wanted
        rows = [_owner(renumbered).astype(np.uint64), np.arange(cell_start, cell_start + len(renumbered)),
                ss.pack(layout.cell_arrays(part, renumbered))]
        del renumbered, part
        bar.set_description(f"{path.name}: sort cells")
        bar.update()
        # cells go to the rank holding their owner point: splitters are the output point ranges
        starts = np.cumsum(counts)[:-1].astype(np.uint64)
        owner, _, cell_payload = ss.sample_sort(rows, group, splitters=(starts, np.full(len(starts), -1, np.int64)))
        cell_out, _, _ = ss.exclusive_offsets(len(owner), group)

        def write_cells(f):
            layout.write(f, layout.cell_names, layout.cell_spec, cell_out, cell_payload)
            f[OWNER][cell_out:cell_out + len(owner)] = owner.astype(np.int64)

        bar.set_description(f"{path.name}: write cells")
        bar.update()
        _in_turns(tmp, group, write_cells)
    if rank == 0:
        os.replace(tmp, path)
    dist.barrier(group=group)
    bar.update(bar.total - bar.n)
    bar.close()
    return path


def _points_of(payload: np.ndarray, layout: _Layout, rows: np.ndarray) -> np.ndarray:
    """The coordinates of some rows of a packed point payload (the points are its first columns)."""
    return ss.unpack(payload[rows], layout.point_spec[:1])[0]


def _check_duplicates_on_ranks(keys: np.ndarray, index: np.ndarray, points_of, where: str, group) -> None:
    """Duplicate points among the key-sorted rows of all ranks: each rank's own runs, then the runs at the
    ranks' edges (gathered: a run of equal keys may continue on the next rank); the same error everywhere."""
    import torch.distributed as dist

    found = pc.first_duplicate(keys, index, points_of)
    edges: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(edges, pc.edge_runs(keys, index, points_of), group=group)
    found = found or pc.across_edges([run for runs in edges for run in runs])
    check_all_ranks(None if found is None else pc.duplicate_error(where, found), group)


def _lookup_in_place(cells: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """``cells[i, j] = values[k]`` where ``ids[k] == cells[i, j]`` (sorted ``ids``), in blocks; padding kept."""
    for start in range(0, len(cells), _WRITE_ROWS):
        block = cells[start:start + _WRITE_ROWS]
        valid = block >= 0
        block[valid] = values[np.searchsorted(ids, block[valid])]


def _part_size(part_starts: np.ndarray, rank: int, n: int) -> int:
    stop = part_starts[rank + 1] if rank + 1 < len(part_starts) else n
    return int(stop - part_starts[rank])


def _in_turns(tmp: Path, group, write) -> None:
    """Each rank writes its rows into the one output file, rank 0 first (HDF5 files take one writer)."""
    import torch.distributed as dist

    error = None
    for turn in range(dist.get_world_size(group)):
        if turn == dist.get_rank(group) and error is None:
            try:
                with h5py.File(tmp, "r+") as f:
                    write(f)
            except Exception as err:
                error = err
        dist.barrier(group=group)
    try:
        check_all_ranks(error, group)
    except Exception:
        if dist.get_rank(group) == 0 and tmp.exists():
            tmp.unlink()
        raise


def _read_part(input_path: Path, rank: int, world: int, group):
    """This rank's part of the input and ``(n_points, n_cells, point_start, cell_start, part_point_starts)``.

    HDF5 and ``.pvtu`` inputs are read in parts by every rank; any other file
    is read whole by rank 0, which sends each rank its part in one exchange.
    """
    import torch.distributed as dist

    suffix = input_path.suffix.lower()
    if suffix in (".pvtu", ".h5", ".hdf5", ".hdf"):
        source = open_mesh_input(input_path)
        try:
            parts = source.parts(world)
            a, b, c, d = parts[rank]
            part = source.read((a, b), (c, d))
        finally:
            source.close()
        starts = np.array([p[0] for p in parts], np.int64)
        return part, (source.n_points, source.n_cells, a, c, starts)
    # one reader: rank 0 reads, then streams each rank its rows
    header = [None]
    mesh = None
    if rank == 0:
        try:
            mesh = read_mesh(input_path)
            _check_mesh(mesh, str(input_path))
            layout = _Layout(mesh)
            header = [(len(mesh.points), 0 if mesh.cells is None else len(mesh.cells), layout.point_spec,
                       layout.cell_spec, list(mesh.point_data), list(mesh.cell_data), mesh.cell_types is not None)]
        except Exception as err:
            header = [err]
    dist.broadcast_object_list(header, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(header[0], Exception):
        if rank == 0:
            raise header[0]
        raise DataPipeError(f"{input_path}: rank 0 could not read it ({header[0]})")
    n, n_cells, point_spec, cell_spec, point_names, cell_names, has_types = header[0]
    parts = _even_parts(n, n_cells, world)
    zeros = np.zeros(world, np.int64)

    def send(arrays_of_rank0, spec, sizes):
        buffer = ss.pack(arrays_of_rank0) if rank == 0 else np.empty((0, ss.row_bytes(spec)), np.uint8)
        received, _ = ss.exchange(buffer, sizes if rank == 0 else zeros, group)
        return ss.unpack(received, spec)

    points_and_fields = send([mesh.points, *mesh.point_data.values()] if rank == 0 else None, point_spec,
                             np.array([p[1] - p[0] for p in parts]))
    part = MeshArrays(points_and_fields[0], dict(zip(point_names, points_and_fields[1:])))
    if cell_spec:
        arrays = None
        if rank == 0:
            arrays = [mesh.cells.astype(np.int64), *([mesh.cell_types.astype(np.uint8)] if has_types else []),
                      *mesh.cell_data.values()]
        cell_arrays = send(arrays, cell_spec, np.array([p[3] - p[2] for p in parts]))
        part.cells = cell_arrays.pop(0)
        part.cell_types = cell_arrays.pop(0) if has_types else None
        part.cell_data = dict(zip(cell_names, cell_arrays))
    del mesh
    a, _, c, _ = parts[rank]
    return part, (n, n_cells, a, c, np.array([p[0] for p in parts], np.int64))


def load_mesh_input(path) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
    """Read an unprepared mesh as ``(points, point fields, cells)``: any format of
    :mod:`datapipes.mesh_formats` (cell types and cell fields: :func:`~datapipes.mesh_formats.read_mesh`)."""
    mesh = read_mesh(path)
    return mesh.points, mesh.point_data, mesh.cells


class MeshSource(Source):
    """Prepared meshes (one per sample file), read as point ranges per rank.

    Variables are ``"points"``, the requested per-point fields, ``"cells"``
    (and ``"cell_type"`` for mixed meshes) when the files have cells and
    ``cells=True``, and the requested per-cell fields. Point variables are
    split over the 1-D domain mesh into near-equal contiguous ranges; cell
    variables are split into the owner ranges of those point ranges, so a
    rank's cells, cell types and cell fields are rows of the same cells.

    Args:
        paths: prepared files (or glob patterns), one sample each.
        fields: per-point fields to read (default: all fields of the first file).
        cells: also read the connectivity.
        dtype: read points and fields as this dtype (cells stay int64).
        cell_fields: per-cell fields to read (default: all of the first file's
            when ``cells=True``, else none). Their names must differ from the
            point fields' (preparation makes sure of it).
    """

    def __init__(self, paths, fields: Sequence[str] | None = None, *, cells: bool = True, dtype=None,
                 cell_fields: Sequence[str] | None = None):
        self.paths = expand_paths(paths)
        self._counts: list[tuple[int, int]] = []
        self._shapes: dict[str, tuple[int, ...]] = {}  # per variable: shape after the point/cell dim
        self._dtypes: dict[str, np.dtype] = {}
        self._cell_splits: dict[tuple[int, int], tuple[int, ...]] = {}
        self._watch = FileWatch()  # files changed under a run raise (datapipes._identity)
        self._headers: dict[tuple[str, str], tuple] = {}
        for path in self.paths:
            self._watch.record(path)
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
                    if CELL_TYPE in f and (not self._counts or CELL_TYPE in self._shapes):
                        names.append(CELL_TYPE)
                if cell_fields is None:
                    cell_fields = sorted(f[CELL_FIELDS]) if cells and CELL_FIELDS in f else []
                names += [f"{CELL_FIELDS}/{name}" for name in cell_fields]
                for name in names:
                    self._note(f, path, name, dtype)
                self._counts.append((f[POINTS].shape[0], f.attrs["num_cells"]))
        self._datasets = {_variable(name): name for name in self._shapes}
        self.variables = tuple(self._datasets)

    def _note(self, f: h5py.File, path: str, name: str, dtype) -> None:
        if name not in f:
            raise MissingDataError(f"{path}: no dataset /{name} (variable '{_variable(name)}')")
        dset = f[name]
        if _is_cell(name) and CELLS not in f:
            raise MissingDataError(f"{path}: /{name} needs /{CELLS}, which the file does not have")
        expected_rows = f[CELLS].shape[0] if _is_cell(name) else f[POINTS].shape[0]
        if dset.ndim < 1 or dset.shape[0] != expected_rows:
            raise DataPipeError(f"{path}: /{name} has shape {dset.shape}, expected {expected_rows} rows")
        trailing = self._shapes.setdefault(name, dset.shape[1:])
        if dset.shape[1:] != trailing:
            raise DataPipeError(
                f"{path}: /{name} has shape {dset.shape}; earlier samples have (n, *{trailing})"
            )
        keep = name in (CELLS, CELL_TYPE) or dtype is None
        self._dtypes.setdefault(_variable(name), np.dtype(dset.dtype if keep else dtype))
        self._headers[(path, name)] = dataset_header(dset)

    def __len__(self) -> int:
        return len(self.paths)

    def dtype(self, variable: str) -> np.dtype:
        return self._dtypes[variable]

    def num_points(self, index: int) -> int:
        return int(self._counts[index][0])

    def where(self, index: int, variable: str) -> str:
        name = self._datasets[variable]
        n = self._counts[index][1 if _is_cell(name) else 0]
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
            rows, sizes = (n_cells, self._cell_sizes(index, point_sizes)) if _is_cell(name) else (n_points, point_sizes)
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
        path, name = self.paths[index], self._datasets[variable]
        if (path, name) not in handles:
            if path not in handles:  # (re)opened, e.g. after a fork: the file must still be the one scanned
                self._watch.check([path], f" (reopening it for {self.where(index, variable)})")
                handles[path] = open_h5(path)
            handles[(path, name)] = handles[path][name]
            check_header(handles[(path, name)], self._headers.get((path, name)), self.where(index, variable))
        dset = handles[(path, name)]
        if out.size:
            dset.read_direct(out, source_sel=box)
        return out.size * dset.dtype.itemsize

    def check_files(self, indices) -> None:
        self._watch.check(dict.fromkeys(self.paths[i] for i in indices), " by the pipe")

    def close(self) -> None:
        for handle in self._handles().values():
            if isinstance(handle, h5py.File):
                handle.close()
        super().close()

    def __repr__(self) -> str:
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return f"MeshSource({self.paths[0]}{more})"


def _is_cell(dataset_name: str) -> bool:
    """Whether a dataset has one row per cell (split by cell owners) rather than per point."""
    return dataset_name in (CELLS, CELL_TYPE) or dataset_name.startswith(f"{CELL_FIELDS}/")


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
