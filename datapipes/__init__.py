"""datapipes: feed ShardTensors to training, each rank reading only its own piece from disk.

A sample too large for one device must not pass through one process either.
The pieces, one module each:

* :class:`DomainDecomposition` — which index box each domain rank owns (the
  split rule of ShardTensor; halos; explicit sizes);
* sources — :class:`HDF5Fields`, :class:`XarrayFields` (netCDF, Zarr) and
  :class:`MeshSource` (meshes prepared by :func:`prepare_mesh`) read one box of
  one variable of one sample into a caller's buffer;
* :func:`prepare_mesh` — sort a mesh along a space-filling curve, in memory,
  out of core or on many ranks; :func:`read_mesh` / :class:`MeshArrays` —
  VTK, XDMF, Gmsh, Exodus (meshio), ``.npz`` and HDF5 meshes with mixed cells
  (:mod:`datapipes.mesh_formats`);
* :class:`DomainPipe` — samples over the ``"ddp"`` mesh dim, boxes over the
  domain, background reading, transforms, and ShardTensors built without
  communication; :class:`SampleOrder` is its sample order;
* :func:`compute_statistics` / :class:`Normalize` — dataset statistics,
  computed distributed, and the transform that uses them;
* :func:`check_all_ranks` — one rank's data error raised on every rank, before anyone blocks;
* :func:`write_shards` — one file per rank stitched by an HDF5 virtual dataset;
* :mod:`datapipes.synthetic` — Darcy, heat and point-cloud datasets for tests.

See ``datapipes/README.md`` for concepts, chunking advice and measured figures.
"""

from .agreement import check_all_ranks
from .decomposition import DomainDecomposition, balanced_sizes
from .errors import (ChecksumError, DataPipeError, DecompositionError, FileChangedError, InvalidValuesError,
                     MissingDataError)
from .hdf5 import HDF5Fields, aligned_chunks
from .mesh import MeshSource, prepare_mesh
from .mesh_formats import MeshArrays, read_mesh
from .pipe import Batch, DomainPipe
from .sampler import SampleOrder
from .source import GridSource, Source, Split
from .statistics import Normalize, Statistics, compute_statistics
from .writer import write_shards
from .xarray_source import XarrayFields

__all__ = [
    "Batch",
    "ChecksumError",
    "DataPipeError",
    "DecompositionError",
    "DomainDecomposition",
    "DomainPipe",
    "FileChangedError",
    "GridSource",
    "HDF5Fields",
    "InvalidValuesError",
    "MeshArrays",
    "MeshSource",
    "MissingDataError",
    "Normalize",
    "SampleOrder",
    "Source",
    "Split",
    "Statistics",
    "XarrayFields",
    "aligned_chunks",
    "balanced_sizes",
    "check_all_ranks",
    "compute_statistics",
    "prepare_mesh",
    "read_mesh",
    "write_shards",
]
