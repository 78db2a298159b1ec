"""Pure shape arithmetic of uneven layouts (no tensors, no communication).

A *layout* says which rank holds which box of a global tensor. It is the
pair ``(placements, dim_sizes)``:

* ``placements`` — one ``Shard(d)`` / ``Replicate()`` / ``Partial()`` per mesh dim,
  exactly as in DTensor;
* ``dim_sizes`` — one entry per tensor dim: ``None`` when no mesh dim shards it,
  otherwise a flat tuple with the extent each shard has along that dim. The
  tuple is indexed by the rank's coordinates on the mesh dims that shard the
  tensor dim (ascending mesh-dim order, row-major).

Why this representation: a rank's extent along tensor dim ``d`` can only depend
on its coordinates along the mesh dims that shard ``d``; anything else would not
be a decomposition of one global tensor. Storing exactly that table is
compact (a few ints per mesh dim in the usual case), lets every rank compute
every other rank's box without communicating, and covers nested sharding
(``(Shard(0), Shard(0))`` on a 2-D mesh) the way DTensor orders it: the lower
mesh dim splits first, so shard order along ``d`` is lexicographic in those
coordinates.

Everything here is plain Python over int tuples so it is cheap, hashable,
testable without processes and invisible to ``torch.compile``.
"""

from __future__ import annotations

from itertools import product
from math import prod
from typing import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .errors import PlacementError
from .split import chunk_sizes

DimSizes = tuple  # tuple[tuple[int, ...] | None, ...]


# --------------------------------------------------------------------------- #
# Placements
# --------------------------------------------------------------------------- #
#: One ``Shard(d)`` object per dim: specs built from these compare their placements by identity first
#: (tuple ``==`` tries ``is`` before ``__eq__``), and torch's placements compare and hash in C++ through
#: pybind, ~1 us a call, which a hot path pays several times per op.
_SHARDS: dict[int, Shard] = {}
_REPLICATE = Replicate()


def interned(p: Placement) -> Placement:
    """The shared instance of ``Shard(d)`` / ``Replicate()`` that specs hold (``p`` itself for others)."""
    if type(p) is Shard and p.dim >= 0:
        return _shard(p.dim)
    return _REPLICATE if type(p) is Replicate else p


def _shard(d: int) -> Shard:
    s = _SHARDS.get(d)
    if s is None:
        s = _SHARDS[d] = Shard(d)
    return s


def normalize_placements(
    placements: Sequence[Placement], mesh_ndim: int, tensor_ndim: int
) -> tuple[Placement, ...]:
    """Validate placements and make shard dims non-negative.

    Raises ``ValueError`` naming the offending placement and the fix; the check
    only reads metadata that is identical on every rank, so every rank raises.
    """
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"placements has {len(placements)} entries but the device mesh has "
            f"{mesh_ndim} dims; give exactly one placement per mesh dim"
        )
    out = []
    for mesh_dim, p in enumerate(placements):
        if type(p) is Shard:
            d = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= d < tensor_ndim:
                raise PlacementError(
                    f"placements[{mesh_dim}] = Shard({p.dim}) is out of range for a "
                    f"{tensor_ndim}-d tensor; use a dim in [-{tensor_ndim}, {tensor_ndim - 1}]"
                )
            out.append(_shard(d))
        elif issubclass(type(p), Replicate) or type(p) is Partial:
            if type(p) is Partial and p.reduce_op not in ("sum", "avg", "max", "min"):
                raise PlacementError(
                    f"placements[{mesh_dim}] = {p!r}: only Partial reduce ops "
                    "'sum', 'avg', 'max' and 'min' are supported"
                )
            out.append(_REPLICATE if type(p) is Replicate else p)
        else:
            raise PlacementError(
                f"placements[{mesh_dim}] = {p!r} is not supported by ShardTensor; "
                "use Shard(dim), Replicate() or Partial()"
            )
    return tuple(out)


def sharding_mesh_dims(placements: Sequence[Placement], tensor_dim: int) -> tuple[int, ...]:
    """Mesh dims that shard ``tensor_dim``, in the order they split it."""
    return tuple(m for m, p in enumerate(placements) if issubclass(type(p), Shard) and p.dim == tensor_dim)


def is_sharded(placements: Sequence[Placement]) -> bool:
    return any(issubclass(type(p), Shard) for p in placements)


# --------------------------------------------------------------------------- #
# Size tables
# --------------------------------------------------------------------------- #
def _ravel(coords: Sequence[int], extents: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coords, extents):
        index = index * n + c
    return index


def table_index(mesh_shape: Sequence[int], mesh_dims: Sequence[int], coord: Sequence[int]) -> int:
    """Position of the rank at ``coord`` in the size table of a tensor dim."""
    return _ravel([coord[m] for m in mesh_dims], [mesh_shape[m] for m in mesh_dims])


def chunk_dim_sizes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> DimSizes:
    """Size tables that the one split rule gives (``torch.chunk``, nested in mesh-dim order)."""
    tables = []
    for d, extent in enumerate(global_shape):
        mesh_dims = sharding_mesh_dims(placements, d)
        if not mesh_dims:
            tables.append(None)
            continue
        pieces = [extent]
        for m in mesh_dims:
            pieces = [s for piece in pieces for s in chunk_sizes(piece, mesh_shape[m])]
        tables.append(tuple(pieces))
    return tuple(tables)


def global_shape_of(
    local_like_shape: Sequence[int], placements: Sequence[Placement], dim_sizes: DimSizes
) -> tuple[int, ...]:
    """Global shape given any rank's local shape and the size tables."""
    return tuple(
        extent if dim_sizes[d] is None else sum(dim_sizes[d])
        for d, extent in enumerate(local_like_shape)
    )


def local_shape_of(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    dim_sizes: DimSizes,
    coord: Sequence[int],
) -> tuple[int, ...]:
    """Shape of the local tensor held by the rank at mesh coordinate ``coord``."""
    out = []
    for d, extent in enumerate(global_shape):
        table = dim_sizes[d]
        if table is None:
            out.append(extent)
        else:
            out.append(table[table_index(mesh_shape, sharding_mesh_dims(placements, d), coord)])
    return tuple(out)


def local_offset_of(
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    dim_sizes: DimSizes,
    coord: Sequence[int],
    tensor_dim: int,
) -> int:
    """Global index where the local box of ``coord`` starts along ``tensor_dim``."""
    table = dim_sizes[tensor_dim]
    if table is None:
        return 0
    idx = table_index(mesh_shape, sharding_mesh_dims(placements, tensor_dim), coord)
    return sum(table[:idx])


def group_sizes(
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    dim_sizes: DimSizes,
    coord: Sequence[int],
    mesh_dim: int,
    tensor_dim: int,
) -> tuple[int, ...]:
    """Extents along ``tensor_dim`` of the ranks that differ from ``coord`` only in ``mesh_dim``."""
    table = dim_sizes[tensor_dim]
    mesh_dims = sharding_mesh_dims(placements, tensor_dim)
    out = []
    for i in range(mesh_shape[mesh_dim]):
        c = list(coord)
        c[mesh_dim] = i
        out.append(table[table_index(mesh_shape, mesh_dims, c)])
    return tuple(out)


def validate_dim_sizes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    dim_sizes: DimSizes,
) -> None:
    """Check that the tables match the placements; raise ``ValueError`` otherwise."""
    if len(dim_sizes) != len(global_shape):
        raise PlacementError(
            f"size tables cover {len(dim_sizes)} dims but the tensor has {len(global_shape)}"
        )
    for d, table in enumerate(dim_sizes):
        mesh_dims = sharding_mesh_dims(placements, d)
        expected = prod(mesh_shape[m] for m in mesh_dims) if mesh_dims else 0
        if not mesh_dims:
            if table is not None:
                raise PlacementError(f"tensor dim {d} is not sharded but has a size table {table}")
            continue
        if table is None or len(table) != expected:
            raise PlacementError(
                f"tensor dim {d} is sharded over mesh dims {mesh_dims} and needs {expected} "
                f"shard sizes, got {table}"
            )
        if any((not isinstance(s, int)) or s < 0 for s in table):
            raise PlacementError(f"shard sizes along tensor dim {d} must be ints >= 0, got {table}")


def all_coords(mesh_shape: Sequence[int]):
    """Every mesh coordinate in row-major order (the order of ``mesh.mesh.flatten()``)."""
    return product(*(range(n) for n in mesh_shape))


def dim_sizes_from_local_shapes(
    local_shapes: Sequence[Sequence[int]],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> DimSizes:
    """Build (and validate) size tables from every rank's local shape.

    ``local_shapes`` is indexed like ``all_coords(mesh_shape)``. Raises
    ``ValueError`` if the shapes cannot be concatenated into one tensor
    according to the placements — the message names the ranks involved.
    """
    coords = list(all_coords(mesh_shape))
    ndims = {len(s) for s in local_shapes}
    if len(ndims) != 1:
        detail = ", ".join(f"mesh position {c}: {tuple(s)}" for c, s in zip(coords, local_shapes))
        raise PlacementError(f"local tensors have different numbers of dims ({detail}); all ranks must pass tensors of the same rank")
    ndim = ndims.pop()
    tables = []
    for d in range(ndim):
        mesh_dims = sharding_mesh_dims(placements, d)
        values: dict[int, int] = {}
        for c, shape in zip(coords, local_shapes):
            key = table_index(mesh_shape, mesh_dims, c) if mesh_dims else 0
            if values.setdefault(key, shape[d]) != shape[d]:
                what = (
                    f"ranks at the same position along mesh dims {mesh_dims}"
                    if mesh_dims
                    else "ranks (this dim is not sharded)"
                )
                raise PlacementError(
                    f"local tensors disagree on the size of dim {d}: {what} hold "
                    f"{values[key]} and {shape[d]} (mesh position {c}); local shapes must "
                    "differ only along the sharded dims of their own mesh dim"
                )
        tables.append(tuple(values[k] for k in sorted(values)) if mesh_dims else None)
    return tuple(tables)


def shapes_along_mesh_dim(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    dim_sizes: DimSizes,
    coord: Sequence[int],
    mesh_dim: int,
) -> tuple[tuple[int, ...], ...]:
    """Local shapes of the ranks along ``mesh_dim`` that share ``coord`` elsewhere."""
    out = []
    for i in range(mesh_shape[mesh_dim]):
        c = list(coord)
        c[mesh_dim] = i
        out.append(local_shape_of(global_shape, mesh_shape, placements, dim_sizes, c))
    return tuple(out)


def replace_dim_sizes(dim_sizes: DimSizes, tensor_dim: int, table) -> DimSizes:
    """Copy of ``dim_sizes`` with one tensor dim's table replaced."""
    out = list(dim_sizes)
    out[tensor_dim] = None if table is None else tuple(table)
    return tuple(out)
