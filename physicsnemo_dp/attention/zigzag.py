"""Load-balanced ("zig-zag") token order for causal attention over a sharded sequence.

With causal attention on a contiguously sharded sequence, rank ``P-1`` attends
to every block and rank 0 only to its own: the last rank does ~``2P-1`` times
the work of the first. The zig-zag order cuts the sequence into ``2P`` chunks
with the one split rule (``chunk_sizes(n, 2P)``) and gives rank ``i`` chunks
``i`` and ``2P-1-i``: every rank then holds one early and one late chunk and
does the same causal work (the ring skips the tiles that lie entirely in the
future, so the saving is real, not just balanced).

Use it in three steps::

    q = to_zigzag(q, dim=-2, mesh_dim=0)        # also k, v (and anything token-wise)
    with zigzag_causal():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = from_zigzag(out, dim=-2, mesh_dim=0)   # back to the natural order

``to_zigzag`` permutes the *global* sequence (one all-to-all moving only the
tokens that change rank); inside ``zigzag_causal()`` causal SDPA on
ShardTensors reads global position ``g`` of a sequence of length ``n`` as
original position ``zigzag_order(n, P)[g]``, where ``P`` is the size of the
mesh dim that shards the sequence (1 if none, which is the identity order).
Token-wise ops (linear layers, norms, pointwise) do not care about the order;
anything position-dependent (positional encodings) must use the same map.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from .._torch_compat import Function
from .. import _layout, _mesh_order, collectives
from .._redistribute import grad_layout
from ..rule_kit import normalize_dim, to_layout, wrap
from ..errors import PlacementError
from ..split import chunk_sizes, offsets_from_sizes
from ._blocks import Span

__all__ = ["zigzag_sizes", "zigzag_order", "zigzag_causal", "zigzag_active", "to_zigzag", "from_zigzag"]

_STATE = {"active": False}


@contextlib.contextmanager
def zigzag_causal() -> Iterator[None]:
    """Inside the block, causal SDPA on ShardTensors reads the sequence in zig-zag order.

    The previous setting returns on exit (also on errors).
    """
    previous = _STATE["active"]
    _STATE["active"] = True
    try:
        yield
    finally:
        _STATE["active"] = previous


def zigzag_active() -> bool:
    return _STATE["active"]


def _runs(n: int, parts: int) -> list[tuple[int, int]]:
    """``(original start, length)`` of the chunks in zig-zag order."""
    sizes = chunk_sizes(n, 2 * parts)
    starts = offsets_from_sizes(sizes)
    order = [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]
    return [(starts[c], sizes[c]) for c in order]


def zigzag_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Shard sizes of a length-``n`` sequence in zig-zag order over ``parts`` ranks."""
    sizes = chunk_sizes(n, 2 * parts)
    return tuple(sizes[i] + sizes[2 * parts - 1 - i] for i in range(parts))


def zigzag_order(n: int, parts: int) -> torch.Tensor:
    """Original position of each global index in zig-zag order (``x_zigzag = x.index_select(dim, order)``)."""
    return torch.cat([torch.arange(s, s + k) for s, k in _runs(n, parts)] or [torch.zeros(0, dtype=torch.long)])


def spans(offset: int, length: int, n: int, parts: int, zigzag: bool) -> tuple[Span, ...]:
    """Causal positions of global indices ``[offset, offset + length)`` of a length-``n`` sequence."""
    if not zigzag:
        return (Span(0, length, offset),)
    out, index = [], 0
    for start, size in _runs(n, parts):
        lo, hi = max(index, offset), min(index + size, offset + length)
        if hi > lo:
            out.append(Span(lo - offset, hi - lo, start + lo - index))
        index += size
    return tuple(out)


# --------------------------------------------------------------------------- #
# Moving a sharded sequence between the natural and the zig-zag order
# --------------------------------------------------------------------------- #
def _pieces(src: Sequence[Span], dst: Sequence[Span]) -> list[tuple[int, int, int]]:
    """``(source row, length, destination row)`` of the tokens two ranks' spans share, in destination order."""
    out = []
    for d in dst:
        for s in src:
            lo = max(d.position, s.position)
            hi = min(d.position + d.length, s.position + s.length)
            if hi > lo:
                out.append((s.start + lo - s.position, hi - lo, d.start + lo - d.position))
    return out


def _move(local, dim, src_spans, dst_spans, mesh, mesh_dim):
    """One all-to-all that takes this rank's tokens from the ``src_spans`` layout to ``dst_spans``."""
    me = _mesh_order.coordinate(mesh, mesh_dim)
    group = range(mesh.size(mesh_dim))
    rows = local.movedim(dim, 0)
    outgoing = [_pieces(src_spans[me], dst_spans[j]) for j in group]
    incoming = [_pieces(src_spans[r], dst_spans[me]) for r in group]
    send = torch.cat([rows.narrow(0, a, k) for pieces in outgoing for a, k, _ in pieces] or [rows[:0]])
    received = collectives.all_to_all_v(
        send, [sum(k for _, k, _ in p) for p in outgoing], [sum(k for _, k, _ in p) for p in incoming], mesh, mesh_dim
    )
    placed, at = [], 0
    for pieces in incoming:
        for _, k, b in pieces:
            placed.append((b, received.narrow(0, at, k).movedim(0, dim)))
            at += k
    placed.sort(key=lambda item: item[0])
    # concatenated along ``dim`` itself, so the one copy writes a contiguous local tensor
    return torch.cat([t for _, t in placed] or [local.narrow(dim, 0, 0)], dim=dim)


class _Reorder(Function):
    """Move tokens between two orders of the same sharded sequence; backward moves them back."""

    @staticmethod
    def forward(x, dst_spec, dim, src_spans, dst_spans, mesh_dim):
        return wrap(_move(x._local_tensor, dim, src_spans, dst_spans, x._spec.mesh, mesh_dim), dst_spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.dst_spec, ctx.dim, ctx.src_spans, ctx.dst_spans, ctx.mesh_dim = inputs
        ctx.src_spec = x._spec

    @staticmethod
    def backward(ctx, grad):
        local = to_layout(grad, grad_layout(ctx.dst_spec))
        moved = _move(local, ctx.dim, ctx.dst_spans, ctx.src_spans, ctx.src_spec.mesh, ctx.mesh_dim)
        return wrap(moved, grad_layout(ctx.src_spec)), None, None, None, None, None


def _sharded_along(x, dim: int, mesh_dim: int):
    """``x`` sharded along ``dim`` by ``mesh_dim`` alone (chunk rule if it was replicated there)."""
    placements = list(x._spec.placements)
    others = [m for m in _layout.sharding_mesh_dims(placements, dim) if m != mesh_dim]
    if others:
        raise PlacementError(
            f"dim {dim} is also sharded over mesh dims {others}; zig-zag reordering needs the "
            f"sequence sharded by mesh dim {mesh_dim} alone (redistribute first)"
        )
    if placements[mesh_dim] == Shard(dim):
        return x
    if not issubclass(type(placements[mesh_dim]), Replicate):
        raise PlacementError(
            f"mesh dim {mesh_dim} holds {placements[mesh_dim]!r}; zig-zag reordering needs it to shard "
            f"dim {dim} or replicate the tensor"
        )
    placements[mesh_dim] = Shard(dim)
    return x.redistribute(placements=placements)


def _reorder(x, dim, mesh_dim, to_zig: bool):
    dim = normalize_dim(dim, x.ndim)
    mesh_dim = mesh_dim if mesh_dim is not None else x._spec.mesh.ndim - 1
    x = _sharded_along(x, dim, mesh_dim)
    spec, n, parts = x._spec, x.shape[dim], x._spec.mesh.size(mesh_dim)
    coord = spec.coordinate
    current = _layout.group_sizes(spec.mesh_shape, spec.placements, spec.dim_sizes, coord, mesh_dim, dim)
    target = zigzag_sizes(n, parts) if to_zig else chunk_sizes(n, parts)

    def layout(sizes, zig):
        return [spans(o, k, n, parts, zig) for o, k in zip(offsets_from_sizes(sizes), sizes)]

    dst_spec = spec.with_layout(spec.placements, _layout.replace_dim_sizes(spec.dim_sizes, dim, target))
    return _Reorder.apply(x, dst_spec, dim, layout(current, not to_zig), layout(target, to_zig), mesh_dim)


def to_zigzag(x, dim: int = -2, mesh_dim: int | None = None):
    """``x`` (natural order) permuted into zig-zag order and sharded with :func:`zigzag_sizes` (differentiable).

    ``mesh_dim`` (default: the last) must shard ``dim`` or replicate ``x``.
    """
    return _reorder(x, dim, mesh_dim, to_zig=True)


def from_zigzag(x, dim: int = -2, mesh_dim: int | None = None):
    """Inverse of :func:`to_zigzag`: natural order, sharded with the one split rule."""
    return _reorder(x, dim, mesh_dim, to_zig=False)
