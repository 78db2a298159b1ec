"""Synthetic datasets for tests and examples: small by default, scalable by arguments.

Grid generators return ``{variable: array of shape (n_samples, *grid)}``:

* :func:`darcy_flow` — piecewise-constant permeability (a thresholded Gaussian
  random field, as in the FNO Darcy benchmark) and the pressure solving
  ``-div(k grad p) = 1`` with ``p = 0`` on the boundary (finite volumes,
  Jacobi-preconditioned conjugate gradients, batched over samples);
* :func:`heat_equation` — a random smooth periodic temperature ``u0`` and the
  exact solution ``u`` of ``u_t = D lap(u)`` at time ``t`` (Fourier decay), on
  a grid of any dimension.

:func:`point_cloud` returns a :class:`MeshData`: a triangulated torus surface
with a pressure-like field and normals, or a volume point cloud with a
temperature and a velocity, with points in random order (as meshers emit
them, so the space-filling-curve preparation has work to do).

The ``write_*`` functions put grid data in the formats the readers take:
HDF5 in its three layouts, netCDF and Zarr. Every file is written atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np
import xarray as xr

from ._checksums import FILTER_OPTIONS
from ._files import atomic_path
from .hdf5 import default_chunks

__all__ = ["MeshData", "darcy_flow", "heat_equation", "point_cloud", "write_hdf5", "write_mesh_input",
           "write_netcdf", "write_zarr"]


# --------------------------------------------------------------------------- #
# Grid fields
# --------------------------------------------------------------------------- #
def _random_field(rng: np.random.Generator, n_samples: int, shape: Sequence[int], alpha: float, tau: float) -> np.ndarray:
    """Gaussian random field with spectrum ``(4 pi^2 |k|^2 + tau^2)^(-alpha/2)`` (periodic)."""
    k2 = sum(np.meshgrid(*[np.fft.fftfreq(n, 1 / n) ** 2 for n in shape], indexing="ij"))
    spectrum = (4 * np.pi**2 * k2 + tau**2) ** (-alpha / 2)
    spectrum.flat[0] = 0.0  # no mean mode: otherwise a thresholded field is often one constant value
    noise = np.fft.fftn(rng.standard_normal((n_samples, *shape)), axes=tuple(range(1, len(shape) + 1)))
    return np.fft.ifftn(noise * spectrum, axes=tuple(range(1, len(shape) + 1))).real


def _harmonic(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Conductivity of the face between two cells (harmonic mean)."""
    return 2 * a * b / (a + b)


def darcy_flow(n_samples: int = 4, resolution: int = 32, *, seed: int = 0, contrast: tuple[float, float] = (3.0, 12.0),
               tol: float = 1e-7, max_iter: int = 10_000) -> dict[str, np.ndarray]:
    """Permeability and pressure of 2-D Darcy flow on a ``resolution``-square unit grid (float32)."""
    if resolution < 3:
        raise ValueError(f"resolution must be >= 3, got {resolution}")
    rng = np.random.default_rng(seed)
    field = _random_field(rng, n_samples, (resolution, resolution), alpha=2.0, tau=3.0)
    k = np.where(field >= 0, contrast[1], contrast[0])
    h2 = 1.0 / (resolution - 1) ** 2
    kx = _harmonic(k[:, :-1, 1:-1], k[:, 1:, 1:-1])  # faces between rows, at interior columns
    ky = _harmonic(k[:, 1:-1, :-1], k[:, 1:-1, 1:])

    def apply(u):  # -div(k grad u) on interior nodes, zero Dirichlet boundary
        p = np.pad(u, ((0, 0), (1, 1), (1, 1)))
        fx = kx * (p[:, 1:, 1:-1] - p[:, :-1, 1:-1])
        fy = ky * (p[:, 1:-1, 1:] - p[:, 1:-1, :-1])
        return -((fx[:, 1:] - fx[:, :-1]) + (fy[:, :, 1:] - fy[:, :, :-1])) / h2

    diag = (kx[:, 1:] + kx[:, :-1] + ky[:, :, 1:] + ky[:, :, :-1]) / h2
    b = np.ones_like(diag)
    u = np.zeros_like(b)
    r = b.copy()
    z = r / diag
    p = z.copy()
    rz = (r * z).sum(axis=(1, 2), keepdims=True)
    norm_b = np.sqrt((b * b).sum(axis=(1, 2)))
    for _ in range(max_iter):
        ap = apply(p)
        step = rz / (p * ap).sum(axis=(1, 2), keepdims=True)
        u += step * p
        r -= step * ap
        if (np.sqrt((r * r).sum(axis=(1, 2))) <= tol * norm_b).all():
            break
        z = r / diag
        rz_new = (r * z).sum(axis=(1, 2), keepdims=True)
        p = z + rz_new / rz * p
        rz = rz_new
    return {"permeability": k.astype(np.float32), "pressure": np.pad(u, ((0, 0), (1, 1), (1, 1))).astype(np.float32)}


def heat_equation(n_samples: int = 4, shape: Sequence[int] = (32, 32), *, time: float = 0.01,
                  diffusivity: float = 1.0, modes: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial temperature ``u0`` and exact solution ``u`` at ``time`` on a periodic unit grid (float32)."""
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    freqs = np.meshgrid(*[np.fft.fftfreq(n, 1 / n) for n in shape], indexing="ij")
    k2 = sum(f**2 for f in freqs)
    low = np.maximum.reduce([np.abs(f) for f in freqs]) <= modes
    axes = tuple(range(1, len(shape) + 1))
    coeffs = np.fft.fftn(rng.standard_normal((n_samples, *shape)), axes=axes) * low
    u0 = np.fft.ifftn(coeffs, axes=axes).real
    u = np.fft.ifftn(coeffs * np.exp(-4 * np.pi**2 * diffusivity * k2 * time), axes=axes).real
    scale = np.abs(u0).max(axis=axes, keepdims=True)
    return {"u0": (u0 / scale).astype(np.float32), "u": (u / scale).astype(np.float32)}


# --------------------------------------------------------------------------- #
# Point clouds
# --------------------------------------------------------------------------- #
@dataclass
class MeshData:
    """Points ``(n, 3)``, per-point ``fields`` and optional ``cells`` ``(m, k)``."""

    points: np.ndarray
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    cells: np.ndarray | None = None


def point_cloud(n_points: int = 2000, *, kind: str = "surface", seed: int = 0) -> MeshData:
    """A torus surface with triangles (``kind="surface"``) or a cube volume point cloud (``"volume"``)."""
    rng = np.random.default_rng(seed)
    if kind == "surface":
        mesh = _torus(max(3, int(np.sqrt(n_points * 2.5))), max(3, int(np.sqrt(n_points / 2.5))))
    elif kind == "volume":
        points = rng.random((n_points, 3))
        centres = rng.random((3, 3))
        dist2 = ((points[:, None, :] - centres[None]) ** 2).sum(-1)
        temperature = np.exp(-dist2 / 0.05).sum(-1)
        velocity = np.stack([np.sin(2 * np.pi * points[:, 1]), np.sin(2 * np.pi * points[:, 2]),
                             np.sin(2 * np.pi * points[:, 0])], -1)
        mesh = MeshData(points, {"temperature": temperature, "velocity": velocity})
    else:
        raise ValueError(f"kind must be 'surface' or 'volume', got {kind!r}")
    order = rng.permutation(len(mesh.points))  # as a mesher would emit them: no spatial order
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return MeshData(
        mesh.points[order].astype(np.float32),
        {k: v[order].astype(np.float32) for k, v in mesh.fields.items()},
        None if mesh.cells is None else inverse[mesh.cells],
    )


def _torus(nu: int, nv: int, major: float = 1.0, minor: float = 0.4) -> MeshData:
    u, v = np.meshgrid(np.linspace(0, 2 * np.pi, nu, endpoint=False),
                       np.linspace(0, 2 * np.pi, nv, endpoint=False), indexing="ij")
    normal = np.stack([np.cos(u) * np.cos(v), np.sin(u) * np.cos(v), np.sin(v)], -1).reshape(-1, 3)
    centre = np.stack([major * np.cos(u), major * np.sin(u), np.zeros_like(u)], -1).reshape(-1, 3)
    points = centre + minor * normal
    pressure = 1 - normal[:, 0] ** 2 + 0.3 * np.sin(3 * u).reshape(-1)
    i, j = np.meshgrid(np.arange(nu), np.arange(nv), indexing="ij")
    a, b = i * nv + j, ((i + 1) % nu) * nv + j
    c, d = ((i + 1) % nu) * nv + (j + 1) % nv, i * nv + (j + 1) % nv
    cells = np.concatenate([np.stack([a, b, c], -1).reshape(-1, 3), np.stack([a, c, d], -1).reshape(-1, 3)])
    return MeshData(points, {"pressure": pressure, "normal": normal}, cells)


def write_mesh_input(path, mesh: MeshData) -> Path:
    """Write an unprepared mesh as ``.npz`` (the input of ``python -m datapipes.prepare_cli``)."""
    arrays = {"points": mesh.points, **mesh.fields}
    if mesh.cells is not None:
        arrays["cells"] = mesh.cells
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path


# --------------------------------------------------------------------------- #
# Writers
# --------------------------------------------------------------------------- #
def _n_samples(fields: Mapping[str, np.ndarray]) -> int:
    counts = {len(a) for a in fields.values()}
    if len(counts) != 1:
        raise ValueError(f"fields disagree on the number of samples: { {k: len(a) for k, a in fields.items()} }")
    return counts.pop()


def write_hdf5(path, fields: Mapping[str, np.ndarray], *, layout: str = "stacked",
               chunks: Sequence[int] | bool | None = None, compression: str | None = None,
               checksums: bool = False) -> list[Path]:
    """Write ``fields`` (each ``(n_samples, *grid)``) in one of the layouts :class:`~datapipes.HDF5Fields` reads.

    ``layout="stacked"`` and ``"groups"`` write one file at ``path``;
    ``"files"`` writes ``path/sample_NNNNN.h5``. ``chunks`` is the HDF5 chunk
    shape of each dataset as written (including the sample dim when stacked).
    ``checksums`` stores a Fletcher-32 checksum with every chunk, which the
    readers verify (see :mod:`datapipes._checksums`); it needs chunks, so
    without ``chunks`` the datasets get :func:`~datapipes.hdf5.default_chunks`
    (whole rows of one sample, at most 1 MiB). Off by default: without
    ``chunks`` the datasets are then contiguous, the fastest to read (verified
    chunks read 2-5 times slower from the page cache), and unprotected.
    """
    n = _n_samples(fields)
    leading = 1 if layout == "stacked" else 0

    def create(f, name: str, data: np.ndarray) -> None:
        options = {"chunks": chunks, "compression": compression}
        if checksums:
            options.update(FILTER_OPTIONS)
            if chunks is None or chunks is True:
                options["chunks"] = default_chunks(data.shape, data.dtype.itemsize, leading=leading)
        f.create_dataset(name, data=data, **options)

    if layout == "stacked":
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            for name, data in fields.items():
                create(f, name, data)
        return [Path(path)]
    if layout == "groups":
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            for i in range(n):
                group = f.create_group(f"sample_{i:05d}")
                for name, data in fields.items():
                    create(group, name, data[i])
        return [Path(path)]
    if layout == "files":
        out = []
        for i in range(n):
            target = Path(path) / f"sample_{i:05d}.h5"
            with atomic_path(target) as tmp, h5py.File(tmp, "w") as f:
                for name, data in fields.items():
                    create(f, name, data[i])
            out.append(target)
        return out
    raise ValueError(f"layout must be 'stacked', 'groups' or 'files', got {layout!r}")


def _dataset(fields: Mapping[str, np.ndarray], dims: Sequence[str] | None) -> xr.Dataset:
    """xarray Dataset with a ``sample`` dim and unit-interval coordinates along the grid dims."""
    ndim = next(iter(fields.values())).ndim - 1
    dims = tuple(dims) if dims is not None else ("sample", *(("z", "y", "x")[3 - ndim :] if ndim <= 3 else
                                                            [f"dim{i}" for i in range(ndim)]))
    first = next(iter(fields.values()))
    coords = {d: np.linspace(0.0, 1.0, n) for d, n in zip(dims[1:], first.shape[1:])}
    coords[dims[0]] = np.arange(first.shape[0])
    return xr.Dataset({name: (dims, data) for name, data in fields.items()}, coords=coords)


def write_netcdf(path, fields: Mapping[str, np.ndarray], *, dims: Sequence[str] | None = None,
                 checksums: bool = False) -> Path:
    """Write ``fields`` as netCDF-4 with dims ``dims`` (default ``sample, [z,] y, x``) and coordinates.

    ``checksums``: chunk the variables (:func:`~datapipes.hdf5.default_chunks`)
    with netCDF-4's Fletcher-32 filter, which the netCDF library verifies on
    every read; False (the default) writes contiguous variables without checksums.
    """
    _n_samples(fields)
    encoding = None
    if checksums:
        encoding = {name: {"fletcher32": True, "chunksizes": default_chunks(data.shape, data.dtype.itemsize)}
                    for name, data in fields.items()}
    with atomic_path(path) as tmp:
        _dataset(fields, dims).to_netcdf(tmp, engine="netcdf4", encoding=encoding)
    return Path(path)


def write_zarr(path, fields: Mapping[str, np.ndarray], *, dims: Sequence[str] | None = None,
               chunks: Mapping[str, int] | None = None) -> Path:
    """Write ``fields`` as a Zarr store (``chunks`` per dim name, e.g. ``{"sample": 1}``)."""
    _n_samples(fields)
    ds = _dataset(fields, dims)
    encoding = None
    if chunks:
        encoding = {name: {"chunks": tuple(chunks.get(d, ds.sizes[d]) for d in ds[name].dims)} for name in fields}
    with atomic_path(path) as tmp:
        ds.to_zarr(tmp, mode="w", encoding=encoding, zarr_format=2)  # v2: consolidated metadata, no warnings
    return Path(path)


# --------------------------------------------------------------------------- #
# Steady heat on a plate with a hole (graph networks, issue 17)
# --------------------------------------------------------------------------- #
def plate_with_hole(n_samples: int = 4, n_around: int = 48, n_radial: int = 12, *, seed: int = 0,
                    tol: float = 1e-10, max_iter: int = 5000) -> list[MeshData]:
    """Triangulated square plates with a circular hole and their steady temperature (P1 finite elements).

    Each sample is the square ``[-1, 1]^2`` minus a disc whose centre and
    radius vary per sample, meshed by ``n_around`` rays from the hole to the
    outer square and ``n_radial`` rings between them (a mapped mesh, every
    quad cut into two counter-clockwise triangles, rings graded toward the hole), so the
    connectivity is the same for every sample but the geometry is not. The
    temperature ``u`` solves ``-lap(u) = f`` with ``u = 0`` on the outer
    square and ``u = T`` (random per sample) on the hole; ``f`` is a sum of
    random Gaussian hot spots. Solved with P1 elements and Jacobi-
    preconditioned conjugate gradients in numpy (no scipy).

    Fields per point: ``temperature`` (the target), ``source`` (``f``),
    ``dirichlet`` (the prescribed value on boundary points, 0 elsewhere) and
    ``boundary`` ``(n, 2)`` flags (outer square, hole). ``points`` are
    ``(n, 2)`` float32 in random order and ``cells`` ``(m, 3)`` triangles, as
    a mesher would emit them, so :func:`~datapipes.prepare_mesh` has work to do.

    Args:
        n_samples: plates to generate.
        n_around: nodes per ring (rays from the hole to the outer square).
        n_radial: rings of cells between the hole and the outer square.
        seed: seed of the geometry, sources and hole temperatures.
        tol: relative residual at which conjugate gradients stop.
        max_iter: conjugate-gradient iterations at most (0 leaves the
            temperature at its boundary values: for callers that need the mesh only).

    Raises:
        ValueError: fewer than 8 nodes per ring or 2 rings.
    """
    if n_around < 8 or n_radial < 2:
        raise ValueError(f"n_around must be >= 8 and n_radial >= 2, got {n_around} and {n_radial}")
    rng = np.random.default_rng(seed)
    theta = 2 * np.pi * np.arange(n_around) / n_around
    ray = np.stack([np.cos(theta), np.sin(theta)], -1)
    square = ray / np.abs(ray).max(axis=1, keepdims=True)  # where each ray meets the outer square
    t = (np.arange(n_radial + 1) / n_radial) ** 1.5  # ring parameter, denser near the hole
    ring, around = np.meshgrid(np.arange(n_radial + 1), np.arange(n_around), indexing="ij")
    a = ring[:-1, :] * n_around + around[:-1, :]
    b = ring[:-1, :] * n_around + (around[:-1, :] + 1) % n_around
    c, d = a + n_around, b + n_around
    cells = np.concatenate([np.stack([a, d, b], -1).reshape(-1, 3), np.stack([a, c, d], -1).reshape(-1, 3)])
    hole = (ring == 0).reshape(-1)
    outer = (ring == n_radial).reshape(-1)
    samples = []
    for _ in range(n_samples):
        centre = rng.uniform(-0.15, 0.15, 2)
        radius = rng.uniform(0.25, 0.45)
        inner = centre + radius * ray
        points = ((1 - t)[:, None, None] * inner[None] + t[:, None, None] * square[None]).reshape(-1, 2)
        spots = rng.uniform(-0.8, 0.8, (3, 2))
        amplitude = rng.uniform(5.0, 20.0, 3)
        dist2 = ((points[:, None, :] - spots[None]) ** 2).sum(-1)
        source = (amplitude * np.exp(-dist2 / 0.02)).sum(-1)
        dirichlet = np.where(hole, rng.uniform(0.5, 1.5), 0.0)
        u = _p1_poisson(points, cells, source, hole | outer, dirichlet, tol, max_iter)
        boundary = np.stack([outer, hole], -1).astype(np.float32)
        order = rng.permutation(len(points))
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        fields = {"temperature": u, "source": source, "dirichlet": dirichlet, "boundary": boundary}
        samples.append(MeshData(points[order].astype(np.float32),
                                {k: v[order].astype(np.float32) for k, v in fields.items()}, inverse[cells]))
    return samples


def _p1_poisson(points: np.ndarray, cells: np.ndarray, source: np.ndarray, fixed: np.ndarray, value: np.ndarray,
                tol: float, max_iter: int) -> np.ndarray:
    """``-lap(u) = source`` with ``u = value`` where ``fixed``: P1 stiffness applied per triangle, Jacobi CG."""
    p = points[cells]  # (m, 3, 2)
    e = np.roll(p, -1, axis=1) - np.roll(p, 1, axis=1)  # edge opposite each vertex
    area = 0.5 * np.abs(e[:, 0, 0] * e[:, 1, 1] - e[:, 0, 1] * e[:, 1, 0])
    local = np.einsum("mik,mjk->mij", e, e) / (4 * area[:, None, None])  # grad(phi_i).grad(phi_j) * area
    n = len(points)

    def apply(u):
        out = np.zeros(n)
        np.add.at(out, cells, np.einsum("mij,mj->mi", local, u[cells]))
        return out

    diag = np.zeros(n)
    np.add.at(diag, cells, np.einsum("mii->mi", local))
    load = np.zeros(n)
    np.add.at(load, cells, (source[cells].mean(axis=1) * area / 3)[:, None])  # lumped mass
    free = ~fixed
    u = np.where(fixed, value, 0.0)
    r = np.where(free, load - apply(u), 0.0)
    z = np.where(free, r / diag, 0.0)
    d = z.copy()
    rz, norm = r @ z, np.sqrt(r @ r)
    for _ in range(max_iter):
        if np.sqrt(r @ r) <= tol * max(norm, 1e-300):
            break
        ad = np.where(free, apply(d), 0.0)
        step = rz / (d @ ad)
        u += step * d
        r -= step * ad
        z = np.where(free, r / diag, 0.0)
        rz, rz_old = r @ z, rz
        d = z + rz / rz_old * d
    return u


__all__ += ["plate_with_hole"]


# --------------------------------------------------------------------------- #
# A volume mesh around an obstacle, written as a multi-part VTU (datapipes.mesh_formats)
# --------------------------------------------------------------------------- #
_KUHN = [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]  # axis orders: 6 tets per hex


def obstacle_mesh(n_points: int = 5000, *, pieces: int = 1, seed: int = 0, radius: float = 0.5) -> list:
    """Tetrahedra in a channel ``[0, 4] x [0, 2] x [0, 2]`` around a sphere, as ``pieces`` parts.

    A structured grid of about ``n_points`` nodes, minus the hexahedra whose
    centre lies in the sphere (centre ``(1.5, 1, 1)``), each hexahedron split
    into 6 tetrahedra along its main diagonal (Kuhn's split, which matches
    across neighbours); interior nodes are jittered by up to 15 % of the
    spacing. Point data: the ``velocity`` and ``pressure`` of potential flow
    past the sphere; cell data: each tetrahedron's ``volume``. Parts are slabs
    along the channel, each with its own points (shared nodes repeated, as in
    a solver's ``.pvtu``), in random order as meshers emit them.
    Returns a list of :class:`~datapipes.mesh_formats.MeshArrays`.
    """
    from .mesh_formats import CELL_TYPES, MeshArrays

    if n_points < 8 or pieces < 1:
        raise ValueError(f"obstacle_mesh needs n_points >= 8 and pieces >= 1, got {n_points}, {pieces}")
    rng = np.random.default_rng(seed)
    ny = max(2, round((n_points / 2) ** (1 / 3)))
    shape = (2 * ny, ny, ny)  # nodes per axis
    h = 2.0 / (ny - 1)
    grid = np.stack(np.meshgrid(*[np.arange(n) * h for n in shape], indexing="ij"), -1).reshape(-1, 3)
    interior = np.all((grid > 1e-9) & (grid < np.array(shape) * h - h - 1e-9), axis=1)
    grid[interior] += rng.uniform(-0.15 * h, 0.15 * h, (int(interior.sum()), 3))
    hexes = np.stack(np.meshgrid(*[np.arange(n - 1) for n in shape], indexing="ij"), -1).reshape(-1, 3)
    centre = np.array([1.5, 1.0, 1.0])
    hexes = hexes[np.linalg.norm((hexes + 0.5) * h - centre, axis=1) > radius]
    node = lambda ijk: np.ravel_multi_index(tuple(ijk.T), shape)  # noqa: E731
    tets = []
    for order in _KUHN:
        corner, path = hexes.copy(), [node(hexes)]
        for axis in order:
            corner[:, axis] += 1
            path.append(node(corner))
        tets.append(np.stack(path, -1))
    tets = np.stack(tets, 1).reshape(-1, 4)  # hex-major, so a slab of hexes is a range of tets
    slab = np.repeat(hexes[:, 0], 6)
    rel = grid - centre
    r = np.maximum(np.linalg.norm(rel, axis=1), radius)[:, None]
    velocity = (1 + radius**3 / (2 * r**3)) * np.array([1.0, 0, 0]) - 1.5 * radius**3 * rel[:, :1] * rel / r**5
    pressure = 0.5 * (1 - (velocity**2).sum(1))
    a, b, c, d = (grid[tets[:, i]] for i in range(4))
    volume = np.abs(np.einsum("ij,ij->i", b - a, np.cross(c - a, d - a))) / 6
    if pieces > shape[0] - 1:
        raise ValueError(f"obstacle_mesh: {n_points} points make {shape[0] - 1} slabs of cells along the "
                         f"channel, fewer than pieces={pieces}")
    bounds = np.linspace(0, shape[0] - 1, pieces + 1).round().astype(int)
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        mine = np.flatnonzero((slab >= lo) & (slab < hi))
        used = np.unique(tets[mine])
        order = rng.permutation(len(used))
        local = np.empty(len(grid), np.int64)
        local[used[order]] = np.arange(len(used))
        out.append(MeshArrays(
            grid[used[order]], {"pressure": pressure[used[order]].astype(np.float32),
                                "velocity": velocity[used[order]].astype(np.float32)},
            local[tets[mine]], np.full(len(mine), CELL_TYPES["tetra"], np.uint8),
            {"volume": volume[mine].astype(np.float32)}))
    return out


def write_obstacle_vtu(path, n_points: int = 5000, *, pieces: int = 4, seed: int = 0) -> Path:
    """Write :func:`obstacle_mesh` as a multi-part ``.pvtu`` (``pieces > 1``) or one ``.vtu`` file."""
    from .mesh_formats import write_mesh, write_pvtu

    parts = obstacle_mesh(n_points, pieces=pieces, seed=seed)
    path = Path(path)
    if path.suffix == ".pvtu":
        return write_pvtu(path, parts)
    if len(parts) != 1:
        raise ValueError(f"{path}: {pieces} pieces need a .pvtu path")
    return write_mesh(path, parts[0], binary=True)


__all__ += ["obstacle_mesh", "write_obstacle_vtu"]
