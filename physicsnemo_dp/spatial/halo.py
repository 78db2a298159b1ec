"""The halo exchange: the one primitive every spatial op of this package uses.

``halo_exchange(x, {dim: (left, right)}, mode)`` returns this rank's local
tensor of ShardTensor ``x`` extended by ``left`` rows before and ``right`` rows
after its shard along each listed dim, filled from the ranks that own those
rows. Facts it guarantees (see :mod:`._halo_plan` for the arithmetic):

* **Boundary modes** ``zeros``/``constant`` (with ``value``), ``replicate``,
  ``reflect``, ``circular`` apply only at the *global* boundary of the dim;
  everywhere else the halo holds the neighbours' real data.
* **Any shard sizes.** A shard thinner than the halo is not an error: the
  window simply reads rows owned by ranks further away (each rank receives
  from whoever owns the rows it needs). Empty shards own nothing, so their
  neighbours skip them; an empty shard's own window is still the
  ``left + right`` rows around its (empty) position.
* **Minimal traffic.** One neighbour exchange per haloed dim over the mesh
  dim that shards it (:func:`collectives.neighbour_exchange`: point to point
  with only the ranks that share rows, so a call's cost does not grow with
  the group size; an ``all_to_all_v`` while torch.compile traces); the
  bytes sent are exactly the distinct real rows needed (counted under the
  collective kind ``"halo"``). Padding (fill, replicated, reflected rows) is
  made by the receiver after the exchange, so it never travels. No
  collective at all when no rank of the group needs a foreign row
  (unsharded dims, mesh dims of size 1, ``0`` widths).
* **Several dims** are exchanged one after the other in increasing dim order,
  each appending its received rows before the next, so corner rows arrive
  through the two messages (no diagonal neighbours needed).
* **Backward** is the mirror: the gradient of every halo row goes back to its
  owner (one neighbour exchange per dim, in reverse order) and is added to the
  owner's gradient, together with the gradients of locally replicated or
  reflected rows.

A haloed dim must be sharded by at most one mesh dim; pending reductions
(``Partial``) are resolved first. Ops that need windows other than
"shard plus fixed widths" (strided convolutions, interpolation) build plans
from explicit windows with :func:`plan_windows` and run :func:`gather` /
:func:`scatter_add` on local tensors inside their own autograd Functions.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from .. import _layout, collectives
from .._torch_compat import Function, graph_constant
from .._redistribute import grad_layout
from ..rule_kit import wrap
from ..errors import PlacementError
from ..split import offsets_from_sizes
from ._halo_plan import BOUNDARY_MODES, DimPlan, plan_dim

__all__ = ["halo_exchange", "plan_windows", "gather", "scatter_add", "group_sizes", "BOUNDARY_MODES"]

#: The collective kind the exchange is counted under (see ``count_collectives``).
KIND = "halo"


# --------------------------------------------------------------------------- #
# Planning from a spec
# --------------------------------------------------------------------------- #
def group_sizes(spec, dim: int) -> tuple[tuple[int, ...], int, int | None]:
    """``(sizes, me, mesh_dim)`` of the shards along ``dim`` in this rank's group.

    An unsharded dim is one shard of the full extent (``mesh_dim`` None).
    O(1) in the world size: the returned table is the spec's own.
    """
    mesh_dims = _layout.sharding_mesh_dims(spec.placements, dim)
    if not mesh_dims:
        return (spec.global_shape[dim],), 0, None
    if len(mesh_dims) > 1:
        raise PlacementError(
            f"dim {dim} is sharded over several mesh dims {mesh_dims}; a halo exchange needs it "
            "sharded by one mesh dim: redistribute it first"
        )
    # One mesh dim shards ``dim``, so its size table *is* this rank's group (indexed by
    # the coordinate along that mesh dim): no O(P) walk over the mesh to collect it.
    m = mesh_dims[0]
    return spec.dim_sizes[dim], spec.coordinate[m], m


def plan_windows(spec, windows_by_dim: Mapping[int, object], mode: str) -> tuple[DimPlan, ...]:
    """Plans for explicit windows: ``windows_by_dim[d](sizes)`` gives every shard's ``(lo, hi)``."""
    if mode not in BOUNDARY_MODES:
        raise ValueError(f"mode must be one of {BOUNDARY_MODES}, got {mode!r}")
    plans = []
    for d in sorted(windows_by_dim):
        sizes, me, m = group_sizes(spec, d)
        wins = tuple(tuple(int(v) for v in w) for w in windows_by_dim[d](sizes))
        plans.append(plan_dim(sizes, wins, me, mode, d, m))
    return tuple(plans)


def _widths_windows(left: int, right: int):
    def windows(sizes: Sequence[int]):
        return tuple((s - left, s + n + right) for s, n in zip(offsets_from_sizes(tuple(sizes)), sizes))

    return windows


# --------------------------------------------------------------------------- #
# Execution on local tensors
# --------------------------------------------------------------------------- #
def gather(local: torch.Tensor, plans: Sequence[DimPlan], mesh, value: float = 0.0) -> torch.Tensor:
    """This rank's window: ``local`` extended (or cut) along every planned dim.

    Two phases. First every dim's exchange receives its rows, a later dim's
    messages carrying the earlier dims' halo rows (the corners) and nothing
    else. Then the window is cut from the local and received rows: fill,
    replicated and reflected rows are made by the receiver, never sent.
    """
    extended, received = exchange(local, plans, mesh)
    return assemble(extended, received, plans, value)


def exchange(local: torch.Tensor, plans: Sequence[DimPlan], mesh):
    """Phase one of :func:`gather`: ``(extended, received)``.

    ``received`` holds the rows received per exchanging dim; ``extended`` is
    ``local`` with all but the last of them appended (the last dim's rows are
    never appended: the window is cut from both pieces directly, one copy).
    The received rows alone, thin slabs, are what a caller keeps to rebuild
    the window later (:func:`extend`, :func:`assemble`) instead of the window.
    """
    exchanging, received = _exchanging(plans), []
    for k, p in enumerate(exchanging):
        if k:
            local = torch.cat([local, received[-1]], exchanging[k - 1].dim)
        received.append(_exchange(local, p, mesh))
    return local, tuple(received)


def extend(local: torch.Tensor, received: Sequence[torch.Tensor], plans: Sequence[DimPlan]) -> torch.Tensor:
    """The ``extended`` of :func:`exchange` again, from its ``received`` (no communication)."""
    for p, rows in zip(_exchanging(plans), received[:-1]):
        local = torch.cat([local, rows], p.dim)
    return local


def assemble(extended: torch.Tensor, received: Sequence[torch.Tensor], plans: Sequence[DimPlan], value: float = 0.0):
    """Phase two of :func:`gather`: the window, from :func:`exchange`'s results."""
    last = _last_exchanging(plans)
    window = extended if last is None else _assemble([extended, received[-1]], last, value)
    for p in plans:
        if p is not last and not p.identity:
            window = _assemble([window], p, value)
    return window


def _exchanging(plans):
    return [p for p in plans if p.exchange]


def _last_exchanging(plans):
    exchanging = _exchanging(plans)
    return exchanging[-1] if exchanging else None


def _exchange(local, p: DimPlan, mesh):
    return post_exchange(local, p, mesh).wait()


class _Arriving:
    """Rows in flight along one dim: :meth:`wait` returns them with the dim back in place."""

    def __init__(self, posted, dim: int):
        self._posted, self._dim = posted, dim

    def wait(self) -> torch.Tensor:
        return self._posted.wait().movedim(0, self._dim)


def post_exchange(local, p: DimPlan, mesh) -> _Arriving:
    """Post one dim's exchange of :func:`exchange` (``p.exchange`` true); ``.wait()`` gives the received rows.

    The rows travel while the caller computes; it must wait before it posts
    another exchange on the same mesh dim.
    """
    d = p.dim
    send = local.index_select(d, graph_constant(p.send_index, like=local)).movedim(d, 0)
    posted = collectives.post_neighbour_exchange(send, p.send_peers, p.recv_peers, mesh, p.mesh_dim, kind=KIND)
    return _Arriving(posted, d)


def _assemble(pieces: Sequence[torch.Tensor], p: DimPlan, value) -> torch.Tensor:
    """The window along ``p.dim``: one concatenation of the plan's segments of ``pieces`` (joined along it)."""
    d, parts = p.dim, [pieces[0].narrow(p.dim, 0, 0)]  # an empty window when there are no segments
    for _, src, n in p.segments:
        if src < 0:
            shape = list(pieces[0].shape)
            shape[d] = n
            parts.append(pieces[0].new_full(shape, value))
            continue
        for piece in pieces:
            if src < piece.shape[d]:
                parts.append(piece.narrow(d, src, n))
                break
            src -= piece.shape[d]
    return parts[-1] if len(parts) == 2 else torch.cat(parts, d)


def scatter_add(grad: torch.Tensor, plans: Sequence[DimPlan], mesh, *, owned: bool = False) -> torch.Tensor:
    """Adjoint of :func:`gather`: every window row's gradient added to the row's owner.

    ``owned=True`` lets the returned gradients be added into ``grad`` in place
    (the caller made ``grad`` and does not need it): the result is then a view
    of it, not a copy.
    """
    last = _last_exchanging(plans)
    for p in reversed(plans):
        if p is not last and not p.identity:
            (grad,), (fresh,) = _disassemble(grad, p, (p.local_rows + p.received_rows,))
            owned = owned or fresh
    if last is not None:
        (local, rows), (fresh, _) = _disassemble(grad, last, (last.local_rows, last.received_rows))
        grad = send_back(local, rows, last, mesh, owned or fresh)
    for p in reversed(_exchanging(plans)[:-1]):
        grad = send_back(grad.narrow(p.dim, 0, p.local_rows), grad.narrow(p.dim, p.local_rows, p.received_rows), p, mesh, True)
    return grad


def _disassemble(grad, p: DimPlan, extents: Sequence[int]) -> tuple[list[torch.Tensor], list[bool]]:
    """Adjoint of :func:`_assemble`: the gradient of each piece, and whether it is a new tensor.

    Where one segment covers a piece its gradient is a view of ``grad`` (no copy).
    """
    d, out, fresh, offset = p.dim, [], [], 0
    for extent in extents:
        mine = [(pos, src - offset, n) for pos, src, n in p.segments if offset <= src < offset + extent]
        if len(mine) == 1 and mine[0][1:] == (0, extent):
            out.append(grad.narrow(d, mine[0][0], extent))
            fresh.append(False)
        else:
            shape = list(grad.shape)
            shape[d] = extent
            piece = grad.new_zeros(shape)
            for pos, src, n in mine:
                piece.narrow(d, src, n).add_(grad.narrow(d, pos, n))
            out.append(piece)
            fresh.append(True)
        offset += extent
    return out, fresh


def send_back(grad, rows, p: DimPlan, mesh, in_place: bool):
    """Send the received rows' gradients ``rows`` back to their owners and add them to ``grad`` there.

    The backward of one dim's exchange: ``grad`` is the gradient of the local
    rows (added into in place with ``in_place``), ``rows`` of the received
    ones, in the order they arrived.
    """
    return add_returned(grad, post_send_back(rows, p, mesh), p, in_place)


def post_send_back(rows, p: DimPlan, mesh) -> _Arriving:
    """Post the exchange of :func:`send_back` (the received rows' gradients ``rows`` to their owners)."""
    d = p.dim
    return _Arriving(collectives.post_neighbour_exchange(rows.movedim(d, 0), p.recv_peers, p.send_peers, mesh,
                                                         p.mesh_dim, kind=KIND), d)  # fmt: skip


def add_returned(grad, arriving: _Arriving, p: DimPlan, in_place: bool):
    """Wait for :func:`post_send_back`'s rows and add them to the local rows' gradient ``grad``."""
    back = arriving.wait()
    add = grad.index_add_ if in_place else grad.index_add
    return add(p.dim, graph_constant(p.send_index, like=grad), back)


# --------------------------------------------------------------------------- #
# The public, differentiable primitive
# --------------------------------------------------------------------------- #
class _HaloExchange(Function):
    """ShardTensor -> this rank's haloed local tensor; backward returns halo gradients to their owners."""

    @staticmethod
    def forward(x, plans, value):
        return gather(x._local_tensor, plans, x._spec.mesh, value)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, plans, _ = inputs
        ctx.plans, ctx.spec = plans, x._spec

    @staticmethod
    def backward(ctx, grad):
        spec = grad_layout(ctx.spec)
        return wrap(scatter_add(grad, ctx.plans, spec.mesh), spec), None, None


def halo_exchange(x, halo: Mapping[int, tuple[int, int]], mode: str = "zeros", value: float = 0.0) -> torch.Tensor:
    """This rank's local tensor of ``x`` extended by ``halo[dim] = (left, right)`` rows per dim.

    Args:
        x: a ShardTensor; each dim in ``halo`` sharded by at most one mesh dim
            (unsharded dims only get their global-boundary padding).
        halo: ``{dim: (left, right)}``, widths >= 0.
        mode: ``"zeros"``, ``"constant"`` (fill ``value``), ``"replicate"``,
            ``"reflect"`` or ``"circular"``; applied at the global boundary only.

    Returns a plain tensor (differentiable with respect to ``x``): along
    ``dim`` it covers global rows ``[start - left, end + right)`` of the
    padded global tensor, where ``[start, end)`` is this rank's shard.
    """
    for d, (left, right) in halo.items():
        if left < 0 or right < 0:
            raise ValueError(f"halo widths must be >= 0, got {(left, right)} for dim {d}")
    ndim = x.ndim
    halo = {d % ndim: w for d, w in halo.items()}
    if any(issubclass(type(p), Partial) for p in x._spec.placements):
        resolved = tuple(Replicate() if issubclass(type(p), Partial) else p for p in x._spec.placements)
        x = x.redistribute(placements=resolved)
    plans = plan_windows(x._spec, {d: _widths_windows(*w) for d, w in halo.items()}, mode)
    return _HaloExchange.apply(x, plans, value)
