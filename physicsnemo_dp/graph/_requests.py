"""Request-based row exchange: the ghost plan shared by graphs and by reads with any sharded index.

A *row plan* says, for a list of global row ids this rank wants from a tensor
whose dim 0 is sharded over one mesh dim, where each id lives: a row of this
rank's shard, or a *ghost* (a distinct remote row, fetched once however often
it is asked for). Making it costs one all-gather of a short row of ints per
rank (the ghost counts, plus a status so a bad id on one rank raises on every
rank) and **one all-to-all of the distinct remote ids** to their owners, which
keep them as the rows they send. Using it costs **one all-to-all of exactly the
ghost rows** (:func:`fetch_rows`); its backward sends the ghost rows' summed
gradients to their owners in one all-to-all and adds them there
(:func:`return_grads`). Nothing of the global row count is ever held.

:func:`~physicsnemo_dp.graph.build_graph` plans its sources with it. Reads
with any sharded integer index ShardTensor use it through :class:`RequestRead`:
``x[idx]``, ``index_select(x, 0, idx)`` and ``embedding(idx, weight)`` row by
row, ``gather(x, 0, idx)`` / ``take_along_dim(x, idx, 0)`` element by element
(``x`` read as a row-sharded vector; an index broadcast along its rows, as
torch_scatter's ``index.view(-1, 1).expand_as(src)``, is planned by rows
instead). The plan is cached on the index tensor (checked against its version
counter, so editing the index in place makes a new plan); a broadcast index's
plan on its storage, which the view made anew every step shares. The writes
of :mod:`._scatter` use the same plans in the other direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import _mesh_order, collectives
from .._torch_compat import Function, graph_constant, traced
from ..rule_kit import shard_tensor_cls, to_layout, wrap

__all__ = [
    "RowPlan",
    "plan_rows",
    "fetch_rows",
    "return_grads",
    "RequestRead",
    "request_read",
    "requestable",
    "gatherable",
    "plan_for",
    "broadcast_rows",
    "table",
]


@dataclass(frozen=True)
class RowPlan:
    """Where the requested rows live. ``slot[k]``: row of request ``k`` in ``[local rows | ghost rows]``."""

    mesh: object
    mesh_dim: int
    num_local: int  # rows of this rank's shard
    slot: torch.Tensor
    ghost_ids: torch.Tensor  # sorted distinct remote ids (grouped by owner, owners ascending)
    ghost_counts: tuple  # ghosts from each coordinate of mesh_dim
    send_rows: torch.Tensor  # local rows this rank sends, peers' requests back to back
    send_counts: tuple  # rows sent to each coordinate

    @property
    def num_ghosts(self) -> int:
        return sum(self.ghost_counts)


def group_rows(mesh, mesh_dim: int) -> list[int]:
    """Positions, in ``gather_ints`` order, of the ranks of this rank's group along ``mesh_dim``."""
    shape = tuple(mesh.shape)
    coord = list(mesh.get_coordinate())
    out = []
    for k in range(shape[mesh_dim]):
        c = coord.copy()
        c[mesh_dim] = k
        flat = 0
        for extent, i in zip(shape, c):
            flat = flat * extent + i
        out.append(flat)
    return out


def plan_rows(ids: torch.Tensor, sizes, mesh, mesh_dim: int, *, head=(), check=None) -> RowPlan:
    """Plan fetching rows ``ids`` (1-D int64, global ids in range) of a dim sharded as ``sizes`` (collective).

    ``head`` (ints, the same count on every rank) travels in front of the ghost
    counts in the one all-gather; ``check(rows)`` sees every rank's ``head``
    before anything else moves and may raise (then it raises on every rank).
    """
    group = mesh.size(mesh_dim)
    me = _mesh_order.coordinate(mesh, mesh_dim)
    ends = torch.tensor(tuple(sizes), dtype=torch.int64, device=ids.device).cumsum(0)
    n_local = int(sizes[me])
    offset = int(ends[me]) - n_local
    is_local = (ids >= offset) & (ids < offset + n_local)
    ghost_ids = torch.unique(ids[~is_local])  # sorted: grouped by owner, owners ascending
    ghost_counts = torch.bincount(torch.searchsorted(ends, ghost_ids, right=True), minlength=group).tolist()
    slot = torch.where(is_local, ids - offset, n_local + torch.searchsorted(ghost_ids, ids))
    rows = collectives.gather_ints([*head, *ghost_counts], mesh)
    if check is not None:
        check(rows)
    h = len(head)
    send_counts = [rows[r][h + me] for r in group_rows(mesh, mesh_dim)]
    requested = collectives.all_to_all_v(ghost_ids, ghost_counts, send_counts, mesh, mesh_dim)
    return RowPlan(
        mesh, mesh_dim, n_local, slot, ghost_ids, tuple(ghost_counts), requested - offset, tuple(send_counts)
    )


def table(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A plan's index table ``t`` for an op on ``like``: ``t`` itself, or while torch.compile traces ``like``
    (a fake or functional stand-in) the same values as a constant of the traced graph, one per graph however
    often it is read (the tables are never written to)."""
    return graph_constant(t, like, shared=True) if traced(like) else t


def fetch_rows(plan: RowPlan, x_local: torch.Tensor) -> torch.Tensor:
    """The requested rows ``(len(ids), ...)`` of the sharded tensor whose local shard is ``x_local``."""
    send = x_local.index_select(0, table(plan.send_rows, x_local))
    ghosts = collectives.all_to_all_v(send, plan.send_counts, plan.ghost_counts, plan.mesh, plan.mesh_dim)
    return torch.cat([x_local, ghosts]).index_select(0, table(plan.slot, x_local))


def return_grads(plan: RowPlan, grad_rows: torch.Tensor, exchange: bool = True) -> torch.Tensor:
    """Local shard's gradient of :func:`fetch_rows` from the requested rows' gradient.

    Gradients of repeated ids are summed first, the ghost sums go to their
    owners in one all-to-all. ``exchange=False`` keeps only the local rows'
    part (when every rank of the group holds the same requests and the same
    gradient, each owner already has its own rows' share).
    """
    n = plan.num_local
    rest = tuple(grad_rows.shape[1:])
    if not exchange:
        keep = plan.slot < n
        return grad_rows.new_zeros((n, *rest)).index_add_(0, plan.slot[keep], grad_rows[keep])
    slots = grad_rows.new_zeros((n + plan.num_ghosts, *rest)).index_add_(0, table(plan.slot, grad_rows), grad_rows)
    back = collectives.all_to_all_v(slots[n:], plan.ghost_counts, plan.send_counts, plan.mesh, plan.mesh_dim)
    return slots[:n].index_add_(0, table(plan.send_rows, grad_rows), back)


# --------------------------------------------------------------------------- #
# reads with any sharded index
# --------------------------------------------------------------------------- #
_CACHE = "_pdp_row_plans"


def requestable(x, index) -> int | None:
    """The mesh dim sharding ``x``'s rows if ``x[index]`` takes the request path, else None.

    ``x``: dim 0 sharded over exactly one mesh dim, Replicate elsewhere;
    ``index``: an integer ShardTensor on the same mesh, sharded (any dims) over
    at least one mesh dim and Replicate elsewhere. From metadata only.
    """
    ShardTensor = shard_tensor_cls()
    if not isinstance(x, ShardTensor) or not isinstance(index, ShardTensor) or x.ndim == 0:
        return None
    xs, ix = x._spec, index._spec
    if xs.mesh != ix.mesh or ix.tensor_meta.dtype not in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    ):
        return None
    dims = [m for m, p in enumerate(xs.placements) if p == Shard(0)]
    if len(dims) != 1 or any(not issubclass(type(p), Replicate) for m, p in enumerate(xs.placements) if m != dims[0]):
        return None
    if any(issubclass(type(p), Partial) for p in ix.placements) or not any(issubclass(type(p), Shard) for p in ix.placements):
        return None
    if traced(index._local_tensor):
        return None
    return dims[0]


def _numel(shape) -> int:
    n = 1
    for k in shape:
        n *= k
    return n


def _element_offsets(x_spec, index) -> torch.Tensor:
    """``gather``: per local index entry, its position in a row of ``x`` (``x``'s trailing dims, row-major)."""
    local = index._local_tensor
    offsets = index._spec.local_offsets()
    trailing = tuple(x_spec.global_shape[1:])
    col = torch.zeros(local.shape, dtype=torch.int64, device=local.device)
    stride = 1
    for d in reversed(range(1, local.ndim)):
        shape = [1] * local.ndim
        shape[d] = local.shape[d]
        col += ((torch.arange(local.shape[d], device=local.device) + offsets[d]) * stride).reshape(shape)
        stride *= trailing[d - 1]
    return col.reshape(-1)


def broadcast_rows(x_spec, index) -> bool:
    """Whether element reads/writes with ``index`` are whole rows: ``index.view(-1, 1).expand_as(src)``.

    The index has ``x``'s trailing shape, is sharded along dim 0 only and its
    local tensor repeats one id along every other dim (stride 0, as ``expand``
    leaves it): ``gather(x, 0, index)`` is then ``x[index[:, 0]]`` and
    ``scatter_add(0, index, src)`` is ``index_add(0, index[:, 0], src)``.
    Local metadata only: every rank's answer travels in the plan's all-gather.
    """
    local = index._local_tensor
    if local.ndim < 2 or tuple(index.shape[1:]) != tuple(x_spec.global_shape[1:]):
        return False
    if any(p.is_shard() and p.dim != 0 for p in index._spec.placements):
        return False
    return all(local.stride(d) == 0 or local.shape[d] <= 1 for d in range(1, local.ndim))


def _storage_cache(local) -> dict:
    """Plans kept on the index's storage: views made again every step (``expand_as``) find them."""
    storage = local.untyped_storage()
    cache = getattr(storage, _CACHE, None)
    if cache is None:
        cache = {}
        setattr(storage, _CACHE, cache)
    if len(cache) > 16:  # many views of one buffer: keep the newest
        cache.pop(next(iter(cache)))
    return cache


def plan_for(x_spec, index, mesh_dim: int, allow_negative: bool, op: str) -> tuple[RowPlan, bool]:
    """The cached plan of ``index`` for ``x_spec``'s rows (made, collectively, if missing or stale).

    Returns ``(plan, rows)``. ``op`` in ``("gather", "scatter")`` plans single
    elements: ``x`` is read as a row-sharded vector of ``N * prod(trailing)``
    entries, and entry ``(i, j...)`` of the index asks for element
    ``index[i, j...] * prod(trailing) + flat(j...)``; except where every rank's
    index broadcasts whole rows (:func:`broadcast_rows`): then ``rows`` is True
    and the plan is of the rows ``index[:, 0, ...]``, kept on the index's
    storage (a new ``expand_as`` view every step still finds it). Other plans
    are kept on the index tensor; both are checked against the version counter.
    """
    elements = op in ("gather", "scatter")
    want_rows = elements and broadcast_rows(x_spec, index)
    local = index._local_tensor
    width = _numel(x_spec.global_shape[1:]) if elements else 1
    if want_rows:
        cache = _storage_cache(local)
        key = (
            mesh_dim,
            tuple(x_spec.dim_sizes[0]),
            allow_negative,
            "rows",
            local.storage_offset(),
            local.shape[0],
            local.stride(0),
            index._spec.placements,
            index._spec.dim_sizes[0],
        )
        version = local._version
    else:
        cache = index.__dict__.setdefault(_CACHE, {})
        key = (mesh_dim, tuple(x_spec.dim_sizes[0]), allow_negative, elements)
        version = index._version
    hit = cache.get(key)
    if hit is not None and hit[0] is x_spec.mesh and hit[1] == version:
        return hit[2], hit[3]
    if want_rows:  # planned by elements before because another rank's index was no broadcast view
        hit = index.__dict__.get(_CACHE, {}).get((mesh_dim, tuple(x_spec.dim_sizes[0]), allow_negative, elements))
        if hit is not None and hit[0] is x_spec.mesh and hit[1] == index._version:
            return hit[2], hit[3]
    size = x_spec.global_shape[0]
    lo = -size if allow_negative else 0

    def attempt(rows_mode):
        if rows_mode:
            ids = local[(slice(None),) + (0,) * (local.ndim - 1)] if local.shape[0] else local.reshape(-1)[:0]
            ids = ids.reshape(-1).to(torch.int64)
        else:
            ids = local.reshape(-1).to(torch.int64)
        status = [0, 0, int(rows_mode)]
        if ids.numel():
            vmin, vmax = int(ids.min()), int(ids.max())
            if vmin < lo or vmax >= size:
                status = [1, vmin if vmin < lo else vmax, int(rows_mode)]
        if status[0]:
            ids = ids[:0]  # plan nothing here; every rank raises below
        elif allow_negative:
            ids = torch.where(ids < 0, ids + size, ids)
        if elements and not rows_mode and not status[0]:
            ids = ids * width + _element_offsets(x_spec, index)
        sizes = tuple(s * (1 if rows_mode else width) for s in x_spec.dim_sizes[0])
        seen = []

        def check(rows):
            for rank, row in enumerate(rows):
                if row[0]:
                    raise IndexError(
                        f"{op}: index {row[1]} (on rank {rank}) is out of bounds for dim 0 with size {size} "
                        f"(valid: [{lo}, {size - 1}])"
                    )
            seen.extend(row[2] for row in rows)

        plan = plan_rows(ids, sizes, x_spec.mesh, mesh_dim, head=status, check=check)
        return plan, seen

    plan, seen = attempt(want_rows)
    rows = all(seen)
    if any(seen) and not rows:  # some rank's index is not a broadcast view: every rank plans elements again
        plan, _ = attempt(False)
        cache = index.__dict__.setdefault(_CACHE, {})
        key, version = (mesh_dim, tuple(x_spec.dim_sizes[0]), allow_negative, elements), index._version
    cache[key] = (x_spec.mesh, version, plan, rows)  # one entry per layout and kind of read
    return plan, rows


def _out_spec(x_spec, index, elements: bool):
    ix = index._spec
    rest = () if elements else tuple(x_spec.global_shape[1:])
    return type(x_spec).from_sizes(
        x_spec.mesh,
        tuple(p if issubclass(type(p), Shard) else Replicate() for p in ix.placements),
        tuple(ix.global_shape) + rest,
        x_spec.tensor_meta.dtype,
        tuple(ix.dim_sizes) + (None,) * len(rest),
    )


def gatherable(x, dim, index) -> bool:
    """Whether ``gather(x, dim, index)`` / ``take_along_dim`` takes the request path (metadata only)."""
    if not isinstance(dim, int) or requestable(x, index) is None or index.ndim != x.ndim:
        return False
    return dim % x.ndim == 0 and all(i <= k for i, k in zip(index.shape[1:], x.shape[1:]))


def request_read(x, index, allow_negative: bool = True, op: str = "indexing"):
    """``x[index]`` along dim 0 by request (no autograd): laid out like ``index``; also returns the plan.

    ``op == "gather"``: ``torch.gather(x, 0, index)`` (element by element).
    """
    mesh_dim = requestable(x, index)
    elements = op == "gather"
    plan, whole_rows = plan_for(x._spec, index, mesh_dim, allow_negative, op)
    local = x._local_tensor.reshape(-1) if elements and not whole_rows else x._local_tensor
    rows = fetch_rows(plan, local)
    if whole_rows:  # rows (k, *trailing) are the index's local shape already
        rows = rows.reshape(-1)
    out = rows.reshape(tuple(index._local_tensor.shape) + tuple(rows.shape[1:]))
    return wrap(out, _out_spec(x._spec, index, elements)), plan


def _grad_spec(x_spec, index, mesh_dim: int):
    """``x``'s gradient layout: a pending sum over the mesh dims where only the index is sharded."""
    from ..rules.indexing._common import grad_spec_for

    pending = {m for m, p in enumerate(index._spec.placements) if issubclass(type(p), Shard) and m != mesh_dim}
    return grad_spec_for(x_spec, pending)


class RequestRead(Function):
    """Differentiable :func:`request_read`; rows equal to ``padding_idx`` (embedding) get no gradient.

    Every collective of the backward is the plan's: one all-to-all of the
    ghost rows' summed gradients (none where the index is replicated over the
    rows' mesh dim: each owner then already holds its rows' share).
    """

    @staticmethod
    def forward(x, index, allow_negative, op, padding_idx):
        return request_read(x, index, allow_negative, op)[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, index, allow_negative, op, padding_idx = inputs
        mesh_dim = requestable(x, index)
        ctx.plan, ctx.rows = plan_for(x._spec, index, mesh_dim, allow_negative, op)  # the cached plan of forward
        ctx.exchange = issubclass(type(index._spec.placements[mesh_dim]), Shard)
        ctx.out_spec = output._spec
        ctx.elements = op == "gather"
        ctx.grad_spec = _grad_spec(x._spec, index, mesh_dim)
        ctx.pad = None
        if padding_idx is not None:
            ctx.pad = index._local_tensor.reshape(-1) == padding_idx % x.shape[0]

    @staticmethod
    def backward(ctx, grad):
        local = to_layout(grad, ctx.out_spec, implicit=False)
        if ctx.elements:
            flat = local.reshape((-1, *ctx.grad_spec.global_shape[1:])) if ctx.rows else local.reshape(-1)
            g = return_grads(ctx.plan, flat, ctx.exchange).reshape(ctx.grad_spec.local_shape)
            return wrap(g, ctx.grad_spec), None, None, None, None
        rows = local.reshape((-1, *ctx.grad_spec.global_shape[1:]))
        if ctx.pad is not None:
            rows = torch.where(ctx.pad.reshape((-1,) + (1,) * (rows.ndim - 1)), 0, rows)
        return wrap(return_grads(ctx.plan, rows, ctx.exchange), ctx.grad_spec), None, None, None, None
