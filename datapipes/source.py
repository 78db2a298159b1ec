"""What the pipe needs from a data source, and the part all grid sources share.

A :class:`Source` knows where one sample's bytes live and reads a *box* of one
variable of one sample into a buffer the caller allocated. It never decides
the decomposition of a grid (the user does, through :class:`Split`) and never
allocates per read, so the pipe controls memory and the bytes counted are
exactly the bytes requested from the storage library.

The pipe's reader process is forked, so it inherits the source object.
File handles are therefore opened lazily and kept per process (see
:meth:`Source._handles`), and a process closes them before it forks
(:mod:`datapipes._fork_guard`): a child never holds an open HDF5 file of its
parent, which would corrupt HDF5's state. Sources also pickle without their
handles, for users who hand them to spawned processes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from . import _fork_guard
from .decomposition import DomainDecomposition
from .errors import DataPipeError

__all__ = ["Source", "GridSource", "Split"]

Box = tuple[slice, ...]


@dataclass(frozen=True)
class Split:
    """How to split a grid sample over the domain mesh (see :class:`DomainDecomposition`)."""

    split_dims: tuple[int, ...] | None = None
    halo: int | tuple[int, ...] = 0
    sizes: Sequence[Sequence[int] | None] | Mapping[int, Sequence[int]] | None = None


class Source(ABC):
    """Samples made of named variables, read box by box.

    Subclasses set ``variables`` and implement the abstract methods.
    """

    variables: tuple[str, ...]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def dtype(self, variable: str) -> np.dtype:
        """dtype the variable is read as."""

    @abstractmethod
    def decompose(self, index: int, mesh_shape: tuple[int, ...], split: Split) -> dict[str, DomainDecomposition]:
        """Decomposition of every variable of sample ``index`` over a domain mesh."""

    @abstractmethod
    def read(self, index: int, variable: str, box: Box, out: np.ndarray) -> int:
        """Read ``variable[box]`` of sample ``index`` into ``out``; return the bytes requested."""

    @abstractmethod
    def where(self, index: int, variable: str) -> str:
        """Where a variable of a sample lives, for error messages (file, dataset, shape)."""

    def check_files(self, indices: Sequence[int]) -> None:
        """Raise :class:`~datapipes.errors.FileChangedError` if a file of these samples changed.

        The pipe calls it after reading each batch (:func:`datapipes.prefetch.fill`),
        so a file truncated, replaced or rewritten before or during the reads
        is reported instead of its zeros or foreign values being returned
        (see :mod:`datapipes._identity`). Sources that read no files have
        nothing to check (the default).
        """

    def coords(self, box: Box) -> dict[str, np.ndarray]:
        """Coordinates of the cells in ``box`` (none unless the format stores them)."""
        return {}

    def close(self) -> None:
        """Drop this process's open handles (subclasses close them first); the next read reopens."""
        self.__dict__.pop("_handle_cache", None)
        self.__dict__.pop("_handles_pid", None)

    # ------------------------------------------------------ per-process handles
    def _handles(self) -> dict:
        """Open handles of *this* process; a forked child starts with none.

        A process closes them before it forks (:mod:`datapipes._fork_guard`),
        so a child never holds a copy of an open file either.
        """
        if getattr(self, "_handles_pid", None) != os.getpid():
            self._handles_pid = os.getpid()
            self._handle_cache = {}
            _fork_guard.track(self)
        return self._handle_cache

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_handle_cache", None)
        state.pop("_handles_pid", None)
        return state


class GridSource(Source):
    """A source whose variables share one grid shape per sample (``sample_shape``).

    Subclasses set ``variables``, ``sample_shape`` and ``_dtypes`` during
    construction, after checking every sample has that shape.
    """

    sample_shape: tuple[int, ...]
    _dtypes: dict[str, np.dtype]

    def dtype(self, variable: str) -> np.dtype:
        return self._dtypes[variable]

    def decompose(self, index: int, mesh_shape: tuple[int, ...], split: Split) -> dict[str, DomainDecomposition]:
        key = (tuple(mesh_shape), split)
        cache = self.__dict__.setdefault("_decompositions", {})
        if key not in cache:
            cache[key] = DomainDecomposition(
                self.sample_shape, mesh_shape, split.split_dims, split.halo, split.sizes, label=self._label()
            )
        return dict.fromkeys(self.variables, cache[key])

    def _label(self) -> str:
        return f"variables {list(self.variables)} of {self}"

    def _check_shape(self, shape: Sequence[int], where: str) -> None:
        """Raise naming ``where`` if a sample's shape differs from the first sample's."""
        if tuple(shape) != self.sample_shape:
            raise DataPipeError(
                f"{where} has shape {tuple(shape)}, but the first sample's variables have "
                f"{self.sample_shape}; every sample and variable of a grid source must have one shape"
            )

