"""sort and topk along any dim; indices are always global.

* ``sort`` along a sharded dim takes the whole-dim fallback: one all-to-all
  moves the shard to another dim, the sort runs locally, and values and
  indices come back to the input's layout (one all-to-all each).
* ``topk`` along a sharded dim keeps the traffic at ``k`` per shard: each
  shard offers its own top ``min(k, n)`` candidates with global indices, an
  all-gather-v collects them, and every rank selects the top ``k``. The
  result holds the ``k`` entries whole along that dim (Replicate on the mesh
  dims that sharded it); other dims keep the input's layout.

Order among equal values (an unstable sort, ``topk`` ties) and the order of
``topk(sorted=False)`` are unspecified in torch and may differ from a
single-process run; the selected values and a stable sort are exact.
"""

from __future__ import annotations

import torch

from ...rule_kit import bind_args, normalize_dim, resolve_partial, wrap
from ._common import gather_shards, mesh_dims_of, on_whole_dims, resized

aten = torch.ops.aten


def _sort(func, args, kwargs):
    b = bind_args(func, args, kwargs)
    x = b.pop("self")
    b["dim"] = normalize_dim(b["dim"], x.ndim)
    if not mesh_dims_of(x._spec, b["dim"]):
        local, spec = resolve_partial(x)
        values, indices = func(local, **b)
        return wrap(values, spec), wrap(indices, spec)
    return on_whole_dims(x, [b["dim"]], lambda t: tuple(func(t, **b)))


def _topk(func, args, kwargs):
    b = bind_args(func, args, kwargs)
    x, k = b["self"], int(b["k"])
    d = normalize_dim(b["dim"], x.ndim)
    if not 0 <= k <= (x.shape[d] if x.ndim else 1):
        raise RuntimeError(f"topk: selected index k={k} out of range for a dim of size {x.shape[d]}")
    local, spec = resolve_partial(x)
    if not mesh_dims_of(spec, d):
        values, indices = local.topk(k, d, b["largest"], b["sorted"])
        out_spec = resized(spec, d, k, unshard=False)
        return wrap(values, out_spec), wrap(indices, out_spec)
    mine = min(k, local.shape[d])
    values, indices = local.topk(mine, d, b["largest"], True)
    indices = indices + spec.local_offsets()[d]
    extent = lambda n: min(k, n)  # noqa: E731
    values, indices = gather_shards(values, d, spec, extent), gather_shards(indices, d, spec, extent)
    values, picked = values.topk(k, d, b["largest"], b["sorted"])
    out_spec = resized(spec, d, k, unshard=True)
    return wrap(values, out_spec), wrap(indices.gather(d, picked), out_spec)


RULES = {
    aten.sort.default: _sort,
    aten.sort.stable: _sort,
    aten.topk.default: _topk,
}
