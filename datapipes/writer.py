"""Write ShardTensors to disk without gathering: one file per rank, stitched by a virtual dataset.

Each rank writes its local shard of every variable to ``<path>.parts/rankNNNNN.h5``.
The first rank of the mesh then writes ``<path>``: one HDF5 *virtual dataset*
per variable, mapping each rank's file into the global array. Readers (h5py,
or xarray through the netCDF engine) see ordinary datasets of the global
shape; no rank ever holds more than its own shard. Source files are referenced
by paths relative to ``<path>``, so the directory can be moved as a whole.

The rank boxes come from the ShardTensors' own layout (every rank knows every
box), so the only communication is two tiny agreements: that every part file
was written, then that the virtual file was. Every file is written under a
temporary name and renamed when complete; on any rank's failure all ranks
remove their part files and raise, leaving no partial result behind.

With Replicate mesh dims, only the replica at coordinate 0 writes.

With ``checksums=True`` part files are chunked with a Fletcher-32 checksum
per chunk (the default writes them contiguous, unprotected): reading the virtual file
through h5py, :class:`~datapipes.HDF5Fields` or netCDF verifies every chunk
a read touches (see :mod:`datapipes._checksums`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np
import torch
import torch.distributed as dist

from physicsnemo_dp import ShardTensor

from ._checksums import FILTER_OPTIONS
from ._files import atomic_path
from .hdf5 import default_chunks
from .errors import DataPipeError

__all__ = ["write_shards"]


def write_shards(path, tensors: Mapping[str, ShardTensor], *,
                 dim_names: Mapping[str, Sequence[str]] | None = None, checksums: bool = False) -> Path:
    """Write every ShardTensor of ``tensors`` into one virtual HDF5 file at ``path``.

    Collective over the tensors' (common) mesh. ``dim_names[var]`` names the
    dims of a variable for xarray (default ``<var>_dim<i>``); variables that
    share a dim name must agree on its size. ``checksums``: a Fletcher-32
    checksum per chunk of every part file, verified by readers.
    """
    path = Path(path).resolve()
    mesh = _common_mesh(tensors)
    coord = tuple(mesh.get_coordinate())
    me = int(np.ravel_multi_index(coord, tuple(mesh.shape)))
    parts = path.with_name(f"{path.name}.parts")
    part = parts / f"rank{me:05d}.h5"
    mine = {name: t for name, t in tensors.items() if _writes(t, coord)}
    error = None
    try:
        if mine:
            with atomic_path(part) as tmp, h5py.File(tmp, "w") as f:
                for name, t in mine.items():
                    local = t.to_local().detach().cpu().numpy()
                    options = {}
                    if checksums and local.ndim and local.size:
                        leading = 1 if local.ndim > 1 else 0  # (batch, *grid): one sample per chunk
                        options = {"chunks": default_chunks(local.shape, local.dtype.itemsize, leading=leading),
                                   **FILTER_OPTIONS}
                    f.create_dataset(name, data=local, **options)
                    f[name].attrs["offsets"] = t.spec.local_offsets()
    except Exception as err:
        error = err
    failed = _agree(error is not None, mesh, me)
    if not failed and me == 0:
        try:
            _write_virtual(path, parts, tensors, dim_names or {})
        except Exception as err:
            error = err
    failed = failed or _agree(error is not None, mesh, me)
    if failed:
        if mine and part.exists():
            part.unlink()
        if me == 0 and parts.is_dir() and not any(parts.iterdir()):
            parts.rmdir()
        raise DataPipeError(f"writing {path} failed on mesh rank(s) {failed}; no output was kept") from error
    return path


def _common_mesh(tensors: Mapping[str, ShardTensor]):
    if not tensors:
        raise ValueError("write_shards needs at least one tensor")
    meshes = set()
    for name, t in tensors.items():
        if not isinstance(t, ShardTensor):
            raise TypeError(f"'{name}' is a {type(t).__name__}, not a ShardTensor")
        if any(p.is_partial() for p in t.placements):
            raise DataPipeError(f"'{name}' has pending Partial reductions {t.placements}; reduce before writing")
        meshes.add(t.device_mesh)
    if len(meshes) != 1:
        raise DataPipeError("write_shards needs every tensor on one device mesh")
    return meshes.pop()


def _writes(t: ShardTensor, coord: Sequence[int]) -> bool:
    """This rank writes ``t`` unless it is a non-first replica along a Replicate mesh dim."""
    return all(c == 0 for c, p in zip(coord, t.placements) if not p.is_shard())


def _agree(failed: bool, mesh, me: int) -> list[int]:
    """Flat mesh ranks that failed, known to every rank (a one-hot sum over each mesh dim)."""
    flags = torch.zeros(mesh.size(), dtype=torch.int32, device=mesh.device_type)
    flags[me] = int(failed)
    for dim in range(mesh.ndim):
        dist.all_reduce(flags, group=mesh.get_group(dim))
    return torch.nonzero(flags.cpu()).flatten().tolist()


def _write_virtual(path: Path, parts: Path, tensors: Mapping[str, ShardTensor], dim_names) -> None:
    mesh_shape = tuple(tensors[next(iter(tensors))].device_mesh.shape)
    with atomic_path(path) as tmp, h5py.File(tmp, "w", libver="latest") as f:
        sizes: dict[str, int] = {}
        for name, t in tensors.items():
            spec = t.spec
            layout = h5py.VirtualLayout(shape=tuple(t.shape), dtype=_numpy_dtype(t.dtype))
            for coord in np.ndindex(*mesh_shape):
                shape = spec.local_shape_at(coord)
                if not _writes(t, coord) or 0 in shape:
                    continue
                rank = int(np.ravel_multi_index(coord, mesh_shape))
                box = tuple(slice(o, o + n) for o, n in zip(spec.local_offsets(coord), shape))
                source = os.path.relpath(parts / f"rank{rank:05d}.h5", path.parent)
                layout[box] = h5py.VirtualSource(source, name, shape=shape)
            dset = f.create_virtual_dataset(name, layout, fillvalue=_fill(t.dtype))
            names = tuple(dim_names.get(name, [f"{name}_dim{i}" for i in range(t.ndim)]))
            if len(names) != t.ndim:
                raise DataPipeError(f"dim_names['{name}'] = {names} needs {t.ndim} names")
            for i, dim in enumerate(names):
                if sizes.setdefault(dim, t.shape[i]) != t.shape[i]:
                    raise DataPipeError(
                        f"dim '{dim}' has size {sizes[dim]} in one variable and {t.shape[i]} in '{name}'"
                    )
                if dim not in f:
                    f[dim] = np.arange(t.shape[i])
                    f[dim].make_scale(dim)
                dset.dims[i].attach_scale(f[dim])


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


def _fill(dtype: torch.dtype):
    return np.nan if dtype.is_floating_point else 0
