"""Attention of one query block on one key/value block, and the log-sum-exp merge.

Every schedule (local, sharded keys, ring) is a sequence of *tiles*: a slice of
this rank's queries against a slice of one key/value block. A tile returns its
normalized output and the log-sum-exp (lse) of its scores per query row, which
is all that is needed to merge tiles exactly, in any order:

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Rows that see no key (everything masked, or an empty block) carry
``lse = -inf`` and a zero output, which the merge treats as "no contribution";
like PyTorch's SDPA, a row with no visible key ends as zeros.

The backward is the flash-attention recomputation: with the final ``lse`` and
``delta = rowsum(dout * out)``, a tile's probabilities ``p = exp(s - lse)``
are rebuilt and give its contributions to dq, dk, dv without ever holding more
than one tile of scores.

Tensors are *grouped*: queries ``(*B, Hk, g, L, E)`` and keys/values
``(*B, Hk, 1, S, E)`` so that grouped-query attention (``g`` query heads per
key head) and head broadcasting are plain matmul broadcasting. The plain
PyTorch ops used here run on every device and dtype; half types are computed
in float32.

Tiles without a user mask (and with equal query and value head sizes) run
on PyTorch's fused kernel for their device instead (CPU: the flash kernel;
CUDA: the memory-efficient kernel, where torch's selector accepts the
tensors), which never holds a tile of scores: a causal tile is cut into a fully visible part and a part causal
from its top-left corner, the two patterns the kernel knows. Its backward
takes the queries' final ``out`` and ``lse``, exactly the flash
recomputation above, so it needs the output to be exact on this rank (not a
share of a pending sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .._torch_compat import fused_attention, fused_attention_backward, fused_attention_fits

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Span:
    """Consecutive local tokens ``[start, start + length)`` at causal positions ``position, position + 1, ...``."""

    start: int
    length: int
    position: int


@dataclass(frozen=True)
class Tile:
    """Queries ``q_start:q_start+q_len`` against keys ``k_start:k_start+k_len`` of a block.

    ``diagonal`` is None when every key is visible to every query; otherwise
    key ``j`` is visible to query ``i`` iff ``j - i <= diagonal`` (causal
    positions relative to the tile's corners).
    """

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    diagonal: int | None = None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half types, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def plan_tiles(q_spans: Sequence[Span], k_spans: Sequence[Span], causal: bool) -> list[Tile]:
    """The tiles to compute; causal pairs that see nothing are skipped, which is where causal saves work."""
    tiles = []
    for qs in q_spans:
        for ks in k_spans:
            if qs.length == 0 or ks.length == 0:
                continue
            if not causal:
                tiles.append(Tile(qs.start, qs.length, ks.start, ks.length))
                continue
            if ks.position > qs.position + qs.length - 1:
                continue  # every key lies in every query's future
            full = ks.position + ks.length - 1 <= qs.position
            diagonal = None if full else qs.position - ks.position
            tiles.append(Tile(qs.start, qs.length, ks.start, ks.length, diagonal))
    return tiles


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` replaced by 0, to shift by without producing NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _narrow(t: torch.Tensor | None, dim: int, start: int, length: int):
    """Slice ``t`` along ``dim`` unless it broadcasts there (extent 1)."""
    if t is None or t.shape[dim] == 1:
        return t
    return t.narrow(dim, start, length)


def _scores(q, k, scale: float, mask, tile: Tile):
    """Masked, scaled scores of a tile (built in place: one tile of memory)."""
    s = torch.matmul(q, k.transpose(-1, -2).to(q.dtype)).mul_(scale)
    if mask is not None:
        s = s.masked_fill_(~mask, NEG_INF) if mask.dtype == torch.bool else s.add_(mask.to(s.dtype))
    if tile.diagonal is not None:
        rows = torch.arange(tile.q_len, device=q.device).unsqueeze(-1)
        cols = torch.arange(tile.k_len, device=q.device)
        s = s.masked_fill_(cols - rows > tile.diagonal, NEG_INF)
    return s


def _tile_inputs(q, k, v, mask, rows0: int, cols0: int, tile: Tile):
    """The tile's slices of q, k, v and the mask (whose row/col 0 are local row ``-rows0``/key ``-cols0``)."""
    qt = q.narrow(-2, tile.q_start, tile.q_len)
    kt = k.narrow(-2, tile.k_start, tile.k_len)
    vt = v.narrow(-2, tile.k_start, tile.k_len)
    mt = _narrow(mask, -2, rows0 + tile.q_start, tile.q_len)
    mt = _narrow(mt, -1, cols0 + tile.k_start, tile.k_len)
    return qt, kt, vt, mt


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_t: torch.Tensor, lse_t: torch.Tensor) -> None:
    """Merge a partial result ``(out_t, lse_t)`` into ``(out, lse)`` in place (numerically stable)."""
    new = torch.logaddexp(lse, lse_t)
    shift = _safe(new)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(out_t * torch.exp(lse_t - shift).unsqueeze(-1))
    lse.copy_(new)


def _fused(q, k, v, mask) -> bool:
    """Whether tiles can run on torch's fused kernel for their device (see the module doc).

    Meta tensors too: ``debug.simulate`` plays a CPU mesh on them and must take the CPU run's kernel (the
    kernel and its backward have meta implementations), or it counts the math path's score tiles instead.
    """
    return mask is None and q.shape[-1] == v.shape[-1] and fused_attention_fits(q, k, v, False)


def _kernel_parts(tile: Tile) -> list[tuple[Tile, bool]]:
    """``tile`` as ``(part, causal)``: parts fully visible (False) or causal from their top-left corner (True).

    With ``diagonal = d``, key ``j`` is visible to query ``i`` iff ``j <= i + d``:
    for ``d >= 0`` keys ``[0, d)`` are visible to every query and keys from
    ``d`` on are top-left causal; for ``d < 0`` queries ``[0, -d)`` see
    nothing and the rest are top-left causal.
    """
    d = tile.diagonal
    if d is None:
        return [(tile, False)]
    if d < 0:
        return [(Tile(tile.q_start - d, tile.q_len + d, tile.k_start, tile.k_len), True)] if tile.q_len > -d else []
    parts = [(Tile(tile.q_start, tile.q_len, tile.k_start, min(d, tile.k_len)), False)] if d > 0 else []
    if tile.k_len > d:
        parts.append((Tile(tile.q_start, tile.q_len, tile.k_start + d, tile.k_len - d), True))
    return parts


def _kernel_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim: the one memory layout the fused CPU kernel cannot do without.

    The kernel reads each row of ``E`` values as consecutive memory whatever
    ``t.stride(-1)`` says: a transposed, expanded (stride 0) or otherwise
    strided last dim gives garbage (errors of 1e4..1e276, or NaN), silently.
    ``F.scaled_dot_product_attention`` checks this before it picks the kernel
    (and falls back to the math path); calling the kernel directly skips
    that check, so every tensor handed to it passes here. Any other strides,
    gaps and storage offsets are read correctly, so only this case copies on
    CPU. The CUDA kernel gets contiguous tensors: its fast variants need aligned
    rows, which a tile cut from a block need not have.
    """
    if t.device.type == "cuda":
        return t.contiguous()
    return t if t.stride(-1) == 1 else t.contiguous()


def _flat(t: torch.Tensor, batch) -> torch.Tensor:
    """Grouped ``(..., n, E)`` broadcast to ``batch`` as the kernel's ``(N, 1, n, E)``, in memory it reads right."""
    return _kernel_memory(t.expand(*batch, *t.shape[-2:]).reshape(-1, 1, *t.shape[-2:]))


def attend(q, k, v, mask, rows0: int, cols0: int, tiles: Sequence[Tile], scale: float, out, lse) -> None:
    """Add the tiles of block ``(k, v)`` to the running ``(out, lse)`` of queries ``q``.

    ``q`` is in the compute dtype; ``k``, ``v`` and ``mask`` (boolean: True =
    visible, or additive) may be in any dtype and are converted per tile.
    """
    fused = _fused(q, k, v, mask)
    for tile in tiles:
        for part, causal in _kernel_parts(tile) if fused else [(tile, None)]:
            qt, kt, vt, mt = _tile_inputs(q, k, v, mask, rows0, cols0, part)
            if fused:
                batch = torch.broadcast_shapes(qt.shape[:-2], kt.shape[:-2])
                o, l = fused_attention(_flat(qt, batch), _flat(kt.to(qt.dtype), batch),
                                           _flat(vt.to(qt.dtype), batch), causal, scale)  # fmt: skip
                out_t, lse_t = o.reshape(*batch, *o.shape[-2:]), l.reshape(*batch, l.shape[-1])
            else:
                s = _scores(qt, kt, scale, mt, part)
                lse_t = torch.logsumexp(s, dim=-1)
                out_t = torch.matmul(s.sub_(_safe(lse_t).unsqueeze(-1)).exp_(), vt.to(s.dtype))
            rows = slice(part.q_start, part.q_start + part.q_len)
            merge_into(out[..., rows, :], lse[..., rows], out_t, lse_t)


def _broadcast(a: tuple, b: tuple) -> tuple:
    """Broadcast shape of two grouped shapes of equal length that broadcast (checked when the call was planned)."""
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def one_call(q, k, v, mask, tiles: Sequence[Tile]):
    """``(batch, causal)`` when block ``(k, v)`` is one fused-kernel call covering every query row and key, else None.

    That is a single tile of the whole block (no user mask, a fused kernel) that the
    kernel computes in one part: fully visible, or causal from its top-left
    corner. Then the tile's ``(out, lse)`` and gradients *are* the result:
    nothing to merge into running accumulators or to add into zeros
    (:func:`attend_whole`, :func:`attend_backward_whole`), which is exact
    (merging into ``out = 0, lse = -inf`` gives the tile's values bit for
    bit) and saves the accumulators' allocations and a dozen small ops.
    """
    if len(tiles) != 1 or not _fused(q, k, v, mask):
        return None
    parts = _kernel_parts(tiles[0])
    if len(parts) != 1:
        return None
    part, causal = parts[0]
    if (part.q_start, part.q_len, part.k_start, part.k_len) != (0, q.shape[-2], 0, k.shape[-2]):
        return None
    batch = _broadcast(q.shape[:-2], k.shape[:-2])
    if _broadcast(batch, v.shape[:-2]) != batch:  # values with more batch than q and k: the general path
        return None
    return batch, causal


def attend_whole(q, k, v, batch, causal: bool, scale: float):
    """``(out, lse)`` of queries ``q`` on the whole block ``(k, v)`` in one kernel call (see :func:`one_call`)."""
    o, l = fused_attention(_flat(q, batch), _flat(k.to(q.dtype), batch), _flat(v.to(q.dtype), batch), causal, scale)
    return o.reshape(*batch, *o.shape[-2:]).contiguous(), l.reshape(*batch, l.shape[-1]).contiguous()


def attend_backward_whole(q, k, v, batch, causal: bool, scale: float, dout, out, lse):
    """``(dq, dk, dv)`` of :func:`attend_whole`: ``dq`` laid out like ``q``, ``dk``/``dv`` contiguous in ``k``'s/``v``'s shape.

    The layouts are those :func:`attend_backward` accumulates into (``zeros_like(q)``, ``zeros(k.shape)``), so
    what follows sees the same tensors as on the general path.
    """
    rows = q.shape[-2]
    grads = fused_attention_backward(
        _flat(dout, batch), _flat(q, batch), _flat(k.to(q.dtype), batch), _flat(v.to(q.dtype), batch),
        _flat(out, batch), _kernel_memory(lse.expand(*batch, rows).reshape(-1, 1, rows)), causal, scale,
    )  # fmt: skip
    gq, gk, gv = (g.reshape(*batch, *g.shape[-2:]) for g in grads)
    gq = gq.sum_to_size(q.shape)
    dq = gq if gq.stride() == q.stride() else torch.empty_like(q).copy_(gq)
    return dq, gk.sum_to_size(k.shape).contiguous(), gv.sum_to_size(v.shape).contiguous()


def needs_delta(q, k, v, mask, out) -> bool:
    """Whether :func:`attend_backward` reads ``delta``: not when its tiles run on the fused kernel (given ``out``)."""
    return out is None or not _fused(q, k, v, mask)


class _Target:
    """Where a block's dk/dv contributions go: given tensors, tensors a callable returns when first needed, or zeros."""

    def __init__(self, into, k, v, like: torch.Tensor):
        self._into, self._k, self._v, self._like = into, k, v, like
        self._pair = None

    def get(self):
        if self._pair is None:
            into = self._into() if callable(self._into) else self._into
            if into is None:
                into = tuple(torch.zeros(t.shape, dtype=self._like.dtype, device=self._like.device)
                             for t in (self._k, self._v))  # fmt: skip
            self._pair = tuple(into)
        return self._pair


def attend_backward(q, k, v, mask, rows0: int, cols0: int, tiles: Sequence[Tile], scale: float, dout, lse, delta, dq,
                    out=None, into=None):  # fmt: skip
    """Gradient contributions of block ``(k, v)``: adds into ``dq``, returns ``(dk, dv)`` of the block.

    ``lse`` is the final log-sum-exp of the queries and ``delta`` is
    ``rowsum(dout * out)``; both cover all of ``q``'s rows. ``out``, the
    queries' final output, is given when it is exact on this rank: then CPU
    tiles may use the fused kernel. ``dk``/``dv`` come in the compute dtype
    with ``k``'s/``v``'s shape (query groups and broadcast batch dims summed).

    ``into`` receives the contributions instead of fresh zeros: a pair of
    such tensors, or a callable returning one, called when the first
    contribution is ready. The ring passes a callable that waits for the
    block's accumulator arriving from the previous rank and adds into it in
    place: the transfer overlaps with the first tile, and no second
    block-sized accumulator is needed.
    """
    target = _Target(into, k, v, dq)
    fused = out is not None and _fused(q, k, v, mask)
    dk = dv = None
    for tile in tiles:
        for part, causal in _kernel_parts(tile) if fused else [(tile, None)]:
            qt, kt, vt, mt = _tile_inputs(q, k, v, mask, rows0, cols0, part)
            rows = slice(part.q_start, part.q_start + part.q_len)
            if fused:
                batch = torch.broadcast_shapes(qt.shape[:-2], kt.shape[:-2])
                grads = fused_attention_backward(
                    _flat(dout[..., rows, :], batch), _flat(qt, batch), _flat(kt.to(qt.dtype), batch),
                    _flat(vt.to(qt.dtype), batch), _flat(out[..., rows, :], batch),
                    _kernel_memory(lse[..., rows].expand(*batch, part.q_len).reshape(-1, 1, part.q_len)), causal, scale,
                )  # fmt: skip
                gq, gk, gv = (g.reshape(*batch, *g.shape[-2:]) for g in grads)
            else:
                p = _scores(qt, kt, scale, mt, part).sub_(_safe(lse[..., rows]).unsqueeze(-1)).exp_()
                do = dout[..., rows, :]
                gv = torch.matmul(p.transpose(-1, -2), do)
                ds = torch.matmul(do, vt.to(p.dtype).transpose(-1, -2)).sub_(delta[..., rows].unsqueeze(-1)).mul_(p)
                gq = torch.matmul(ds, kt.to(ds.dtype)) * scale
                gk = torch.matmul(ds.transpose(-1, -2), qt) * scale
            if dk is None:
                dk, dv = target.get()
            # narrow + add_: ``t[..., rows, :] += x`` would also copy the slice onto itself
            for acc, grad, start, length in ((dq, gq, part.q_start, part.q_len), (dk, gk, part.k_start, part.k_len),
                                             (dv, gv, part.k_start, part.k_len)):  # fmt: skip
                acc = acc.narrow(-2, start, length)
                acc.add_(grad.sum_to_size(acc.shape))
    return target.get()
