"""Which index box of a sample each rank of the domain mesh reads.

:class:`DomainDecomposition` is pure arithmetic over ints: no tensors, no
files, no communication. Every rank builds the same object from the same
arguments and so knows every other rank's box, which is what lets the pipe
build ShardTensors from explicit shapes without asking the other ranks.

The split rule is the one of ShardTensor (:func:`physicsnemo_dp.split.chunk_sizes`,
i.e. ``torch.chunk``): mesh dim ``m`` splits array dim ``split_dims[m]`` into
``mesh_shape[m]`` pieces. Because the rule is shared, the shapes predicted here
are exactly the shapes ``ShardTensor`` records. Explicit ``sizes`` replace the
rule along a mesh dim (load balancing, or the point ranges of a mesh).

A *halo* of width ``h`` along a mesh dim widens a rank's read box by ``h``
cells on both sides, clipped at the global boundary (no periodic wrap). The
halo must come from the immediate neighbour, as in a halo exchange, so a halo
wider than a neighbour's shard is an error rather than a silent read from two
ranks away.

Each mesh dim splits a different array dim. Splitting one array dim over two
mesh dims gives nothing a 1-D mesh of the product size does not, and a
``sharding_shapes`` dict cannot describe it, so it is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping, Sequence

from physicsnemo_dp import Shard
from physicsnemo_dp.split import chunk_sizes, offsets_from_sizes

from .errors import DecompositionError

__all__ = ["DomainDecomposition", "balanced_sizes"]

Coord = tuple[int, ...]


def balanced_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Split ``total`` into ``parts`` sizes that differ by at most one (larger first).

    Unlike the chunk rule (10 over 4 gives 3, 3, 3, 1) this gives 3, 3, 2, 2;
    the mesh reader uses it so every rank gets a near-equal share of points.
    """
    if parts < 1 or total < 0:
        raise ValueError(f"need parts >= 1 and total >= 0, got total={total}, parts={parts}")
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


@dataclass(frozen=True)
class DomainDecomposition:
    """Each domain rank's index box of an array of ``global_shape``.

    Args:
        global_shape: shape of one sample's array (no batch dim).
        mesh_shape: shape of the domain mesh: an int, a tuple, or a
            ``DeviceMesh`` (only its shape is kept).
        split_dims: the array dim each mesh dim splits (default: the leading
            ``len(mesh_shape)`` dims). Negative dims count from the end.
        halo: extra cells read on each side of a rank's box, one int for
            every mesh dim or one per mesh dim.
        sizes: explicit shard sizes, one entry per mesh dim (``None`` keeps the
            split rule there) or a ``{mesh_dim: sizes}`` dict. After
            construction this holds the resolved sizes of every mesh dim.
        label: what the array is (e.g. ``"'pressure' in data.h5"``), used in
            error messages.

    Coordinates are tuples with one entry per mesh dim (``mesh.get_coordinate()``
    of the domain mesh); a flat int rank in row-major mesh order works too.
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    split_dims: tuple[int, ...] | None = None
    halo: int | tuple[int, ...] = 0
    sizes: Sequence[Sequence[int] | None] | Mapping[int, Sequence[int]] | None = None
    label: str = "array"

    def __post_init__(self) -> None:
        shape = tuple(int(n) for n in self.global_shape)
        mesh_shape = _mesh_shape(self.mesh_shape)
        split_dims = self._normalize_split_dims(shape, mesh_shape)
        halo = self._normalize_halo(mesh_shape)
        for name, value in (("global_shape", shape), ("mesh_shape", mesh_shape),
                            ("split_dims", split_dims), ("halo", halo)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "sizes", self._resolve_sizes())
        self._check_halo()

    # ----------------------------------------------------------- normalize
    def _where(self) -> str:
        return f"{self.label} (global shape {tuple(self.global_shape)}, domain mesh {_mesh_shape(self.mesh_shape)})"

    def _normalize_split_dims(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        dims = tuple(range(len(mesh_shape))) if self.split_dims is None else tuple(self.split_dims)
        if len(dims) != len(mesh_shape):
            raise DecompositionError(
                f"{self._where()}: split_dims={dims} needs one array dim per mesh dim ({len(mesh_shape)})"
            )
        out = []
        for d in dims:
            if not -len(shape) <= d < len(shape):
                raise DecompositionError(f"{self._where()}: split dim {d} is out of range")
            out.append(d % len(shape))
        if len(set(out)) != len(out):
            raise DecompositionError(
                f"{self._where()}: split_dims={dims} splits one array dim over several mesh dims; "
                "use a 1-D domain mesh of their product size instead"
            )
        return tuple(out)

    def _normalize_halo(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        halo = (self.halo,) * len(mesh_shape) if isinstance(self.halo, int) else tuple(self.halo)
        if len(halo) != len(mesh_shape) or any(int(h) < 0 for h in halo):
            raise DecompositionError(
                f"{self._where()}: halo={self.halo!r} must be an int >= 0 or one per mesh dim"
            )
        return tuple(int(h) for h in halo)

    def _resolve_sizes(self) -> tuple[tuple[int, ...], ...]:
        given = self.sizes
        if given is None:
            given = {}
        elif not isinstance(given, Mapping):
            if len(given) != len(self.mesh_shape):
                raise DecompositionError(
                    f"{self._where()}: sizes needs one entry per mesh dim, got {len(given)}"
                )
            given = dict(enumerate(given))
        out = []
        for m, (parts, d) in enumerate(zip(self.mesh_shape, self.split_dims)):
            extent = self.global_shape[d]
            explicit = given.get(m)
            if explicit is None:
                if extent < parts:
                    raise DecompositionError(
                        f"{self._where()}: dim {d} has {extent} cells, fewer than the {parts} ranks "
                        f"of mesh dim {m} that split it; use a smaller domain mesh, split a larger "
                        "dim, or pass explicit sizes"
                    )
                out.append(chunk_sizes(extent, parts))
                continue
            table = tuple(int(s) for s in explicit)
            if len(table) != parts or any(s < 0 for s in table) or sum(table) != extent:
                raise DecompositionError(
                    f"{self._where()}: sizes {tuple(explicit)} for mesh dim {m} must be {parts} "
                    f"ints >= 0 adding up to {extent} (the extent of dim {d})"
                )
            out.append(table)
        return tuple(out)

    def _check_halo(self) -> None:
        for m, (h, table, d) in enumerate(zip(self.halo, self.sizes, self.split_dims)):
            offsets = offsets_from_sizes(table)
            extent = self.global_shape[d]
            for i, (start, size) in enumerate(zip(offsets, table)):
                needs = ((i - 1, min(h, start)), (i + 1, min(h, extent - start - size)))
                for neighbour, width in needs:
                    if width and width > table[neighbour]:
                        raise DecompositionError(
                            f"{self._where()}: a halo of {h} along dim {d} is wider than the shard "
                            f"of rank {neighbour} along mesh dim {m} ({table[neighbour]} cells; "
                            f"shard sizes {table}); use a smaller halo or fewer ranks"
                        )

    # ---------------------------------------------------------------- query
    @property
    def num_ranks(self) -> int:
        return prod(self.mesh_shape)

    def coordinate(self, rank: int | Sequence[int]) -> Coord:
        """Mesh coordinate of a flat rank (row-major), or the coordinate itself, checked."""
        if isinstance(rank, int):
            if not 0 <= rank < self.num_ranks:
                raise IndexError(f"rank {rank} is outside a domain mesh of {self.num_ranks} ranks")
            coord = []
            for n in reversed(self.mesh_shape):
                rank, c = divmod(rank, n)
                coord.append(c)
            return tuple(reversed(coord))
        coord = tuple(int(c) for c in rank)
        if len(coord) != len(self.mesh_shape) or not all(0 <= c < n for c, n in zip(coord, self.mesh_shape)):
            raise IndexError(f"coordinate {coord} is outside the domain mesh {self.mesh_shape}")
        return coord

    def coordinates(self) -> list[Coord]:
        """Every coordinate, in flat-rank order."""
        return [self.coordinate(r) for r in range(self.num_ranks)]

    def _extent(self, coord: Coord, m: int) -> tuple[int, int]:
        """``(offset, size)`` of the interior along the array dim mesh dim ``m`` splits."""
        table = self.sizes[m]
        return offsets_from_sizes(table)[coord[m]], table[coord[m]]

    def offsets(self, rank: int | Sequence[int]) -> tuple[int, ...]:
        """Global start of the rank's interior along every array dim."""
        coord = self.coordinate(rank)
        out = [0] * len(self.global_shape)
        for m, d in enumerate(self.split_dims):
            out[d] = self._extent(coord, m)[0]
        return tuple(out)

    def halo_widths(self, rank: int | Sequence[int]) -> tuple[tuple[int, int], ...]:
        """``(before, after)`` halo cells along every array dim, clipped at the boundary."""
        coord = self.coordinate(rank)
        out = [(0, 0)] * len(self.global_shape)
        for m, d in enumerate(self.split_dims):
            start, size = self._extent(coord, m)
            h = self.halo[m]
            out[d] = (min(h, start), min(h, self.global_shape[d] - start - size))
        return tuple(out)

    def box(self, rank: int | Sequence[int], halo: bool = False) -> tuple[slice, ...]:
        """The rank's index box as slices into the global array (with its halo if asked)."""
        coord = self.coordinate(rank)
        box = [slice(0, n) for n in self.global_shape]
        widths = self.halo_widths(coord) if halo else ((0, 0),) * len(self.global_shape)
        for m, d in enumerate(self.split_dims):
            start, size = self._extent(coord, m)
            before, after = widths[d]
            box[d] = slice(start - before, start + size + after)
        return tuple(box)

    def local_shape(self, rank: int | Sequence[int], halo: bool = False) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.box(rank, halo))

    def interior(self, rank: int | Sequence[int]) -> tuple[slice, ...]:
        """Where the interior sits inside the halo-padded local array."""
        widths = self.halo_widths(rank)
        shape = self.local_shape(rank)
        return tuple(slice(before, before + n) for (before, _), n in zip(widths, shape))

    def sharding_shapes(self, rank: int | Sequence[int], leading: Sequence[int] = ()) -> dict[int, list[tuple[int, ...]]]:
        """``sharding_shapes`` for ``ShardTensor.from_local`` (interior shapes).

        ``leading`` dims (e.g. the local batch size) are prepended to every
        shape; the ShardTensor's placements are then :meth:`placements` with
        ``len(leading)``.
        """
        coord = self.coordinate(rank)
        out = {}
        for m in range(len(self.mesh_shape)):
            shapes = []
            for i in range(self.mesh_shape[m]):
                other = coord[:m] + (i,) + coord[m + 1 :]
                shapes.append((*leading, *self.local_shape(other)))
            out[m] = shapes
        return out

    def placements(self, leading_dims: int = 0) -> tuple[Shard, ...]:
        """One ``Shard`` per mesh dim; ``leading_dims`` shifts them past a batch dim."""
        return tuple(Shard(leading_dims + d) for d in self.split_dims)


def _mesh_shape(mesh) -> tuple[int, ...]:
    if isinstance(mesh, int):
        mesh = (mesh,)
    elif hasattr(mesh, "get_coordinate"):  # a DeviceMesh
        mesh = tuple(mesh.shape)
    shape = tuple(int(n) for n in mesh)
    if not shape or any(n < 1 for n in shape):
        raise DecompositionError(f"mesh shape {mesh!r} must be one or more sizes >= 1")
    return shape
