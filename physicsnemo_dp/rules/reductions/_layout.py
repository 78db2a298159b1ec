"""Layout arithmetic of a reduction: which dims go, which mesh dims hold pieces of them, what comes out.

A reduction over tensor dims ``dims`` of a ShardTensor leaves every shard of
the *kept* dims where it was (a kept dim only renumbers when ``keepdim`` is
False) and turns every mesh dim that shards a *reduced* dim into one whose
ranks each hold a partial result over their own slice. Those are the only mesh
dims a reduction ever communicates over, and what moves is a reduced-size
tensor, never data. Mesh dims of size 1 hold the whole dim, so they count as
replicated.

Everything here is metadata arithmetic, identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ...rule_kit import normalize_dim


def reduced_dims(dim, ndim: int, *, empty_means_all: bool = True) -> tuple[int, ...]:
    """Sorted non-negative dims named by ``dim`` (None: all).

    An empty list means "all dims" for most reductions (``sum(x, [])``) but
    "no dim" for ``any``/``all``; ``empty_means_all`` says which.
    """
    if ndim == 0:
        return ()
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    if len(dim) == 0:
        return tuple(range(ndim)) if empty_means_all else ()
    return tuple(sorted({normalize_dim(int(d), ndim) for d in dim}))


@dataclass(frozen=True)
class Reduction:
    """A reduction of a tensor laid out as ``spec`` over ``dims``."""

    spec: object  # ShardTensorSpec of the input
    dims: tuple
    keepdim: bool

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        """Mesh dims (of size > 1) whose ranks hold different slices of a reduced dim."""
        mesh = self.spec.mesh
        return tuple(
            m
            for m, p in enumerate(self.spec.placements)
            if issubclass(type(p), Shard) and p.dim in self.dims and mesh.size(m) > 1
        )

    @property
    def count(self) -> int:
        """Number of elements each output element reduces over (global)."""
        return prod(self.spec.global_shape[d] for d in self.dims)

    def locally_empty(self) -> bool:
        """Whether this rank holds no element of some reduced dim."""
        local = self.spec.local_shape
        return any(local[d] == 0 for d in self.dims)

    def out_spec(self, dtype: torch.dtype, reduced=Replicate()):
        """Layout of the result: kept dims keep their shards, ``reduced`` on :attr:`mesh_dims`.

        ``reduced`` is ``Partial("sum")`` for results left pending, Replicate
        for combined ones. Partial placements of the input stay as they are.

        Memoised (a reduction and its layouts are immutable): a loss's ``mean`` asks for it every step.
        """
        try:
            return _out_spec(self, dtype, reduced)
        except TypeError:  # symbolic sizes under tracing: not hashable, computed
            return self._out_spec(dtype, reduced)

    def _out_spec(self, dtype: torch.dtype, reduced):
        spec = self.spec
        ndim = len(spec.global_shape)
        kept = [d for d in range(ndim) if d not in self.dims]
        new_dim = {d: (d if self.keepdim else i) for i, d in enumerate(kept)}
        placements = []
        for m, p in enumerate(spec.placements):
            if issubclass(type(p), Shard) and p.dim in self.dims:
                placements.append(reduced if m in self.mesh_dims else Replicate())
            elif issubclass(type(p), Shard):
                placements.append(Shard(new_dim[p.dim]))
            else:
                placements.append(p)
        if self.keepdim:
            shape = tuple(1 if d in self.dims else n for d, n in enumerate(spec.global_shape))
            sizes = tuple(None if d in self.dims else t for d, t in enumerate(spec.dim_sizes))
        else:
            shape = tuple(spec.global_shape[d] for d in kept)
            sizes = tuple(spec.dim_sizes[d] for d in kept)
        return type(spec).from_sizes(spec.mesh, placements, shape, dtype, sizes)

    def grad_spec(self, dtype: torch.dtype):
        """Layout in which a backward needs the output's gradient: kept shards, Replicate elsewhere (memoised)."""
        try:
            return _grad_spec(self, dtype)
        except TypeError:  # symbolic sizes under tracing: not hashable, computed
            return self._grad_spec(dtype)

    def _grad_spec(self, dtype: torch.dtype):
        out = self.out_spec(dtype)
        placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in out.placements)
        return out.with_layout(placements, out.dim_sizes)

    def with_kept_dims(self, local: torch.Tensor) -> torch.Tensor:
        """A local result in keepdim form (size 1 at reduced dims), so it broadcasts against the input."""
        if self.keepdim:
            return local
        for d in self.dims:
            local = local.unsqueeze(d)
        return local


@lru_cache(maxsize=4096)
def _out_spec(red: Reduction, dtype: torch.dtype, reduced):
    return red._out_spec(dtype, reduced)


@lru_cache(maxsize=4096)
def _grad_spec(red: Reduction, dtype: torch.dtype):
    return red._grad_spec(dtype)
