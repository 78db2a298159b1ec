"""Mesh files as solvers write them: VTK (``.vtu``, ``.vtk``, ``.pvtu``), XDMF, Gmsh, Exodus, ``.npz``, HDF5.

Every format is turned into one representation, :class:`MeshArrays`:

* ``points`` ``(n_points, ndim)`` and ``point_data`` (arrays with ``n_points`` rows);
* ``cells`` ``(n_cells, k)`` int64: one row per cell, ``k`` the largest node
  count of any cell, rows of smaller cells padded with ``-1``; ``cell_types``
  ``(n_cells,)`` uint8 holds each cell's VTK type id (:data:`CELL_TYPES`), so
  a mixed mesh (triangles and quads, tetrahedra and hexahedra) is one array.
  A padded array rather than CSR offsets because every row keeps a fixed
  width: a rank's cells are then one contiguous box of one dataset, read
  like a point range, and ``cells[:, :n]`` of a single-type mesh is the plain
  connectivity;
* ``cell_data``: arrays with ``n_cells`` rows, in the same order as ``cells``.

meshio (the optional ``mesh`` extra) reads the solver formats. It has no
reader for ``.vtp`` (VTK PolyData: surfaces, as in DrivAerML) in version
5.3; :func:`read_mesh` reads one with meshio's VTU data decoding (vertices,
lines, polygons; not triangle strips). A ``.pvtu`` file (a list of ``.vtu``
pieces) is read here piece by piece, which is what lets preparation on many
ranks or under a memory budget read part of a mesh without the rest: see
:class:`MeshInput`. Single-file formats are read whole.

Errors name the file: an unreadable file, a cell type without a fixed node
count, arrays whose lengths do not match.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np

from ._files import atomic_path, open_h5
from .decomposition import balanced_sizes
from .errors import DataPipeError, MissingDataError

__all__ = ["CELL_TYPES", "MeshArrays", "MeshInput", "count_pieces", "open_mesh_input", "read_mesh", "write_mesh",
           "write_pvtu"]

#: meshio cell type name -> VTK cell type id (the ``cell_type`` dataset of a prepared mesh).
CELL_TYPES: dict[str, int] = {
    "vertex": 1, "line": 3, "triangle": 5, "polygon": 7, "quad": 9, "tetra": 10, "hexahedron": 12,
    "wedge": 13, "pyramid": 14, "line3": 21, "triangle6": 22, "quad8": 23, "tetra10": 24,
    "hexahedron20": 25, "wedge15": 26, "pyramid13": 27, "quad9": 28, "hexahedron27": 29,
}
_TYPE_NAMES = {v: k for k, v in CELL_TYPES.items()}
_MESHIO_SUFFIXES = (".vtu", ".vtk", ".xdmf", ".xmf", ".msh", ".exo", ".e", ".med", ".inp", ".mesh", ".ply",
                    ".stl", ".obj", ".off", ".su2", ".ugrid", ".cgns", ".dat", ".bdf", ".nas", ".f3grid")


@dataclass
class MeshArrays:
    """A mesh as arrays (see the module docstring for the cell layout)."""

    points: np.ndarray
    point_data: dict[str, np.ndarray] = field(default_factory=dict)
    cells: np.ndarray | None = None
    cell_types: np.ndarray | None = None
    cell_data: dict[str, np.ndarray] = field(default_factory=dict)

    def check(self, where: str) -> MeshArrays:
        """Raise naming ``where`` unless every array has the row count it needs; return self."""
        n = len(self.points)
        if self.points.ndim != 2:
            raise DataPipeError(f"{where}: points have shape {self.points.shape}, expected (n_points, ndim)")
        for name, values in self.point_data.items():
            if values.ndim < 1 or len(values) != n:
                raise DataPipeError(f"{where}: point field '{name}' has shape {values.shape}; "
                                    f"a per-point field needs {n} rows")
        m = 0 if self.cells is None else len(self.cells)
        if self.cells is None and (self.cell_data or self.cell_types is not None):
            raise DataPipeError(f"{where}: cell data or cell types without cells")
        for name, values in self.cell_data.items():
            if values.ndim < 1 or len(values) != m:
                raise DataPipeError(f"{where}: cell field '{name}' has shape {values.shape}; "
                                    f"a per-cell field needs {m} rows (one per cell)")
        if self.cell_types is not None and self.cell_types.shape != (m,):
            raise DataPipeError(f"{where}: cell_types has shape {self.cell_types.shape}, expected ({m},)")
        clash = set(self.point_data) & set(self.cell_data)
        if clash:
            raise DataPipeError(f"{where}: {sorted(clash)} name both a point field and a cell field; rename one")
        return self


def read_mesh(path) -> MeshArrays:
    """Read a whole mesh file of any supported format (see the module docstring).

    Raises:
        MissingDataError: the file does not exist.
        DataPipeError: it cannot be read, has a cell type without a fixed node
            count, or arrays whose lengths do not match; the message names the file.
    """
    return open_mesh_input(path).read_all()


def open_mesh_input(path) -> MeshInput:
    """A :class:`MeshInput` for ``path``: pieces for ``.pvtu``, row slices for HDF5, else the whole file."""
    path = Path(path)
    if not path.exists():
        raise MissingDataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".pvtu":
        return _PiecesInput(path)
    if suffix in (".h5", ".hdf5", ".hdf"):
        return _HDF5Input(path)
    if suffix == ".npz":
        return _WholeInput(path, _read_npz)
    if suffix == ".vtp":
        return _WholeInput(path, _read_vtp)
    if suffix == ".vtu":
        return _WholeInput(path, _read_vtu)
    return _WholeInput(path, _read_meshio)


def count_pieces(path) -> int:
    """Files a mesh is read from: the pieces a ``.pvtu`` lists, else 1."""
    path = Path(path)
    if path.suffix.lower() != ".pvtu":
        return 1
    try:
        return sum(1 for _ in ET.parse(path).getroot().iter("Piece"))
    except (ET.ParseError, OSError) as err:
        raise DataPipeError(f"{path}: cannot be read as a .pvtu file ({err})") from None


class MeshInput:
    """Rows of an input mesh read on demand, so that a preparation can read a part of it.

    ``n_points`` and ``n_cells`` are known on opening (from headers or dataset
    shapes). ``parts(p)`` splits the input into ``p`` ranges that are cheap to
    read alone: row ranges of an HDF5 file, whole pieces of a ``.pvtu``.
    ``sliceable`` is False when any read needs the whole file (meshio reads a
    single file at once): then one process reads it and hands out the rows.
    Cells come with *global* point indices (piece offsets added).
    """

    path: Path
    n_points: int
    n_cells: int
    sliceable: bool = True

    def parts(self, count: int) -> list[tuple[int, int, int, int]]:
        """``count`` ranges ``(point_start, point_stop, cell_start, cell_stop)`` covering the mesh."""
        return _even_parts(self.n_points, self.n_cells, count)

    def chunks(self, max_rows: int) -> list[tuple[int, int, int, int]]:
        """Ranges of at most ``max_rows`` points and cells, in order (never across a piece)."""
        count = max(1, -(-max(self.n_points, self.n_cells) // max(1, max_rows)))
        return _even_parts(self.n_points, self.n_cells, count)

    def read(self, points: tuple[int, int], cells: tuple[int, int]) -> MeshArrays:
        """Points ``[points[0], points[1])`` with their data and cells ``[cells[0], cells[1])`` with theirs."""
        raise NotImplementedError

    def resident_rows(self) -> tuple[int, int]:
        """Points and cells a read may keep in memory besides what it returns (a cached piece)."""
        return 0, 0

    def read_all(self) -> MeshArrays:
        return self.read((0, self.n_points), (0, self.n_cells))

    def close(self) -> None:
        """Release open files and cached pieces."""


def _even_parts(n_points: int, n_cells: int, count: int) -> list[tuple[int, int, int, int]]:
    ps, cs = np.cumsum([0, *balanced_sizes(n_points, count)]), np.cumsum([0, *balanced_sizes(n_cells, count)])
    return [(int(ps[i]), int(ps[i + 1]), int(cs[i]), int(cs[i + 1])) for i in range(count)]


class _WholeInput(MeshInput):
    """A file that is read whole (meshio formats, ``.npz``), kept in memory once read."""

    sliceable = False

    def __init__(self, path: Path, reader) -> None:
        self.path = path
        self._mesh = reader(path).check(str(path))
        self.n_points = len(self._mesh.points)
        self.n_cells = 0 if self._mesh.cells is None else len(self._mesh.cells)

    def read(self, points, cells) -> MeshArrays:
        return _slice(self._mesh, slice(*points), slice(*cells))

    def close(self) -> None:
        self._mesh = MeshArrays(np.empty((0, 3)))


def _slice(mesh: MeshArrays, points: slice, cells: slice) -> MeshArrays:
    def cut(a):
        return None if a is None else np.asarray(a[cells])

    return MeshArrays(np.asarray(mesh.points[points]), {k: np.asarray(v[points]) for k, v in mesh.point_data.items()},
                      cut(mesh.cells), cut(mesh.cell_types), {k: cut(v) for k, v in mesh.cell_data.items()})


class _HDF5Input(MeshInput):
    """An unprepared HDF5 mesh: ``/points``, optional ``/cells`` and ``/cell_types``, fields in
    ``/fields`` (else the other top-level datasets) and ``/cell_fields``; read by row slices."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open_h5(str(path))
        f = self._file
        if "points" not in f:
            found = sorted(f)  # read before closing: a closed file has no members to list
            self._file.close()
            raise MissingDataError(f"{path}: no 'points' dataset (found: {found}); an unprepared HDF5 mesh "
                                   "needs /points (n_points, ndim), optional /cells and fields")
        fields = f["fields"] if "fields" in f else f
        reserved = {"points", "cells", "cell_types", "cell_type", "cell_owner"}
        point_data = {k: v for k, v in fields.items() if isinstance(v, h5py.Dataset) and k not in reserved}
        cell_data = dict(f["cell_fields"].items()) if "cell_fields" in f else {}
        types = f["cell_types"] if "cell_types" in f else (f["cell_type"] if "cell_type" in f else None)
        self._mesh = MeshArrays(f["points"], point_data, f["cells"] if "cells" in f else None, types, cell_data)
        self._mesh.check(str(path))
        self.n_points = f["points"].shape[0]
        self.n_cells = 0 if self._mesh.cells is None else self._mesh.cells.shape[0]

    def read(self, points, cells) -> MeshArrays:
        out = _slice(self._mesh, slice(*points), slice(*cells))
        return _normalize_cells(out, str(self.path))

    def close(self) -> None:
        self._file.close()


class _PiecesInput(MeshInput):
    """A ``.pvtu``: counts from each piece's header; pieces read with meshio, one cached at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError) as err:
            raise DataPipeError(f"{path}: cannot be read as a .pvtu file ({err})") from None
        pieces = [p.get("Source") for p in root.iter("Piece")]
        if not pieces or None in pieces:
            raise DataPipeError(f"{path}: a .pvtu file needs <Piece Source=...> entries, found {len(pieces)}")
        self.pieces = [path.parent / p for p in pieces]
        missing = [str(p) for p in self.pieces if not p.exists()]
        if missing:
            raise MissingDataError(f"{path}: {len(missing)} of its {len(self.pieces)} pieces do not exist: "
                                   f"{missing[:3]}{' ...' if len(missing) > 3 else ''} (a .pvtu lists its .vtu "
                                   "pieces by path relative to itself; copy them next to it)")
        counts = [_piece_counts(p) for p in self.pieces]
        self._point_offsets = np.cumsum([0, *(c[0] for c in counts)])
        self._cell_offsets = np.cumsum([0, *(c[1] for c in counts)])
        self.n_points, self.n_cells = int(self._point_offsets[-1]), int(self._cell_offsets[-1])
        self._cached: tuple[int, MeshArrays] | None = None

    def parts(self, count: int) -> list[tuple[int, int, int, int]]:
        bounds = np.cumsum([0, *balanced_sizes(len(self.pieces), count)])
        return [(int(self._point_offsets[a]), int(self._point_offsets[b]),
                 int(self._cell_offsets[a]), int(self._cell_offsets[b])) for a, b in zip(bounds, bounds[1:])]

    def chunks(self, max_rows: int) -> list[tuple[int, int, int, int]]:
        out = []
        for i in range(len(self.pieces)):
            p0, p1 = int(self._point_offsets[i]), int(self._point_offsets[i + 1])
            c0, c1 = int(self._cell_offsets[i]), int(self._cell_offsets[i + 1])
            out += [(p0 + a, p0 + b, c0 + c, c0 + d) for a, b, c, d in _even_parts(p1 - p0, c1 - c0, max(
                1, -(-max(p1 - p0, c1 - c0) // max(1, max_rows))))]
        return out

    def resident_rows(self) -> tuple[int, int]:
        return int(np.diff(self._point_offsets).max()), int(np.diff(self._cell_offsets).max())

    def _piece(self, i: int) -> MeshArrays:
        if self._cached is None or self._cached[0] != i:
            self._cached = None  # drop the previous piece before reading the next
            mesh = _read_vtu(self.pieces[i])
            n, m = len(mesh.points), 0 if mesh.cells is None else len(mesh.cells)
            expected = (int(self._point_offsets[i + 1] - self._point_offsets[i]),
                        int(self._cell_offsets[i + 1] - self._cell_offsets[i]))
            if (n, m) != expected:
                raise DataPipeError(f"{self.pieces[i]}: {n} points and {m} cells, but its header says {expected}")
            if mesh.cells is not None:
                mesh.cells = np.where(mesh.cells >= 0, mesh.cells + self._point_offsets[i], -1)
            self._cached = (i, mesh)
        return self._cached[1]

    def read(self, points, cells) -> MeshArrays:
        parts = []
        for i in range(len(self.pieces)):
            p0, c0 = self._point_offsets[i], self._cell_offsets[i]
            pa, pb = max(points[0], p0), min(points[1], self._point_offsets[i + 1])
            ca, cb = max(cells[0], c0), min(cells[1], self._cell_offsets[i + 1])
            if pa < pb or ca < cb:
                piece = self._piece(i)
                parts.append(_slice(piece, slice(pa - p0, max(pa, pb) - p0), slice(ca - c0, max(ca, cb) - c0)))
        return _concat(parts, str(self.path)) if parts else _slice(self._piece(0), slice(0, 0), slice(0, 0))

    def close(self) -> None:
        self._cached = None


_HEADER = re.compile(rb"<Piece\s[^>]*?NumberOfPoints=\"(\d+)\"[^>]*?NumberOfCells=\"(\d+)\"")


def _piece_counts(path: Path) -> tuple[int, int]:
    """Points and cells of a ``.vtu`` piece from its ``<Piece ...>`` tag (the first few KB only)."""
    if not path.exists():
        raise MissingDataError(f"{path}: no such file (a piece of a .pvtu)")
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    found = _HEADER.search(head) or re.search(
        rb"<Piece\s[^>]*?NumberOfCells=\"(\d+)\"[^>]*?NumberOfPoints=\"(\d+)\"", head)
    if not found:
        raise DataPipeError(f"{path}: no <Piece NumberOfPoints=... NumberOfCells=...> header (not a .vtu piece?)")
    a, b = int(found.group(1)), int(found.group(2))
    return (a, b) if found.re is _HEADER else (b, a)


def _concat(parts: Sequence[MeshArrays], where: str) -> MeshArrays:
    width = max((p.cells.shape[1] for p in parts if p.cells is not None), default=0)
    has_cells = any(p.cells is not None for p in parts)
    names = [set(p.point_data) for p in parts], [set(p.cell_data) for p in parts]
    for kind, sets in zip(("point", "cell"), names):
        if any(s != sets[0] for s in sets):
            raise DataPipeError(f"{where}: pieces have different {kind} fields: {[sorted(s) for s in sets]}")
    return MeshArrays(
        np.concatenate([p.points for p in parts]),
        {k: np.concatenate([p.point_data[k] for p in parts]) for k in parts[0].point_data},
        np.concatenate([_pad(p.cells, width) for p in parts]) if has_cells else None,
        np.concatenate([p.cell_types for p in parts]) if has_cells else None,
        {k: np.concatenate([p.cell_data[k] for p in parts]) for k in parts[0].cell_data},
    ).check(where)


def _pad(cells: np.ndarray | None, width: int) -> np.ndarray:
    if cells is None:
        return np.empty((0, width), np.int64)
    if cells.shape[1] == width:
        return cells.astype(np.int64, copy=False)
    out = np.full((len(cells), width), -1, np.int64)
    out[:, : cells.shape[1]] = cells
    return out


def _normalize_cells(mesh: MeshArrays, where: str) -> MeshArrays:
    """int64 cells, and cell types (uint8) when the input had none: from a single node count."""
    if mesh.cells is None:
        return mesh
    if not np.issubdtype(mesh.cells.dtype, np.integer) or mesh.cells.ndim != 2:
        raise DataPipeError(f"{where}: cells must be an integer array (n_cells, k), got "
                            f"{mesh.cells.dtype} {mesh.cells.shape}")
    mesh.cells = mesh.cells.astype(np.int64, copy=False)
    if mesh.cell_types is not None:
        mesh.cell_types = mesh.cell_types.astype(np.uint8, copy=False)
    return mesh


def _read_npz(path: Path) -> MeshArrays:
    try:
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as err:
        raise DataPipeError(f"{path}: cannot be read as .npz ({err})") from None
    if "points" not in arrays:
        raise MissingDataError(f"{path}: no 'points' array (found: {sorted(arrays)})")
    cell_data = {k[len("cell:"):]: arrays.pop(k) for k in list(arrays) if k.startswith("cell:")}
    mesh = MeshArrays(arrays.pop("points"), {}, arrays.pop("cells", None), arrays.pop("cell_types", None), cell_data)
    mesh.point_data = arrays
    return _normalize_cells(mesh, str(path))


def _read_meshio(path: Path) -> MeshArrays:
    try:
        import meshio
    except ImportError:
        raise DataPipeError(f"{path}: reading this format needs meshio (pip install 'physicsnemo_dp[mesh]')") from None
    try:
        mesh = meshio.read(path)
    except (Exception, SystemExit) as err:  # meshio raises ReadError, ValueError, ... and exits on unreadable files
        raise DataPipeError(f"{path}: cannot be read as a mesh by meshio ({type(err).__name__}: {err})") from None
    return from_meshio(mesh, str(path))


_VTP_SECTIONS = (("Verts", {1: "vertex"}), ("Lines", {2: "line"}), ("Polys", {3: "triangle", 4: "quad"}))


def _read_vtu(path: Path) -> MeshArrays:
    """A ``.vtu`` piece or file: meshio's reader, except for a point cloud (no cells), which it cannot read.

    meshio writes a mesh without cells as a ``.vtu`` with no ``<Cells>``
    section and then fails to read it back; such a file (``NumberOfCells="0"``
    in its header) is decoded here like a ``.vtp`` without cells.
    """
    try:
        cloud = _piece_counts(path)[1] == 0
    except DataPipeError:
        cloud = False  # not a header we recognise: meshio's error says more
    return _read_vtk_xml(path, "UnstructuredGrid") if cloud else _read_meshio(path)


def _read_vtp(path: Path) -> MeshArrays:
    """A VTK PolyData file, decoded by meshio's VTU reader (same DataArray encodings)."""
    return _read_vtk_xml(path, "PolyData")


def _read_vtk_xml(path: Path, kind: str) -> MeshArrays:
    """A VTK XML file of type ``kind`` whose pieces hold points, point data and PolyData cell sections."""
    try:
        from meshio.vtu._vtu import VtuReader, _parse_raw_binary
    except ImportError:
        raise DataPipeError(f"{path}: reading this format needs meshio (pip install 'physicsnemo_dp[mesh]')") from None
    try:
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError:  # raw appended binary data is not XML
            root = _parse_raw_binary(str(path))
        if root.tag != "VTKFile" or root.get("type") != kind or root.find(kind) is None:
            raise DataPipeError(f"{path}: not a VTK {kind} file (VTKFile type {root.get('type')!r})")
        reader = VtuReader.__new__(VtuReader)  # only its DataArray decoding is used
        reader.compression, reader.byte_order = root.get("compressor"), root.get("byte_order")
        reader.header_type = root.get("header_type", "UInt32")
        appended = root.find("AppendedData")
        reader.appended_data = None if appended is None else appended.text.strip()[1:]
        pieces, offset = [], 0
        for piece in root.find(kind).findall("Piece"):
            pieces.append(_vtp_piece(reader, piece, offset, path))
            offset += len(pieces[-1].points)
    except DataPipeError:
        raise
    except Exception as err:
        raise DataPipeError(f"{path}: cannot be read as a VTK {kind} file ({type(err).__name__}: {err})") from None
    if not pieces:
        raise DataPipeError(f"{path}: no <Piece> in the {kind}")
    return _concat(pieces, str(path))


def _vtp_piece(reader, piece, offset: int, path: Path) -> MeshArrays:
    n = int(piece.get("NumberOfPoints"))

    def read(array, rows: int) -> np.ndarray:
        if rows:
            return reader.read_data(array)
        from meshio.vtu._vtu import vtu_to_numpy_type  # an empty piece: meshio cannot decode empty arrays

        return np.empty((0, int(array.get("NumberOfComponents", 1))), vtu_to_numpy_type[array.get("type")])

    def data(parent, rows: int) -> dict[str, np.ndarray]:
        out = {}
        for array in [] if parent is None else parent.findall("DataArray"):
            values = read(array, rows)
            width = int(array.get("NumberOfComponents", 1)) if not rows else values.size // rows
            out[array.get("Name")] = values.reshape(rows, width) if width != 1 else values.reshape(rows)
        return out

    points = piece.find("Points/DataArray")
    points = read(points, n).reshape(n, int(points.get("NumberOfComponents", 3)) if not n else -1)
    if int(piece.get("NumberOfStrips", 0)):
        raise DataPipeError(f"{path}: cell type 'triangle strip' is not supported (supported: fixed-size "
                            f"types {sorted(CELL_TYPES)})")
    blocks, types = [], []
    for tag, names in _VTP_SECTIONS:
        section, count = piece.find(tag), int(piece.get(f"NumberOf{tag}", 0))
        if section is None or not count:
            continue
        arrays = {a.get("Name"): reader.read_data(a) for a in section.findall("DataArray")}
        sizes = np.diff(np.r_[0, arrays["offsets"]])
        rows = np.full((count, int(sizes.max())), -1, np.int64)
        rows[np.arange(rows.shape[1]) < sizes[:, None]] = arrays["connectivity"].astype(np.int64) + offset
        kinds = [names.get(int(k), "polygon" if tag == "Polys" else None) for k in sizes]
        if None in kinds:
            raise DataPipeError(f"{path}: poly-{tag.lower()} cells are not supported (supported: fixed-size "
                                f"types {sorted(CELL_TYPES)})")
        blocks.append(rows)
        types.append(np.array([CELL_TYPES[k] for k in kinds], np.uint8))
    m = sum(len(b) for b in blocks)
    width = max((b.shape[1] for b in blocks), default=0)
    cells = np.concatenate([_pad(b, width) for b in blocks]) if blocks else None
    return MeshArrays(points, data(piece.find("PointData"), n), cells, np.concatenate(types) if blocks else None,
                      data(piece.find("CellData"), m) if blocks else {}).check(str(path))


def from_meshio(mesh, where: str = "mesh") -> MeshArrays:
    """A :class:`MeshArrays` from a ``meshio.Mesh``: blocks concatenated in order, padded, typed."""
    blocks = [b for b in mesh.cells if len(b.data)]
    for block in blocks:
        if block.type not in CELL_TYPES or np.asarray(block.data).ndim != 2:
            raise DataPipeError(f"{where}: cell type '{block.type}' is not supported (supported: fixed-size "
                                f"types {sorted(CELL_TYPES)})")
    cell_data = {}
    for name, per_block in mesh.cell_data.items():
        arrays = [np.asarray(a) for a, b in zip(per_block, mesh.cells) if len(b.data)]
        lengths = [len(a) for a in arrays]
        if lengths != [len(b.data) for b in blocks]:
            raise DataPipeError(f"{where}: cell field '{name}' has {lengths} rows per cell block, the blocks have "
                                f"{[len(b.data) for b in blocks]} cells")
        cell_data[name] = np.concatenate(arrays) if arrays else np.empty(0)
    width = max((b.data.shape[1] for b in blocks), default=0)
    cells = np.concatenate([_pad(np.asarray(b.data, np.int64), width) for b in blocks]) if blocks else None
    types = np.concatenate([np.full(len(b.data), CELL_TYPES[b.type], np.uint8) for b in blocks]) if blocks else None
    point_data = {k: np.asarray(v) for k, v in mesh.point_data.items()}
    if _vertex_per_point(cells, types, len(mesh.points)) and not cell_data:
        cells, types = None, None  # a point cloud (how write_mesh stores one where a file needs cells)
    return MeshArrays(np.asarray(mesh.points), point_data, cells, types, cell_data if blocks else {}).check(where)


def _vertex_per_point(cells: np.ndarray | None, types: np.ndarray | None, n_points: int) -> bool:
    """Whether the cells are one ``vertex`` per point, in point order: a point cloud, not a mesh."""
    return (cells is not None and cells.shape == (n_points, 1) and n_points > 0
            and bool((types == CELL_TYPES["vertex"]).all()) and np.array_equal(cells[:, 0], np.arange(n_points)))


def to_meshio(mesh: MeshArrays):
    """A ``meshio.Mesh`` with one cell block per run of equal cell types (padding dropped)."""
    import meshio

    blocks, data = [], {k: [] for k in mesh.cell_data}
    if mesh.cells is not None and len(mesh.cells):
        types = mesh.cell_types if mesh.cell_types is not None else np.full(len(mesh.cells), _default_type(mesh.cells))
        nodes = (mesh.cells >= 0).sum(axis=1)  # polygons of one type can differ in node count
        starts = np.flatnonzero(np.r_[True, (types[1:] != types[:-1]) | (nodes[1:] != nodes[:-1])])
        for a, b in zip(starts, [*starts[1:], len(types)]):
            rows = mesh.cells[a:b]
            width = int((rows[0] >= 0).sum())
            blocks.append((_TYPE_NAMES[int(types[a])], rows[:, :width]))
            for k in data:
                data[k].append(mesh.cell_data[k][a:b])
    return meshio.Mesh(mesh.points, blocks, point_data=dict(mesh.point_data), cell_data=data)


def _default_type(cells: np.ndarray) -> int:
    by_width = {1: "vertex", 2: "line", 3: "triangle", 4: "tetra", 8: "hexahedron"}
    if cells.shape[1] not in by_width:
        raise DataPipeError(f"cells of width {cells.shape[1]} need cell_types")
    return CELL_TYPES[by_width[cells.shape[1]]]


def write_mesh(path, mesh: MeshArrays, **kwargs) -> Path:
    """Write ``mesh`` with meshio (format from the suffix; ``kwargs`` go to ``meshio.write``).

    A point cloud (no cells) is read back as one: a legacy ``.vtk`` stores it
    with one ``vertex`` cell per point (meshio reads no ``.vtk`` without
    cells), which :func:`read_mesh` drops again; a ``.vtu`` has no cells.
    ``.msh`` is written as Gmsh 2.2 (``file_format="gmsh22"`` unless given),
    the Gmsh version whose meshio writer keeps point and cell data of mixed
    meshes. Exodus files keep points, cells and point data (meshio writes no
    cell data to them).
    """
    import meshio

    path = Path(path)
    out = to_meshio(mesh.check(str(path)))
    if mesh.cells is None and path.suffix == ".vtk" and len(mesh.points):
        out.cells = [meshio.CellBlock("vertex", np.arange(len(mesh.points))[:, None])]  # meshio reads no cell-less .vtk
    if path.suffix == ".msh":
        kwargs.setdefault("file_format", "gmsh22")
        for tag in ("gmsh:physical", "gmsh:geometrical"):  # meshio's own filler has the wrong lengths for mixed meshes
            out.cell_data.setdefault(tag, [np.zeros(len(b.data), np.int32) for b in out.cells])
    path.parent.mkdir(parents=True, exist_ok=True)
    meshio.write(path, out, **kwargs)
    return path


def write_pvtu(path, pieces: Sequence[MeshArrays]) -> Path:
    """Write ``pieces`` as ``<stem>_<i>.vtu`` files and the ``.pvtu`` index listing them (written last).

    Cells of a piece index the piece's own points, as in any ``.pvtu``; read
    back, piece ``i``'s points follow those of pieces ``0..i-1``.
    """
    import meshio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = []
    for i, piece in enumerate(pieces):
        name = f"{path.stem}_{i}.vtu"
        meshio.write(path.parent / name, to_meshio(piece.check(f"{path} piece {i}")), binary=True)
        names.append(name)
    first = pieces[0]

    def arrays(tag: str, data: Mapping[str, np.ndarray]) -> str:
        rows = "".join(f'<PDataArray type="{_vtk_type(v)}" Name="{k}" NumberOfComponents='
                       f'"{int(np.prod(v.shape[1:]))}"/>' for k, v in data.items())
        return f"<{tag}>{rows}</{tag}>"

    text = (
        '<?xml version="1.0"?>\n<VTKFile type="PUnstructuredGrid" version="0.1" byte_order="LittleEndian">\n'
        '<PUnstructuredGrid GhostLevel="0">\n'
        f"{arrays('PPointData', first.point_data)}\n{arrays('PCellData', first.cell_data)}\n"
        f'<PPoints><PDataArray type="{_vtk_type(first.points)}" '
        f'NumberOfComponents="{first.points.shape[1]}"/></PPoints>\n'
        + "".join(f'<Piece Source="{n}"/>\n' for n in names)
        + "</PUnstructuredGrid>\n</VTKFile>\n"
    )
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return path


def _vtk_type(values: np.ndarray) -> str:
    kind = {"f": "Float", "i": "Int", "u": "UInt"}[values.dtype.kind]
    return f"{kind}{8 * values.dtype.itemsize}"
