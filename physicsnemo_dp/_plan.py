"""Redistribution planning: which collective moves which mesh dim, in what order.

Pure functions over layouts (see :mod:`physicsnemo_dp._layout`); nothing here
touches a tensor. :mod:`physicsnemo_dp._redistribute` executes the steps.

A plan runs in four phases, chosen so that nested sharding stays in DTensor's
order (lower mesh dim = outer split) and so that no byte moves twice:

1. **Unshard** mesh dims whose tensor dim changes layout, innermost first:
   ``gather`` (all-gather-v) to Replicate, or ``pad`` (no communication) when
   the target is Partial — a zero-padded shard *is* a pending sum.
2. **Exchange** with a single all-to-all where a mesh dim moves its shard from
   one tensor dim to another (``Shard(a) -> Shard(b)``), or changes the sizes of
   its shards (``rebalance``): each element travels once, straight to its owner.
3. **Reduce** pending Partial mesh dims: ``reduce_scatter`` straight into the
   target shard when possible, otherwise ``all_reduce``.
4. **Shard** mesh dims that become Shard from Replicate, outermost first:
   ``slice`` (no communication); ``partition`` for Replicate -> Partial.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from . import _layout
from .split import chunk_sizes


@dataclass(frozen=True)
class Layout:
    placements: tuple
    dim_sizes: tuple


@dataclass(frozen=True)
class Step:
    """One collective (or local) action on one mesh dim.

    ``before`` and ``after`` are the layouts around the step, so the executor
    can read every group member's sizes from them.
    """

    kind: str  # gather | pad | all_to_all | rebalance | all_reduce | reduce_scatter | slice | partition
    mesh_dim: int
    tensor_dim: int | None
    src_dim: int | None
    before: Layout
    after: Layout


# --------------------------------------------------------------------------- #
# Size-table helpers
# --------------------------------------------------------------------------- #
def marginal(table, mesh_dims: Sequence[int], mesh_shape: Sequence[int], keep: Sequence[int]):
    """Sum a size table over the mesh dims not in ``keep`` (result ordered like ``keep``)."""
    if not keep:
        return None
    extents = [mesh_shape[m] for m in mesh_dims]
    out: dict[tuple, int] = {}
    for flat, coords in enumerate(product(*(range(n) for n in extents))):
        key = tuple(c for m, c in zip(mesh_dims, coords) if m in keep)
        out[key] = out.get(key, 0) + table[flat]
    return tuple(out[k] for k in sorted(out))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def default_dst_sizes(
    src: Layout, dst_placements: Sequence[Placement], global_shape: Sequence[int], mesh_shape
):
    """Sizes the target takes when only placements are given.

    The part of a dim's sharding shared with the source keeps the source's
    sizes (so ``redistribute`` to the same placements is a no-op and uneven
    shards stay put); mesh dims that newly shard it split with the one split
    rule, nested inside what is kept.
    """
    tables = []
    for d, extent in enumerate(global_shape):
        src_dims = _layout.sharding_mesh_dims(src.placements, d)
        dst_dims = _layout.sharding_mesh_dims(dst_placements, d)
        if not dst_dims:
            tables.append(None)
            continue
        k = _common_prefix(src_dims, dst_dims)
        pieces = list(marginal(src.dim_sizes[d], src_dims, mesh_shape, src_dims[:k]) or (extent,))
        for m in dst_dims[k:]:
            pieces = [s for piece in pieces for s in chunk_sizes(piece, mesh_shape[m])]
        tables.append(tuple(pieces))
    return tuple(tables)


# --------------------------------------------------------------------------- #
# Planning
# --------------------------------------------------------------------------- #
def _kept_prefix(src: Layout, dst: Layout, d: int, mesh_shape) -> int:
    """How many of the mesh dims sharding ``d`` keep both placement and sizes."""
    src_dims = _layout.sharding_mesh_dims(src.placements, d)
    dst_dims = _layout.sharding_mesh_dims(dst.placements, d)
    k = _common_prefix(src_dims, dst_dims)
    while k > 0:
        keep = src_dims[:k]
        if marginal(src.dim_sizes[d], src_dims, mesh_shape, keep) == marginal(
            dst.dim_sizes[d], dst_dims, mesh_shape, keep
        ):
            break
        k -= 1
    return k


def plan(src: Layout, dst: Layout, mesh_shape: Sequence[int]) -> list[Step]:
    """The steps that turn layout ``src`` into ``dst`` (empty when equal)."""
    mesh_shape = tuple(mesh_shape)
    ndim = len(src.dim_sizes)
    steps: list[Step] = []
    cur = Layout(tuple(src.placements), tuple(src.dim_sizes))

    def emit(kind, m, d, new_placement, new_table_for=None, src_dim=None):
        nonlocal cur
        placements = list(cur.placements)
        placements[m] = new_placement
        sizes = cur.dim_sizes
        for dim, table in (new_table_for or {}).items():
            sizes = _layout.replace_dim_sizes(sizes, dim, table)
        after = Layout(tuple(placements), sizes)
        steps.append(Step(kind, m, d, src_dim, cur, after))
        cur = after

    def table_without(d: int, m: int):
        dims = _layout.sharding_mesh_dims(cur.placements, d)
        return marginal(cur.dim_sizes[d], dims, mesh_shape, [x for x in dims if x != m])

    kept = {d: _kept_prefix(src, dst, d, mesh_shape) for d in range(ndim)}

    # Which mesh dims can exchange with one all-to-all (single-level shardings only).
    exchange: dict[int, tuple[str, int, int]] = {}
    for m, p in enumerate(src.placements):
        q = dst.placements[m]
        if not (issubclass(type(p), Shard) and issubclass(type(q), Shard)):
            continue
        a, b = p.dim, q.dim
        if _layout.sharding_mesh_dims(src.placements, a) != (m,) or _layout.sharding_mesh_dims(dst.placements, b) != (m,):
            continue
        if a != b and not _layout.sharding_mesh_dims(src.placements, b) and not _layout.sharding_mesh_dims(dst.placements, a):
            exchange[m] = ("all_to_all", a, b)
        elif a == b and kept[a] == 0:
            exchange[m] = ("rebalance", a, a)

    # Phase 1: unshard, innermost mesh dim first.
    for m in reversed(range(len(mesh_shape))):
        p = cur.placements[m]
        if not issubclass(type(p), Shard) or m in exchange:
            continue
        d = p.dim
        src_dims = _layout.sharding_mesh_dims(src.placements, d)
        if m in src_dims[: kept[d]]:
            continue
        target = dst.placements[m]
        kind = "pad" if issubclass(type(target), Partial) else "gather"
        emit(kind, m, d, target if kind == "pad" else Replicate(), {d: table_without(d, m)})

    # Phase 2: one all-to-all per exchanging mesh dim.
    for m, (kind, a, b) in sorted(exchange.items()):
        emit(kind, m, b, Shard(b), {a: None, b: dst.dim_sizes[b]} if a != b else {b: dst.dim_sizes[b]}, src_dim=a)

    # Phase 3: resolve pending reductions.
    for m, p in enumerate(cur.placements):
        if not issubclass(type(p), Partial):
            continue
        q = dst.placements[m]
        if q == p:
            continue
        if (
            issubclass(type(q), Shard)
            and not _layout.sharding_mesh_dims(cur.placements, q.dim)
            and _layout.sharding_mesh_dims(dst.placements, q.dim) == (m,)
        ):
            emit("reduce_scatter", m, q.dim, q, {q.dim: dst.dim_sizes[q.dim]})
        else:
            emit("all_reduce", m, None, Replicate())

    # Phase 4: shard / partition, outermost mesh dim first.
    for m, q in enumerate(dst.placements):
        p = cur.placements[m]
        if p == q:
            continue
        if issubclass(type(q), Shard):
            d = q.dim
            dst_dims = _layout.sharding_mesh_dims(dst.placements, d)
            have = _layout.sharding_mesh_dims(cur.placements, d)
            keep = [x for x in dst_dims if x in have or x == m]
            table = marginal(dst.dim_sizes[d], dst_dims, mesh_shape, keep)
            emit("slice", m, d, q, {d: table})
        elif issubclass(type(q), Partial):
            emit("partition", m, None, q)
        else:  # pragma: no cover - every other target was handled above
            raise AssertionError(f"unplanned transition {p} -> {q} on mesh dim {m}")

    if cur.placements != tuple(dst.placements) or cur.dim_sizes != tuple(dst.dim_sizes):
        raise AssertionError(f"redistribution plan ended at {cur}, expected {dst}")
    return steps
