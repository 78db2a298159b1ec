"""Scans along a dim: cumsum, cumprod, logcumsumexp, cummax, cummin.

Along an unsharded dim they are local. Along a sharded dim every shard scans
its own piece, then adds what precedes it: the running value at the end of
each earlier shard. One slice per shard moves (an all-gather of the last
slices, 1/n of the data along the dim), and each rank folds the slices of the
shards before it into its own scan. Shards may be uneven or empty (an empty
shard contributes the identity).

``cumsum`` is linear, so a pending sum stays pending; the others reduce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...rule_kit import bind_args, normalize_dim, resolve_partial, wrap
from ._common import gather_shards, last_slice, mesh_dims_of, resolve_nonlinear_partial, shard_index

aten = torch.ops.aten


@dataclass(frozen=True)
class _Scan:
    identity: float
    fold: Callable  # reduce the earlier shards' totals along d (keepdim)
    merge: Callable  # combine the fold with the local scan
    linear: bool = False


_SCANS = {
    aten.cumsum.default: _Scan(0, lambda t, d: t.sum(d, keepdim=True), torch.add, linear=True),
    aten.cumprod.default: _Scan(1, lambda t, d: t.prod(d, keepdim=True), torch.mul),
    aten.logcumsumexp.default: _Scan(float("-inf"), lambda t, d: torch.logsumexp(t, d, keepdim=True), torch.logaddexp),
}


def _scan(func, args, kwargs):
    scan = _SCANS[func]
    b = bind_args(func, args, kwargs)
    x = b.pop("self")
    local, spec = resolve_nonlinear_partial(x) if scan.linear else resolve_partial(x)
    d = normalize_dim(b.pop("dim"), x.ndim)
    out = func(local, d, **b)
    if mesh_dims_of(spec, d):
        totals = gather_shards(last_slice(out, d, scan.identity), d, spec)
        out = scan.merge(out, scan.fold(totals.narrow(d, 0, shard_index(spec, d)), d))
    return wrap(out, spec)


def _wins(func):
    """Whether a new value replaces the running one (torch's rule: ties and NaN take the later)."""
    if func == aten.cummax.default:
        return lambda new, old: (new >= old) | torch.isnan(new)
    return lambda new, old: (new <= old) | torch.isnan(new)


def _cummaxmin(func, args, kwargs):
    b = bind_args(func, args, kwargs)
    x = b["self"]
    local, spec = resolve_partial(x)
    d = normalize_dim(b["dim"], x.ndim)
    values, indices = func(local, d)
    if not mesh_dims_of(spec, d):
        return wrap(values, spec), wrap(indices, spec)
    indices = indices + spec.local_offsets()[d]
    last_v = gather_shards(last_slice(values, d, 0), d, spec)
    last_i = gather_shards(last_slice(indices, d, 0), d, spec)
    wins = _wins(func)
    earlier = [j for j in range(shard_index(spec, d)) if spec.dim_sizes[d][j] > 0]
    if earlier:
        run_v, run_i = last_v.select(d, earlier[0]).unsqueeze(d), last_i.select(d, earlier[0]).unsqueeze(d)
        for j in earlier[1:]:
            v, i = last_v.narrow(d, j, 1), last_i.narrow(d, j, 1)
            take = wins(v, run_v)
            run_v, run_i = torch.where(take, v, run_v), torch.where(take, i, run_i)
        mine = wins(values, run_v)
        values, indices = torch.where(mine, values, run_v), torch.where(mine, indices, run_i)
    return wrap(values, spec), wrap(indices, spec)


RULES = {
    **{op: _scan for op in _SCANS},
    aten.cummax.default: _cummaxmin,
    aten.cummin.default: _cummaxmin,
}
