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

from ._files import atomic_path

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
               chunks: Sequence[int] | bool | None = None, compression: str | None = None) -> list[Path]:
    """Write ``fields`` (each ``(n_samples, *grid)``) in one of the layouts :class:`~datapipes.HDF5Fields` reads.

    ``layout="stacked"`` and ``"groups"`` write one file at ``path``;
    ``"files"`` writes ``path/sample_NNNNN.h5``. ``chunks`` is the HDF5 chunk
    shape of each dataset as written (including the sample dim when stacked).
    """
    n = _n_samples(fields)
    options = {"chunks": chunks, "compression": compression}
    if layout == "stacked":
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            for name, data in fields.items():
                f.create_dataset(name, data=data, **options)
        return [Path(path)]
    if layout == "groups":
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            for i in range(n):
                group = f.create_group(f"sample_{i:05d}")
                for name, data in fields.items():
                    group.create_dataset(name, data=data[i], **options)
        return [Path(path)]
    if layout == "files":
        out = []
        for i in range(n):
            target = Path(path) / f"sample_{i:05d}.h5"
            with atomic_path(target) as tmp, h5py.File(tmp, "w") as f:
                for name, data in fields.items():
                    f.create_dataset(name, data=data[i], **options)
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


def write_netcdf(path, fields: Mapping[str, np.ndarray], *, dims: Sequence[str] | None = None) -> Path:
    """Write ``fields`` as netCDF-4 with dims ``dims`` (default ``sample, [z,] y, x``) and coordinates."""
    _n_samples(fields)
    with atomic_path(path) as tmp:
        _dataset(fields, dims).to_netcdf(tmp, engine="netcdf4")
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
