"""Request-based writes with any sharded index: contributions go to the rows' owners in one all-to-all.

``index_add``, ``scatter_add``, ``scatter_reduce`` (``sum``, ``mean``, ``amax``,
``amin``, ``prod``, ``include_self`` either way), ``index_put(accumulate=True)``
and ``scatter`` of a number (which ``scatter_reduce``'s backward uses)
along dim 0, where the index is an integer ShardTensor sharded over the mesh
dim that shards the target's rows (any tensor dims, any sizes; Replicate on
the other mesh dims) and did not come from ``build_graph`` (those are local:
:mod:`._aggregate`). The target is

* row-sharded over that mesh dim (``Shard(0)``, any sizes, empty shards too),
  Replicate elsewhere: written in its own layout;
* or Replicate there (a plain ``torch.zeros(N, F)`` promoted, ``src.new_zeros(N, F)``,
  ``torch.full(...)``): cut to this rank's ``torch.chunk`` rows (no
  communication) and written as that node-sharded tensor; an in-place write
  relabels the ShardTensor (a plain destination: :func:`plain_write`).

The plan of "which owner gets which ids" is the read plan of the same index
(:func:`._requests.plan_for`, cached on the index, version-checked): each rank
reduces its contributions to a distinct remote row (or element) into one
value, sends those to the owners in **one all-to-all** (the reverse of the
read's row exchange) and every owner reduces what it received together with
its local contributions (``mean``: sums, with the contribution counts kept on
the plan after one exchange of integers). Backward is ATen's formula for the
op evaluated on ShardTensors: its reads (``gather``, ``index_select``,
``x[idx]``) are request reads of the output gradient and its writes are this
path, so every gradient (ties of ``amax``/``amin``, zeros of ``prod``) is
torch's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from .. import collectives
from .._torch_compat import traced
from ..rule_kit import normalize_dim, shard_tensor_cls, to_layout, wrap
from ..split import chunk_sizes
from ._graph import graph_of
from ._requests import plan_for

__all__ = ["scatterable", "request_scatter", "plain_write"]

_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _mesh_dim(x, index) -> int | None:
    """The mesh dim of the rows if ``x`` and ``index`` fit the request path, else None (metadata only)."""
    ShardTensor = shard_tensor_cls()
    if not isinstance(index, ShardTensor) or not isinstance(x, ShardTensor) or x.ndim == 0:
        return None
    xs, ix = x._spec, index._spec
    if xs.mesh != ix.mesh or ix.tensor_meta.dtype not in _INTS or traced(index._local_tensor):
        return None
    if index._local_tensor.is_meta:  # simulate(): no ids to plan with; the generic rule's metadata path
        return None
    sharded = [m for m, p in enumerate(ix.placements) if p.is_shard()]
    if len(sharded) != 1 or any(p.is_partial() for p in ix.placements):
        return None
    md = sharded[0]
    for m, p in enumerate(xs.placements):
        if m == md:
            if not (p == Shard(0) or (p.is_replicate() and not x.requires_grad)):
                return None
        elif not p.is_replicate():
            return None
    return md


def _src_ok(src, index, shape) -> bool:
    """``src`` covers ``shape`` and is either plain / replicated or a ShardTensor sharded like the index."""
    ShardTensor = shard_tensor_cls()
    if not isinstance(src, torch.Tensor):
        return False
    if isinstance(src, ShardTensor):
        if src._spec.mesh != index._spec.mesh or any(p.is_partial() for p in src._spec.placements):
            return False
        if src.ndim != len(shape) or any(s < k for s, k in zip(src.shape, shape)):
            return all(p.is_replicate() for p in src._spec.placements) and _broadcasts(src.shape, shape)
        return True
    return _broadcasts(src.shape, shape) or (src.ndim == len(shape) and all(s >= k for s, k in zip(src.shape, shape)))


def _broadcasts(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def scatterable(kind: str, x, dim, index, src) -> int | None:
    """The rows' mesh dim if the write ``kind`` takes the request path, else None (metadata only).

    ``kind``: ``index_add``, ``scatter_add``, ``scatter_reduce`` or ``index_put``
    (``index`` then the one index tensor, at position 0).
    """
    if kind != "index_put" and (not isinstance(dim, int) or normalize_dim(dim, max(getattr(x, "ndim", 1), 1)) != 0):
        return None
    md = _mesh_dim(x, index)
    if md is None:
        return None
    rest = tuple(x.shape[1:])
    if kind == "index_add":
        if index.ndim != 1:
            return None
        shape = (index.shape[0], *rest)
    elif kind == "index_put":
        shape = (*index.shape, *rest)
    elif kind == "scatter":  # with a number: every position the index names takes it (no values move)
        ok = index.ndim == x.ndim and all(i <= k for i, k in zip(index.shape[1:], rest))
        return md if ok and isinstance(src, (int, float, bool)) else None
    else:
        if index.ndim != x.ndim or any(i > k for i, k in zip(index.shape[1:], rest)):
            return None
        shape = tuple(index.shape)
    return md if _src_ok(src, index, shape) else None


def _target(x, md: int, in_place: bool):
    """Local rows of the written tensor and their spec (a replicated ``x`` cut to its ``torch.chunk`` rows)."""
    spec = x._spec
    local = x._local_tensor
    if spec.placements[md].is_replicate():
        sizes = chunk_sizes(spec.global_shape[0], spec.mesh.size(md))
        placements = tuple(Shard(0) if m == md else p for m, p in enumerate(spec.placements))
        spec = spec.with_layout(placements, (sizes,) + (None,) * (len(spec.global_shape) - 1))
        offset = spec.local_offsets()[0]
        local = local.narrow(0, offset, spec.local_shape[0])
        return local.clone(), spec
    if not in_place or not local.is_contiguous():
        local = local.clone(memory_format=torch.contiguous_format)
    return local, spec


def _aligned(src, index, shape, dtype) -> torch.Tensor:
    """This rank's part of ``src`` in the index's layout, cut to global ``shape`` (index shape [+ row shape])."""
    ix = index._spec
    tables = tuple(ix.dim_sizes) + (None,) * (len(shape) - index.ndim)
    placements = tuple(p if p.is_shard() else Replicate() for p in ix.placements)
    target = type(ix).from_sizes(ix.mesh, placements, shape, dtype, tables)
    offsets, local_shape = target.local_offsets(), target.local_shape
    ShardTensor = shard_tensor_cls()
    if isinstance(src, ShardTensor) and any(p.is_shard() for p in src._spec.placements):
        # the same boxes, the rows past the index's extent kept by the last shard of each sharded dim
        ext = [list(t) if t is not None else None for t in tables]
        for d, t in enumerate(ext):
            if t is not None:
                t[-1] += src.shape[d] - shape[d]
        wide = type(ix).from_sizes(
            ix.mesh, placements, tuple(src.shape), src.dtype, tuple(None if t is None else tuple(t) for t in ext)
        )
        local = to_layout(src, wide)
        return local[tuple(slice(0, k) for k in local_shape)].to(dtype)
    whole = src._local_tensor if isinstance(src, ShardTensor) else src
    if whole.ndim == len(shape) and all(s >= k for s, k in zip(whole.shape, shape)):
        whole = whole[tuple(slice(0, k) for k in shape)]
    whole = whole.broadcast_to(shape)
    return whole[tuple(slice(o, o + k) for o, k in zip(offsets, local_shape))].to(dtype)


def _expand(ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return ids.reshape((-1,) + (1,) * (like.ndim - 1)).expand_as(like)


_COUNTS = "_pdp_scatter_counts"


def _counts(plan) -> torch.Tensor:
    """Contributions landing in each local row (element) of the plan (int64; one all-to-all the first time)."""
    counts = plan.__dict__.get(_COUNTS)
    if counts is None:
        n, slot = plan.num_local, plan.slot
        ghost = slot >= n
        per_ghost = torch.bincount(slot[ghost] - n, minlength=plan.num_ghosts)
        back = collectives.all_to_all_v(per_ghost, plan.ghost_counts, plan.send_counts, plan.mesh, plan.mesh_dim)
        counts = torch.zeros(n, dtype=torch.int64, device=slot.device)
        counts.index_add_(0, slot[~ghost], torch.ones_like(slot[~ghost])).index_add_(0, plan.send_rows, back)
        object.__setattr__(plan, _COUNTS, counts)
    return counts


def reduce_into(plan, out: torch.Tensor, vals: torch.Tensor, reduce: str, include_self: bool) -> None:
    """``out.scatter_reduce_(0, ids, vals, reduce, include_self)`` for the plan's ids (global, any owner).

    ``out``: this rank's rows (``(n, ...)``, contiguous), ``vals``: one row per
    requested id. Contributions to a remote row are first reduced into one
    value per distinct ghost, sent to the owners in one all-to-all, and every
    owner reduces its local contributions together with what it received.
    """
    n, slot = plan.num_local, plan.slot
    ghost = slot >= n
    first = "sum" if reduce == "mean" else reduce
    gv = vals[ghost]
    buf = vals.new_zeros((plan.num_ghosts, *vals.shape[1:]))
    if gv.numel():
        buf.scatter_reduce_(0, _expand(slot[ghost] - n, gv), gv, first, include_self=False)
    recv = collectives.all_to_all_v(buf, plan.ghost_counts, plan.send_counts, plan.mesh, plan.mesh_dim)
    ids = torch.cat([slot[~ghost], plan.send_rows])
    src = torch.cat([vals[~ghost], recv])
    if reduce != "mean":
        out.scatter_reduce_(0, _expand(ids, src), src, reduce, include_self=include_self)
        return
    counts = _counts(plan).reshape((-1,) + (1,) * (out.ndim - 1))
    total = out.clone() if include_self else torch.where(counts > 0, torch.zeros_like(out), out)
    total.index_add_(0, ids, src)
    count = (counts + int(include_self)).clamp_min(1).to(out.dtype)
    if out.is_floating_point() or out.is_complex():
        out.copy_(total / count)
    else:
        out.copy_(torch.div(total, count, rounding_mode="floor"))


def request_scatter(
    kind: str,
    x,
    index,
    src,
    *,
    reduce: str = "sum",
    include_self: bool = True,
    alpha=1,
    in_place: bool,
    allow_negative: bool = False,
):
    """``x.<kind>(0, index, src, ...)`` by request (no autograd): the result is row-sharded over the index's mesh dim."""
    md = scatterable(kind, x, 0, index, src)
    out, spec = _target(x, md, in_place)
    rest = tuple(spec.global_shape[1:])
    if kind in ("index_add", "index_put"):
        op = "index_put" if kind == "index_put" else "index_add"
        plan, _ = plan_for(spec, index, md, allow_negative, op)
        vals = _aligned(src, index, (*index.shape, *rest), out.dtype).reshape(-1, *rest)
        if alpha != 1:
            vals = vals * alpha
        reduce_into(plan, out, vals, "sum", True)
    elif kind == "scatter":
        plan, rows = plan_for(spec, index, md, False, "scatter")
        touched = _counts(plan) > 0
        view = out if rows else out.view(-1)
        touched = touched.reshape((-1,) + (1,) * (view.ndim - 1))
        view.copy_(torch.where(touched, torch.full((), src, dtype=out.dtype, device=out.device), view))
    else:
        plan, rows = plan_for(spec, index, md, False, "scatter")
        vals = _aligned(src, index, tuple(index.shape), out.dtype)
        if rows:
            reduce_into(plan, out, vals.reshape(-1, *rest), reduce, include_self)
        else:
            flat = out.view(-1)
            reduce_into(plan, flat, vals.reshape(-1), reduce, include_self)
    if in_place:
        x._local_tensor, x._spec = out, spec
        return x
    return wrap(out, spec)


def _replicated(plain, mesh):
    from ..rules.indexing._common import as_shard

    return as_shard(plain, mesh)


# --------------------------------------------------------------------------- #
# a plain destination: torch.zeros(N, F).scatter_add_(0, index, src)
# --------------------------------------------------------------------------- #
def plain_write(kind: str, func, args, kwargs):
    """An in-place write into a plain tensor by request, or ``NotImplemented`` (then promotion handles it).

    The result is the node-sharded ShardTensor (``torch.chunk`` rows of the
    plain tensor's dim 0, or the graph's node rows for a graph's ``dst``
    index) and is what the call returns; the plain tensor itself
    receives this rank's rows of the result in its own rows (no gradient
    flows through it; every other row keeps its value).
    """
    ShardTensor = shard_tensor_cls()
    names = {
        "index_add": ("self", "dim", "index", "source", "alpha"),
        "scatter_add": ("self", "dim", "index", "src"),
        "scatter_reduce": ("self", "dim", "index", "src", "reduce", "include_self"),
        "index_put": ("self", "indices", "values", "accumulate"),
    }[kind]
    a = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            return NotImplemented
        a[k] = v
    plain = a.get("self")
    if (
        not isinstance(plain, torch.Tensor)
        or isinstance(plain, ShardTensor)
        or type(plain) not in (torch.Tensor,)
        or plain.requires_grad
        or plain.ndim == 0
    ):
        return NotImplemented
    if kind == "index_put":
        indices = a.get("indices")
        if not a.get("accumulate", False) or not isinstance(indices, (tuple, list)) or len(indices) != 1:
            return NotImplemented
        index, dim, src = indices[0], 0, a.get("values")
    else:
        index, dim = a.get("index"), a.get("dim")
        src = a.get("source", a.get("src"))
    if not isinstance(index, ShardTensor):
        return NotImplemented
    mesh = index._spec.mesh
    whole = _replicated(plain, mesh)
    md = _mesh_dim(whole, index)
    if md is None:
        return NotImplemented
    if graph_of(index) is not None:
        # a graph's dst index: its aggregation cuts the replicated target to the graph's node rows (local)
        stand_in = whole
    else:
        # the write's target: this rank's torch.chunk rows of the plain tensor (a copy: the plain tensor changes below)
        stand_in = wrap(*_target(whole, md, False))
        if scatterable(kind, stand_in, dim, index, src) is None:
            return NotImplemented
    if kind == "index_add":
        result = torch.index_add(stand_in, dim, index, src, alpha=a.get("alpha", 1))
    elif kind == "scatter_add":
        result = torch.scatter_add(stand_in, dim, index, src)
    elif kind == "scatter_reduce":
        result = torch.scatter_reduce(stand_in, dim, index, src, a["reduce"], include_self=a.get("include_self", True))
    else:
        result = torch.index_put(stand_in, (index,), src, accumulate=True)
    spec = result._spec
    with torch.no_grad():
        plain.narrow(0, spec.local_offsets()[0], spec.local_shape[0]).copy_(result._local_tensor)
    return result
