"""Where a labelled contraction runs: the layout of each operand and of the result.

Every contraction here (mm, bmm, matmul, linear, einsum, and the gradients of
all of them) is an einsum: each operand dim carries a *label*, labels shared by
operands are multiplied together, labels missing from the output are summed.
That one description lets a single rule decide sharding for all of them, per
mesh dim:

* a label sharded in the operands becomes the mesh dim's *winner* (the largest
  operand sharded on that mesh dim decides, so the smaller ones are the ones
  redistributed). Operands that carry the winner are sharded on it alike
  (a replicated one is only sliced: no communication); the others are
  replicated on that mesh dim;
* a winning label that stays in the output keeps the output sharded along it;
  one that is summed makes the output a pending sum (``Partial("sum")``);
* with no sharded label, one pending sum (``Partial``) among the operands can
  stay pending, because the contraction is linear in each operand; other
  pending operands are reduced.

A dim of extent 1 whose label is larger elsewhere *broadcasts* (as torch.einsum
and matmul do); it is never sharded. Pure metadata: every rank computes the
same plan without communicating, and the same operands' metadata always give
the same plan, so plans are memoised (a training step repeats the same few).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import NamedTuple

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ... import _layout

#: ``prefer`` value for a mesh dim that must not shard any output dim.
NO_FREE = object()


@dataclass(frozen=True)
class Plan:
    """Target placements and size tables of each operand and of the output."""

    operands: tuple  # ((placements, dim_sizes), ...)
    out: tuple  # (placements, dim_sizes)


class _Operand(NamedTuple):
    """What a plan reads of an operand's spec, as a memo key.

    A plan depends on the mesh's shape, not on the mesh: keying on this rather
    than on the spec shares plans between meshes of one shape and keeps no mesh
    (and its process groups) alive in the cache.
    """

    mesh_shape: tuple
    placements: tuple
    global_shape: tuple
    dim_sizes: tuple

    @classmethod
    def of(cls, spec) -> "_Operand":
        return cls(spec.mesh_shape, spec.placements, spec.global_shape, spec.dim_sizes)


def label_extents(shapes, labels, out_labels=(), out_shape=()):
    """Global extent of every label; raises on sizes that neither match nor broadcast."""
    ext: dict = {}
    for shape, labs in zip(shapes, labels):
        for n, lab in zip(shape, labs):
            seen = ext.get(lab)
            if seen is None or seen == 1:
                ext[lab] = n
            elif n not in (1, seen):
                raise RuntimeError(
                    f"contraction: operands disagree on the size of a dim they share ({seen} vs {n}); "
                    "shared dims must have equal sizes or size 1 (broadcast)"
                )
    for n, lab in zip(out_shape, out_labels):
        ext.setdefault(lab, n)
    return ext


def is_broadcast(extent: int, label, ext: dict) -> bool:
    return extent == 1 and ext[label] != 1


def summed_labels(labels, out_labels, out_shape, ext) -> set:
    """Labels summed over: absent from the output, or kept there with extent 1 (``keepdim``)."""
    kept = {lab for lab, n in zip(out_labels, out_shape) if not is_broadcast(n, lab, ext)}
    return {lab for labs in labels for lab in labs} - kept


def plan_contraction(specs, labels, out_labels, out_shape, *, prefer=None) -> Plan:
    """Plan ``einsum(labels -> out_labels)`` over operands with layouts ``specs``.

    ``prefer`` (used for gradients) gives the wanted output sharding: a tuple
    with one entry per mesh dim, ``(label, table)`` to shard the output dim of
    that label with that size table, or :data:`NO_FREE` for an unsharded (or
    pending-sum) output on that mesh dim. The caller redistributes the result
    if the plan could not honour ``NO_FREE`` cheaply.
    """
    operands = tuple(_Operand.of(s) for s in specs)
    return _plan(operands, tuple(labels), tuple(out_labels), tuple(out_shape), prefer)


@lru_cache(maxsize=1024)
def _plan(specs, labels, out_labels, out_shape, prefer) -> Plan:
    """:func:`plan_contraction` with ``specs`` as :class:`_Operand` keys (memoised; the plan is shared, never mutated)."""
    mesh_shape = specs[0].mesh_shape
    shapes = [s.global_shape for s in specs]
    ext = label_extents(shapes, labels, out_labels, out_shape)
    summed = summed_labels(labels, out_labels, out_shape, ext)
    sizes = [prod(s) for s in shapes]
    out_size = prod(out_shape)

    def rank_key(k):  # larger operands win; ties go to the earlier one
        return (sizes[k], -k)

    wants = [None] * len(mesh_shape) if prefer is None else list(prefer)
    forced = {w[0]: w[1] for w in wants if w is not None and w is not NO_FREE and w[0] not in summed}
    choice: list = []  # per mesh dim: ("shard", label) | ("partial", k) | None
    for m, want in enumerate(wants):
        if want is not None and want is not NO_FREE and want[0] in forced:
            choice.append(("shard", want[0]))
            continue
        # Under NO_FREE an output dim may still come out sharded when gathering that
        # (smaller) output afterwards is cheaper than gathering the operand first.
        candidates = [
            k
            for k, spec in enumerate(specs)
            if _shardable(spec, labels[k], m, ext)
            and _label_on(spec, labels[k], m) not in forced
            and (want is None or _label_on(spec, labels[k], m) in summed or out_size < sizes[k])
        ]
        if candidates:
            k = max(candidates, key=rank_key)
            choice.append(("shard", _label_on(specs[k], labels[k], m)))
            continue
        pending = [k for k, spec in enumerate(specs) if _linear_partial(spec.placements[m])]
        choice.append(("partial", max(pending, key=rank_key)) if pending else None)

    tables = {}
    for lab in {c[1] for c in choice if c is not None and c[0] == "shard"}:
        mesh_dims = tuple(m for m, c in enumerate(choice) if c == ("shard", lab))
        tables[lab] = forced[lab] if lab in forced else _table_for(lab, mesh_dims, specs, labels, ext, rank_key)

    operands = tuple(_operand_layout(k, specs, labels, choice, tables, ext) for k in range(len(specs)))
    return Plan(operands, _output_layout(out_labels, specs, choice, tables, summed))


def _label_on(spec, labs, m):
    p = spec.placements[m]
    return labs[p.dim] if issubclass(type(p), Shard) else None


def _shardable(spec, labs, m, ext) -> bool:
    p = spec.placements[m]
    return issubclass(type(p), Shard) and not is_broadcast(spec.global_shape[p.dim], labs[p.dim], ext)


def _linear_partial(p) -> bool:
    return issubclass(type(p), Partial) and p.reduce_op in ("sum", "avg")


def _table_for(lab, mesh_dims, specs, labels, ext, rank_key):
    """Size table of ``lab`` over ``mesh_dims``: an operand's own if one is sharded exactly so."""
    owners = [
        k
        for k, spec in enumerate(specs)
        if lab in labels[k]
        and spec.global_shape[labels[k].index(lab)] == ext[lab]
        and _layout.sharding_mesh_dims(spec.placements, labels[k].index(lab)) == mesh_dims
    ]
    if owners:
        k = max(owners, key=rank_key)
        return specs[k].dim_sizes[labels[k].index(lab)]
    mesh_shape = specs[0].mesh_shape
    placements = [Shard(0) if m in mesh_dims else Replicate() for m in range(len(mesh_shape))]
    return _layout.chunk_dim_sizes((ext[lab],), mesh_shape, placements)[0]


def _operand_layout(k, specs, labels, choice, tables, ext):
    spec, labs = specs[k], labels[k]
    placements = []
    for m, c in enumerate(choice):
        if c is None:
            placements.append(Replicate())
        elif c[0] == "partial":
            placements.append(spec.placements[m] if c[1] == k else Replicate())
        elif c[1] in labs and not is_broadcast(spec.global_shape[labs.index(c[1])], c[1], ext):
            placements.append(Shard(labs.index(c[1])))
        else:
            placements.append(Replicate())
    dim_sizes = tuple(
        tables[lab] if any(p == Shard(d) for p in placements) else None for d, lab in enumerate(labs)
    )
    return tuple(placements), dim_sizes


def _output_layout(out_labels, specs, choice, tables, summed):
    placements = []
    for m, c in enumerate(choice):
        if c is None:
            placements.append(Replicate())
        elif c[0] == "partial":
            placements.append(specs[c[1]].placements[m])
        elif c[1] in summed:
            placements.append(Partial("sum"))
        else:
            placements.append(Shard(out_labels.index(c[1])))
    dim_sizes = tuple(
        tables[lab] if any(p == Shard(d) for p in placements) else None for d, lab in enumerate(out_labels)
    )
    return tuple(placements), dim_sizes
