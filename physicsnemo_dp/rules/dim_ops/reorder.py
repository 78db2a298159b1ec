"""flip and roll: permutations of positions along a dim.

Along an unsharded dim they are local. Along a dim sharded by one mesh dim,
each rank's shard lands in one (flip) or two (roll, wrapping around)
contiguous ranges of the result, so a single all-to-all sends every element
straight to the rank that owns its new position: each element moves at most
once and nothing is gathered. A dim split over several mesh dims takes the
whole-dim fallback. Permutations commute with every pending reduction, so
``Partial`` stays pending.
"""

from __future__ import annotations

import torch

from ... import _layout, collectives
from ...split import offsets_from_sizes
from ...rule_kit import normalize_dim, wrap
from ._common import mesh_dims_of, on_whole_dims

aten = torch.ops.aten


def _flip_runs(i, sizes, offsets, n):
    """Rank i's shard, flipped locally, fills positions ``[n - end, n - start)`` of the result."""
    return [(0, sizes[i], n - offsets[i] - sizes[i])]


def _roll_runs(shift):
    def runs(i, sizes, offsets, n):
        start = (offsets[i] + shift) % n
        head = min(sizes[i], n - start)
        return [(0, head, start), (head, sizes[i] - head, 0)]

    return runs


def _exchange(local, spec, d, runs):
    """Send pieces of the local shard along ``d`` to the ranks owning their target positions.

    ``runs(i, sizes, offsets, n)`` lists ``(start in shard i, length, target
    position)`` for group member ``i``; every rank evaluates it for every
    member, so sends and receives agree without exchanging metadata.
    """
    (m,) = mesh_dims_of(spec, d)
    coord, group = spec.coordinate, spec.mesh.size(m)
    sizes = _layout.group_sizes(spec.mesh_shape, spec.placements, spec.dim_sizes, coord, m, d)
    offsets, n, me = offsets_from_sizes(sizes), sum(sizes), coord[m]

    def pieces(i, j):
        lo_j, hi_j = offsets[j], offsets[j] + sizes[j]
        out = []
        for src, length, dst in runs(i, sizes, offsets, n):
            lo, hi = max(dst, lo_j), min(dst + length, hi_j)
            if hi > lo:
                out.append((src + lo - dst, hi - lo, lo))
        return out

    rows = local.movedim(d, 0)
    send = torch.cat([rows[:0]] + [rows[s : s + k] for j in range(group) for s, k, _ in pieces(me, j)])
    incoming = [p for i in range(group) for p in pieces(i, me)]
    received = collectives.all_to_all_v(
        send,
        [sum(k for _, k, _ in pieces(me, j)) for j in range(group)],
        [sum(k for _, k, _ in pieces(i, me)) for i in range(group)],
        spec.mesh,
        m,
    )
    chunks = received.split([k for _, k, _ in incoming]) if incoming else []
    ordered = [c for _, c in sorted(zip((dst for _, _, dst in incoming), chunks), key=lambda t: t[0])]
    return torch.cat([received[:0]] + ordered).movedim(0, d).contiguous()


def _permute_along(local, spec, d, runs, prep, whole):
    """The permutation along sharded ``d``: ``prep`` locally then one exchange, or ``whole`` on the whole dim."""
    if len(mesh_dims_of(spec, d)) == 1:
        return _exchange(prep(local), spec, d, runs)
    return on_whole_dims(wrap(local, spec), [d], whole, keep_partial=True)._local_tensor


def _flip(func, args, kwargs):
    x, dims = args
    dims = sorted({normalize_dim(d, x.ndim) for d in dims})
    spec, local = x._spec, x._local_tensor
    whole = [d for d in dims if not mesh_dims_of(spec, d)]
    if whole:
        local = local.flip(whole)
    for d in dims:
        if mesh_dims_of(spec, d):
            flip = lambda t, d=d: t.flip(d)  # noqa: E731
            local = _permute_along(local, spec, d, _flip_runs, flip, flip)
    return wrap(local, spec)


def _roll(func, args, kwargs):
    x, shifts, *rest = args
    dims = list(rest[0]) if rest else list(kwargs.get("dims", []))
    if not dims and x.ndim == 1:
        dims = [0]
    if not dims:  # roll of the flattened tensor: whole tensor on every rank, then back
        return on_whole_dims(x, range(x.ndim), lambda t: func(t, shifts), keep_partial=True)
    if len(shifts) != len(dims):
        raise RuntimeError(f"roll: shifts ({len(shifts)}) and dims ({len(dims)}) must have the same length")
    spec, local = x._spec, x._local_tensor
    for shift, dim in zip(shifts, dims):
        d = normalize_dim(dim, x.ndim)
        if not mesh_dims_of(spec, d):
            local = local.roll(shift, d)
        elif spec.global_shape[d]:
            runs = _roll_runs(shift % spec.global_shape[d])
            local = _permute_along(local, spec, d, runs, lambda t: t, lambda t, s=shift, d=d: t.roll(s, d))
    return wrap(local, spec)


RULES = {aten.flip.default: _flip, aten.roll.default: _roll}
