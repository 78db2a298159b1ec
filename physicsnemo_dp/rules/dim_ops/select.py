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

``sort`` plans apart from execution (:func:`propagate_sort`, memoised on the
op, the input's spec and the arguments; ``propagation.plan`` serves it);
``topk`` still plans while it runs.
"""

from __future__ import annotations

import torch

from functools import lru_cache

from ..._redistribute import grad_layout
from ...propagation import OpPlan, cached, freeze, redistribution_steps
from ...rule_kit import bind_args, normalize_dim, resolve_partial, unshard_target, wrap
from ._common import gather_shards, mesh_dims_of, move, resized, with_dtype

aten = torch.ops.aten


@lru_cache(maxsize=4096)
def propagate_sort(func, args: tuple, kwargs: tuple):
    """The pure half of ``sort`` (memoised; the input as its spec): ``(OpPlan, layout sorted in, local kwargs)``.

    Along an unsharded dim the input is only resolved (pending reductions done)
    and sorted where it is; along a sharded dim it is sorted in the layout of
    ``unshard_target`` and values and indices come back to the input's.
    """
    b = bind_args(func, args, dict(kwargs))
    spec = b.pop("self")
    b["dim"] = normalize_dim(b["dim"], len(spec.global_shape))
    out = grad_layout(spec)
    inner = unshard_target(spec, (b["dim"],)) if mesh_dims_of(spec, b["dim"]) else out
    out_indices = with_dtype(out, torch.int64)
    steps = redistribution_steps(spec, inner, 0) if inner is not spec else ()
    steps += redistribution_steps(inner, out) + redistribution_steps(with_dtype(inner, torch.int64), out_indices)
    plan = OpPlan((out, out_indices), steps, (None if inner is spec else inner,))
    return plan, inner, tuple(b.items())


def _sort(func, args, kwargs):
    x = bind_args(func, args, kwargs)["self"]
    plan, inner, local_kwargs = cached(propagate_sort, func, freeze(args), tuple(sorted(kwargs.items())))
    local = move(x._local_tensor, x._spec, inner)
    values, indices = func(local, **dict(local_kwargs))
    out_values, out_indices = plan.output_specs
    return wrap(move(values, inner, out_values), out_values), wrap(move(indices, inner, out_indices), out_indices)


def _propagate_entry(func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for ``sort``."""
    return cached(propagate_sort, func, freeze(args), tuple(sorted(kwargs.items())))[0]


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

#: ``propagation.plan`` entries: ``sort`` plans apart from execution; ``topk`` still plans inline.
PROPAGATORS: dict = {aten.sort.default: _propagate_entry, aten.sort.stable: _propagate_entry}
