"""``ShardTensorSpec``: DTensor's spec plus the size of every shard.

DTensor derives shard sizes from the global shape with ``torch.chunk``; a
ShardTensor may instead hold any sizes (load-balanced, data-driven, empty). The
spec therefore carries the per-dim size tables of :mod:`physicsnemo_dp._layout`
so that each rank knows every other rank's box without communicating.

Shapes are kept as plain ``int`` tuples, never ``torch.Size``: under
``torch.compile`` a ``torch.Size`` stored on a subclass becomes unbacked
symbolic ints, which breaks tracing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Shard

from . import _layout
from ._meshes import canonical
from .errors import PlacementError
from ._torch_compat import DTensorSpec, TensorMeta

__all__ = ["ShardTensorSpec"]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class _Identity:
    """Cache key for a device mesh: matches that very object, and keeps it alive while cached.

    Meshes compare equal by ranks and dim names, so a mesh rebuilt over a new
    process group equals the old one; a cached spec must hold the mesh it was
    built with. Holding it also means its ``id`` cannot be reused meanwhile.
    """

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Identity) and self.obj is other.obj


@lru_cache(maxsize=4096)
def _built_spec(cls, mesh: _Identity, placements, global_shape, dtype, dim_sizes):
    """The spec :meth:`ShardTensorSpec.from_sizes` returns (normalized arguments), memoised.

    A training step builds the same few specs on every call, and building one
    (validating the tables, DTensorSpec's own bookkeeping) costs as much as a
    small op. Specs are never mutated, so tensors can share one.
    """
    mesh = mesh.obj
    _layout.validate_dim_sizes(global_shape, tuple(mesh.shape), placements, dim_sizes)
    for d, table in enumerate(dim_sizes):
        if table is not None and sum(table) != global_shape[d]:
            raise PlacementError(
                f"shard sizes {table} along dim {d} add up to {sum(table)}, "
                f"but the global size of that dim is {global_shape[d]}"
            )
    meta = TensorMeta(torch.Size(global_shape), _contiguous_stride(global_shape), dtype)
    return cls(mesh, placements, tensor_meta=meta, _dim_sizes=dim_sizes)


@dataclass(eq=False)
class ShardTensorSpec(DTensorSpec):
    """Placements, global metadata and the size of every shard of a ShardTensor.

    Build one with :meth:`from_sizes` (or :meth:`chunked` for the split rule).
    ``Partial`` placements always mean a pending reduction: the local tensor is
    this rank's additive (or max/min) contribution, never a copy of the result.
    """

    _dim_sizes: tuple = field(default=(), kw_only=True)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_sizes(
        cls,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        global_shape: Sequence[int],
        dtype: torch.dtype,
        dim_sizes: _layout.DimSizes,
    ) -> "ShardTensorSpec":
        """Spec with explicit size tables (validated; memoised, see :func:`_built_spec`)."""
        global_shape = tuple(int(s) for s in global_shape)
        placements = _layout.normalize_placements(placements, mesh.ndim, len(global_shape))
        dim_sizes = tuple(None if t is None else tuple(int(s) for s in t) for t in dim_sizes)
        return _built_spec(cls, _Identity(canonical(mesh)), placements, global_shape, dtype, dim_sizes)

    @classmethod
    def chunked(
        cls,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        global_shape: Sequence[int],
        dtype: torch.dtype,
    ) -> "ShardTensorSpec":
        """Spec whose shard sizes follow the one split rule (``torch.chunk``)."""
        global_shape = tuple(int(s) for s in global_shape)
        placements = _layout.normalize_placements(placements, mesh.ndim, len(global_shape))
        sizes = _layout.chunk_dim_sizes(global_shape, tuple(mesh.shape), placements)
        return cls.from_sizes(mesh, placements, global_shape, dtype, sizes)

    def with_layout(self, placements: Sequence[Placement], dim_sizes) -> "ShardTensorSpec":
        """Same mesh, global shape and dtype; new placements and sizes."""
        return ShardTensorSpec.from_sizes(
            self.mesh, placements, self.global_shape, self.tensor_meta.dtype, dim_sizes
        )

    # ------------------------------------------------------------- metadata
    @cached_property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor_meta.shape)

    @cached_property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @cached_property
    def coordinate(self) -> tuple[int, ...]:
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise RuntimeError("this rank is not part of the ShardTensor's device mesh")
        return tuple(coord)

    @property
    def dim_sizes(self) -> tuple:
        """Per tensor dim: ``None`` (not sharded) or the extent of every shard."""
        return self._dim_sizes

    @cached_property
    def has_partial(self) -> bool:
        """Whether a mesh dim holds a pending reduction (cached: the dispatch fast path asks on every op)."""
        return any(issubclass(type(p), Partial) for p in self.placements)

    def local_shape_at(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Local shape of the rank at mesh coordinate ``coord``."""
        return _layout.local_shape_of(
            self.global_shape, self.mesh_shape, self.placements, self._dim_sizes, coord
        )

    @cached_property
    def local_shape(self) -> torch.Size:
        """Shape of this rank's local tensor."""
        return torch.Size(self.local_shape_at(self.coordinate))

    def local_offsets(self, coord: Sequence[int] | None = None) -> tuple[int, ...]:
        """Global start index of a rank's box along every tensor dim (this rank's: computed once)."""
        if coord is None:
            return self._own_offsets
        return tuple(
            _layout.local_offset_of(self.mesh_shape, self.placements, self._dim_sizes, coord, d)
            for d in range(len(self.global_shape))
        )

    @cached_property
    def _own_offsets(self) -> tuple[int, ...]:
        """This rank's offsets: a sum over the size table (O(P)), so kept (a plain operand's slicing asks per op)."""
        return self.local_offsets(self.coordinate)

    def offsets(self, mesh_dim: int | None = None):
        """Offset of this rank's shard along the tensor dim each mesh dim shards.

        Replicate and Partial mesh dims report 0. With ``mesh_dim`` given, a
        single int; otherwise a tuple with one entry per mesh dim.
        """
        offs = self.local_offsets()

        def one(m: int) -> int:
            p = self.placements[m]
            return offs[p.dim] if issubclass(type(p), Shard) else 0

        if mesh_dim is not None:
            return one(mesh_dim)
        return tuple(one(m) for m in range(self.mesh.ndim))

    def sharding_shapes(self, mesh_dim: int | None = None):
        """Local shapes of the shards along mesh dims that shard the tensor.

        For ``mesh_dim`` given: a tuple with the local shape of each rank along
        that mesh dim (this rank's coordinates elsewhere). Otherwise a dict from
        every sharding mesh dim to that tuple.
        """
        coord = self.coordinate

        def along(m: int):
            return _layout.shapes_along_mesh_dim(
                self.global_shape, self.mesh_shape, self.placements, self._dim_sizes, coord, m
            )

        if mesh_dim is not None:
            return along(mesh_dim)
        return {m: along(m) for m, p in enumerate(self.placements) if issubclass(type(p), Shard)}

    @property
    def _sharding_shapes(self):
        return self.sharding_shapes()

    @property
    def _local_shape(self):  # the attribute name the reference API documents
        return self.local_shape

    def is_chunked(self) -> bool:
        """True when the sizes are exactly what the split rule would give (DTensor-compatible)."""
        return self._dim_sizes == _layout.chunk_dim_sizes(
            self.global_shape, self.mesh_shape, self.placements
        )

    @cached_property
    def digest(self) -> int:
        """A 63-bit digest of the layout (mesh shape, placements, global shape, shard sizes, dtype).

        Stable across processes (unlike ``hash``, which salts strings per
        process), so ranks can compare whole specs by exchanging one int; used
        by the checking mode (:func:`physicsnemo_dp.debug.checks`).
        """
        text = repr((self.mesh_shape, self.placements, self.global_shape, self._dim_sizes, str(self.tensor_meta.dtype)))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    # --------------------------------------------------------------- copies
    # A spec is never mutated, so a copy is the spec itself. torch.compile deep-copies each ShardTensor
    # input's flatten context into its guards (and keeps traced outputs' for the tangents): sharing the
    # object lets every later comparison succeed on identity (tuple equality tries ``is`` first) instead
    # of comparing mesh, placements and size tables field by field (~10 us per input and call).
    def __copy__(self) -> "ShardTensorSpec":
        return self

    def __deepcopy__(self, memo) -> "ShardTensorSpec":
        return self

    # ------------------------------------------------------ equality / hash
    def _hash_key(self):
        return (*super()._hash_key(), self._dim_sizes)

    def __hash__(self) -> int:
        return DTensorSpec.__hash__(self)

    def __eq__(self, other: object, /) -> bool:
        """Same layout on the same mesh and process groups (:mod:`._meshes`; copies made by tracing count as same)."""
        if self is other:
            return True
        if not isinstance(other, ShardTensorSpec):
            return False
        if self.mesh is not other.mesh and canonical(self.mesh) is not canonical(other.mesh):
            return False
        return DTensorSpec._check_equals(self, other) and self._dim_sizes == other._dim_sizes

    def __repr__(self) -> str:
        sizes = {d: t for d, t in enumerate(self._dim_sizes) if t is not None}
        return (
            f"ShardTensorSpec(mesh={tuple(self.mesh.shape)}{self.mesh.mesh_dim_names or ''}, "
            f"placements={self.placements}, global_shape={self.global_shape}, "
            f"shard_sizes={sizes})"
        )

    __str__ = __repr__
