"""Small on-disk datasets in every supported format, and the arrays they hold.

Used by single-process tests and by multi-rank bodies (where rank 0 writes and
the others wait at a barrier). Everything is deterministic, so every rank can
also compute the expected arrays itself without reading the files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from datapipes import HDF5Fields, XarrayFields, prepare_mesh
from datapipes.synthetic import darcy_flow, heat_equation, point_cloud, write_hdf5, write_netcdf, write_zarr

GRID_FORMATS = ("hdf5", "hdf5-chunked", "hdf5-gzip", "hdf5-groups", "hdf5-files", "netcdf", "zarr")
VARIABLES = ("permeability", "pressure")
N_SAMPLES = 6
RESOLUTION = 16


def grid_fields() -> dict[str, np.ndarray]:
    """Darcy samples, ``(6, 16, 16)`` float32 per variable."""
    return darcy_flow(N_SAMPLES, RESOLUTION, seed=1)


def heat_fields() -> dict[str, np.ndarray]:
    """3-D heat samples ``(4, 8, 6, 5)``, for splits over several dims."""
    return heat_equation(4, (8, 6, 5), seed=2)


def write_grid(fmt: str, directory: Path, fields: dict[str, np.ndarray] | None = None) -> Path:
    """Write ``fields`` (default :func:`grid_fields`) in format ``fmt``; return what to open."""
    fields = grid_fields() if fields is None else fields
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    grid = next(iter(fields.values())).shape[1:]
    if fmt == "hdf5":
        return write_hdf5(directory / "stacked.h5", fields)[0]
    if fmt == "hdf5-chunked":
        return write_hdf5(directory / "chunked.h5", fields, chunks=(1, 4, *grid[1:]))[0]
    if fmt == "hdf5-gzip":
        return write_hdf5(directory / "gzip.h5", fields, chunks=(1, 3, *grid[1:]), compression="gzip")[0]
    if fmt == "hdf5-groups":
        return write_hdf5(directory / "groups.h5", fields, layout="groups")[0]
    if fmt == "hdf5-files":
        write_hdf5(directory / "files", fields, layout="files")
        return directory / "files" / "sample_*.h5"
    if fmt == "netcdf":
        return write_netcdf(directory / "data.nc", fields)
    if fmt == "zarr":
        return write_zarr(directory / "data.zarr", fields, chunks={"sample": 1})
    raise ValueError(fmt)


def open_grid(fmt: str, path: Path, variables=VARIABLES, **kwargs):
    """The source reading what :func:`write_grid` wrote."""
    if fmt in ("netcdf", "zarr"):
        return XarrayFields(path, variables, sample_dim="sample", **kwargs)
    layout = {"hdf5-groups": "groups", "hdf5-files": "files"}.get(fmt, "stacked")
    return HDF5Fields(path, variables, layout=layout, **kwargs)


def write_meshes(directory: Path, count: int = 3) -> list[Path]:
    """Prepared surface meshes of different sizes (with cells); return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        mesh = point_cloud(300 + 70 * i, kind="surface", seed=i)
        paths.append(prepare_mesh(directory / f"mesh{i}.h5", mesh.points, mesh.fields, mesh.cells))
    return paths
