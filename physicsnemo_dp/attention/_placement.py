"""Which layout an attention call runs in, decided from the inputs' specs alone.

Three layouts, by how the *sequence mesh dim* (the mesh dim that shards the
sequence dim, -2, of the queries and/or keys) splits the work:

========== ===================== ========================================================
kind       sequence sharded in   communication
========== ===================== ========================================================
local      queries only, or none none forward; dk/dv come back Partial (pending sums)
kv_sharded keys/values only      2 all-reduces of the lse (max, sum) forward, 1 of
                                 ``delta`` backward; output and dq are Partial
ring       queries and keys      key/value blocks travel the ring (P-1 hops), dk/dv
                                 accumulators travel with them backward (P-1 hops)
========== ===================== ========================================================

Every other mesh dim either shards a batch/head dim of all inputs alike (pure
data parallelism: nothing to communicate) or replicates them. Inputs are
first brought to that *canonical* layout (:func:`plan_layout`), which is free
in the common cases (already canonical, or a local slice of replicated data)
and otherwise one redistribution with explicit shard sizes: values follow
the keys' shard sizes, keys and masks follow the queries' batch sharding. Only
metadata every rank shares is read, so every rank takes the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import _layout
from .._redistribute import target_layout
from ..split import offsets_from_sizes


@dataclass(frozen=True)
class AttentionLayout:
    """Canonical input layouts, the output layout and the layouts gradients come back in."""

    kind: str  # "local", "kv_sharded" or "ring"
    seq_mesh_dim: int | None
    q: object
    k: object
    v: object
    mask: object | None
    #: how the mask splits along the sequence mesh dim: "rows" (like the queries),
    #: "cols" (like the keys; travels with the key blocks in the ring) or "none".
    mask_split: str
    out: object
    q_grad: object
    k_grad: object
    v_grad: object


def _respec(spec, placements, sizes=None):
    """``spec`` with new placements; sizes explicit or the redistribution defaults."""
    if sizes is None:
        sizes = target_layout(spec, placements).dim_sizes
    return spec.with_layout(tuple(placements), tuple(sizes))


def _sequence_mesh_dim(specs, seq: int) -> int | None:
    """The mesh dim that keeps sharding the sequence: the last one that shards it in any input."""
    shards = [m for m in range(specs[0].mesh.ndim) if any(s.placements[m] == Shard(seq) for s in specs)]
    return shards[-1] if shards else None


def _followable(q, others, d: int, groups: int) -> bool:
    """Whether keys/values can take the queries' sharding of batch/head dim ``d``."""
    n = q.global_shape[d]
    heads = d == len(q.global_shape) - 3
    return all(t.global_shape[d] in (1, n) or (heads and t.global_shape[d] * groups == n) for t in others)


def _query_layout(q, k, v, seq_m, groups: int):
    seq = len(q.global_shape) - 2
    placements = []
    for m, p in enumerate(q.placements):
        if m == seq_m:
            placements.append(p if p == Shard(seq) else Replicate())
        elif issubclass(type(p), Shard) and p.dim < seq and _followable(q, (k, v), p.dim, groups):
            placements.append(p)
        else:
            placements.append(Replicate())
    spec = _respec(q, placements)
    heads = spec.dim_sizes[seq - 1] if seq >= 1 else None
    if groups > 1 and heads is not None and any(s % groups for s in heads):
        # Key heads cannot split like these query heads: keep the heads whole.
        placements = [Replicate() if p == Shard(seq - 1) else p for p in placements]
        spec = _respec(q, placements)
    return spec


def _seq_table(spec, seq_m: int, seq: int):
    """Shard sizes of the sequence when only ``seq_m`` shards it (kept if it already does)."""
    placements = [
        Shard(seq) if m == seq_m else (Replicate() if p == Shard(seq) else p) for m, p in enumerate(spec.placements)
    ]
    return target_layout(spec, placements).dim_sizes[seq]


def _follow(t, q, seq_m, seq_table, groups: int):
    """Layout of key/value ``t``: the queries' batch/head sharding, sequence sharded by ``seq_table``."""
    seq = len(t.global_shape) - 2
    placements = [Replicate()] * t.mesh.ndim
    sizes = [None] * len(t.global_shape)
    for d in range(seq):
        table = q.dim_sizes[d]
        if table is None or t.global_shape[d] == 1:
            continue
        for m in _layout.sharding_mesh_dims(q.placements, d):
            placements[m] = Shard(d)
        sizes[d] = table if t.global_shape[d] == q.global_shape[d] else tuple(s // groups for s in table)
    if seq_table is not None:
        placements[seq_m] = Shard(seq)
        sizes[seq] = seq_table
    return _respec(t, placements, sizes)


def _mask_layout(mask, q, k, kind: str, seq_m):
    """Layout of the mask: batch dims follow the output's sharding; rows/cols split as the kind needs."""
    nd, nm = len(q.global_shape), len(mask.global_shape)
    seq, shift = nd - 2, nd - len(mask.global_shape)
    placements = [Replicate()] * q.mesh.ndim
    sizes = [None] * nm
    for e in range(nm):
        d = e + shift
        if d < seq and q.dim_sizes[d] is not None and mask.global_shape[e] == q.global_shape[d]:
            for m in _layout.sharding_mesh_dims(q.placements, d):
                placements[m] = Shard(e)
            sizes[e] = q.dim_sizes[d]
    L, S = q.global_shape[seq], k.global_shape[seq]
    rows = nm >= 2 and L > 1 and mask.global_shape[-2] == L
    cols = S > 1 and mask.global_shape[-1] == S
    split = "none"
    if kind == "local" and seq_m is not None and rows:
        split = "rows"
    elif kind == "kv_sharded" and cols:
        split = "cols"
    elif kind == "ring":
        split = "cols" if cols and mask.placements[seq_m] == Shard(nm - 1) else ("rows" if rows else "none")
    if split == "rows":
        placements[seq_m], sizes[nm - 2] = Shard(nm - 2), q.dim_sizes[seq]
    elif split == "cols":
        placements[seq_m], sizes[nm - 1] = Shard(nm - 1), k.dim_sizes[seq]
    return _respec(mask, placements, sizes), split


def _grad_spec(spec, out_placements):
    """Gradient layout of an input: Partial where the output is split but the input is not."""
    placements = [
        Partial() if issubclass(type(p), Replicate) and not issubclass(type(o), Replicate) else p
        for p, o in zip(spec.placements, out_placements)
    ]
    return spec.with_layout(placements, spec.dim_sizes)


def plan_layout(q, k, v, mask, groups: int) -> AttentionLayout:
    """Canonical layouts of ``q, k, v, mask`` (specs, Partial already resolved) and the resulting kind."""
    seq = len(q.global_shape) - 2
    seq_m = _sequence_mesh_dim((q, k, v), seq)
    qs = _query_layout(q, k, v, seq_m, groups)
    kv_src = next((t for t in (k, v) if seq_m is not None and t.placements[seq_m] == Shard(seq)), None)
    seq_table = _seq_table(kv_src, seq_m, seq) if kv_src is not None else None
    ks, vs = _follow(k, qs, seq_m, seq_table, groups), _follow(v, qs, seq_m, seq_table, groups)
    q_seq = seq_m is not None and qs.placements[seq_m] == Shard(seq)
    kind = "ring" if q_seq and kv_src is not None else ("kv_sharded" if kv_src is not None else "local")

    out_placements = [Partial() if kind == "kv_sharded" and m == seq_m else p for m, p in enumerate(qs.placements)]
    out_shape = [max(t.global_shape[d] for t in (q, k, v)) for d in range(seq)] + [q.global_shape[seq], v.global_shape[-1]]
    out_sizes = list(qs.dim_sizes[:-1]) + [None]
    out = _layout_spec(qs, out_placements, out_shape, out_sizes)
    ms, split = _mask_layout(mask, qs, ks, kind, seq_m) if mask is not None else (None, "none")
    return AttentionLayout(
        kind, seq_m, qs, ks, vs, ms, split, out, _grad_spec(qs, out_placements), _grad_spec(ks, out_placements),
        _grad_spec(vs, out_placements),
    )  # fmt: skip


def _layout_spec(like, placements, shape, sizes):
    return type(like).from_sizes(like.mesh, placements, shape, like.tensor_meta.dtype, sizes)


# --------------------------------------------------------------------------- #
# Where a rank's tokens lie along the sequence
# --------------------------------------------------------------------------- #
def sequence_ranges(spec, seq_m) -> list[tuple[int, int]]:
    """``(global offset, length)`` of the sequence tokens of every rank of the sequence mesh dim.

    A sequence not sharded by ``seq_m`` (or no sequence mesh dim) is one range
    covering everything, the same for every rank.
    """
    seq = len(spec.global_shape) - 2
    n = spec.global_shape[seq]
    if seq_m is None or spec.placements[seq_m] != Shard(seq):
        parts = spec.mesh.size(seq_m) if seq_m is not None else 1
        return [(0, n)] * parts
    sizes = _layout.group_sizes(spec.mesh_shape, spec.placements, spec.dim_sizes, spec.coordinate, seq_m, seq)
    return list(zip(offsets_from_sizes(sizes), sizes))
