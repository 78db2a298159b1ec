"""Stride-1 "same" convolution of a shard without building its window: local conv plus seam corrections.

The general window op (:mod:`._window_op`) copies the local rows and the halo
into one window and convolves that. For the most common case — a stride-1
convolution with symmetric ("same") padding along the one sharded dim — the
copy is avoidable, because convolution is linear in its input:

    conv(window) = conv(local, zero padding)  +  conv(halo rows, zeros elsewhere)

The first term is torch's own convolution of the local rows, exactly what a
single device computes on the same input. The second is non-zero only in the
``P`` output rows at each seam (``P`` is the padding, half the dilated kernel
span): a *slab* of ``3P`` rows holding the received halo rows, zeros
elsewhere, convolved without padding, gives those ``P`` rows' correction.
Backward mirrors it: ``convolution_backward`` of the local rows gives the
local input gradient and most of the weight gradient; each slab's gives the
halo rows' gradients (sent back to their owners) and the rest of the weight
gradient.

The communication is the window op's exactly (the same halo plan: one
exchange forward, its mirror backward, skipped when the input needs no
gradient), so each rank may take this path or the window op's on its own:
a rank whose shard is thinner than ``P`` rows uses the window op.

The split also lets the exchange overlap the work. Forward posts the
exchange, convolves the local rows (the interior: it needs no foreign row),
and only then waits for the halo the seams need; backward computes the seams'
gradients first, posts them back to their owners, and runs the interior's
``convolution_backward`` while they travel. Where that pays (local inputs of
:data:`OVERLAP_MIN_BYTES` or more, under ``collectives.overlap("auto")``) or
when forced (``"on"``); otherwise, and while torch.compile traces, each
exchange is waited for as soon as it is posted. The same ops run in both
orders on the same values, so the results are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from .._torch_compat import Function, non_differentiable, tracing
from .._redistribute import grad_layout
from ..rule_kit import shard_tensor_cls, to_layout, wrap
from . import halo
from ._window_op import Geometry, partial_spec

aten = torch.ops.aten


@dataclass(frozen=True)
class SeamConv:
    """One call's static facts: the geometry, the sharded dim and its padding, torch's conv arguments."""

    geometry: Geometry
    dim: int  # the sharded spatial dim, in the (batched) local tensor
    pad: int  # P along ``dim``
    padding: tuple[int, ...]  # torch's padding on every spatial dim (P on ``dim``)
    dilation: tuple[int, ...]
    groups: int
    batched: bool
    seams: tuple[tuple[int, int], ...]  # (output row, received halo rows) of the left and right seam

    def conv(self, x, weight, bias, seam: bool):
        """torch's convolution; at a seam (a slab) without padding along ``dim``."""
        return aten.convolution(x, weight, bias, [1] * len(self.padding), self._padding(seam), self.dilation,
                                False, [0] * len(self.padding), self.groups)  # fmt: skip

    def conv_backward(self, grad, x, weight, bias_sizes, seam: bool, mask):
        return aten.convolution_backward(
            grad, x, weight, bias_sizes, [1] * len(self.padding), self._padding(seam), self.dilation,
            False, [0] * len(self.padding), self.groups, mask,
        )  # fmt: skip

    def _padding(self, seam: bool) -> list[int]:
        axis = self.dim - 2
        return [0 if seam and i == axis else p for i, p in enumerate(self.padding)]

    def slabs(self, local, rows):
        """``(output row, slab, (slab start, count) of the halo rows)`` for each seam with received rows."""
        d, P, taken = self.dim, self.pad, 0
        out = []
        for side, (row, count) in enumerate(self.seams):
            if count:
                shape = list(local.shape)
                shape[d] = 3 * P
                slab = local.new_zeros(shape)
                start = P - count if side == 0 else 2 * P
                slab.narrow(d, start, count).copy_(rows.narrow(d, taken, count))
                out.append((row, slab, (start, count)))
            taken += count
        return out


#: Local input bytes from which a seam convolution overlaps its halo exchange with the interior
#: (``collectives.overlap("auto")``, the default): below it the exchange hides nothing measurable.
OVERLAP_MIN_BYTES = 64 * 1024


def overlapped(local: torch.Tensor) -> bool:
    """Whether this call posts its exchange before the interior and waits only for the seams.

    While torch.compile traces, never: the exchange is a functional
    collective there, waited for where the graph first reads it (the
    compiler orders the work).
    """
    mode = collectives.overlap_mode()
    if mode == "off" or tracing(local):
        return False
    return mode == "on" or local.numel() * local.element_size() >= OVERLAP_MIN_BYTES


def plan(geometry: Geometry, maps, batched: bool, dilation, groups, padding) -> SeamConv | None:
    """The seam plan for this rank, or None when this call (or this rank's shard) needs the window op.

    It applies when exactly one spatial dim needs a halo, with stride 1 and
    symmetric padding ``P`` there (so each output row sits on its input row),
    and this rank holds at least ``P`` rows of it. ``padding`` is torch's
    padding per spatial dim (``maps``' dims, in order) on the other dims.
    """
    plans = geometry.plans
    if len(plans) != 1 or not plans[0].exchange:
        return None
    p = plans[0]
    m = maps[p.dim]
    span = m.dilation * (m.kernel - 1) + 1
    if m.stride != 1 or not m.symmetric() or span != 2 * m.pad_left + 1 or p.local_rows < m.pad_left:
        return None
    sizes, me, _ = halo.group_sizes(geometry.in_spec, p.dim)
    start = sum(sizes[:me])
    if geometry.ranges[p.dim] != (start, start + p.local_rows):
        return None
    P = m.pad_left
    seams = ((0, min(P, start)), (p.local_rows - P, min(P, m.in_size - start - p.local_rows)))
    if seams[0][1] + seams[1][1] != p.received_rows:
        return None
    padding = tuple(P if d == p.dim else pad for d, pad in zip(sorted(maps), padding))
    return SeamConv(geometry, p.dim + (0 if batched else 1), P, padding, tuple(dilation), groups, batched, seams)


class SeamConvFunction(Function):
    """``(seam plan, x, weight, bias) -> (output ShardTensor, received rows)``; see the module doc."""

    @staticmethod
    def forward(s: SeamConv, x, weight, bias):
        g = s.geometry
        overlap = overlapped(x._local_tensor)
        arriving = halo.post_exchange(x._local_tensor, g.plans[0], g.in_spec.mesh)
        rows = None if overlap else arriving.wait()
        local = _batched(s, x._local_tensor)
        w, b = weight._local_tensor, None if bias is None else bias._local_tensor
        out = s.conv(local, w, b, seam=False)  # the interior: no foreign row needed
        if overlap:
            rows = arriving.wait()
        rows = _batched(s, rows)
        for row, slab, _ in s.slabs(local, rows):
            out.narrow(s.dim, row, s.pad).add_(s.conv(slab, w, None, seam=True))
        return wrap(_unbatched(s, out), g.out_spec), _unbatched(s, rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        s, x, weight, bias = inputs
        ctx.s = s
        non_differentiable(ctx, output[1])
        ctx.save_for_backward(x, output[1], weight)
        ctx.bias_meta = None if bias is None else (tuple(bias.shape), bias.dtype)

    @staticmethod
    def backward(ctx, grad, _rows_grad):
        x, rows, weight = ctx.saved_tensors
        s, g = ctx.s, ctx.s.geometry
        if isinstance(grad, shard_tensor_cls()):
            grad = to_layout(grad, grad_layout(g.out_spec))
        grad = _batched(s, grad.contiguous())
        local, rows, w = _batched(s, x._local_tensor), _batched(s, rows), weight._local_tensor
        needs_x = ctx.needs_input_grad[1]
        bias_sizes = None if ctx.bias_meta is None else list(ctx.bias_meta[0])
        overlap = overlapped(x._local_tensor)

        def interior():
            return s.conv_backward(grad, local, w, bias_sizes, False, [needs_x, True, bias_sizes is not None])

        if not overlap:
            gx, gw, gb = interior()
        # the seams first: their rows' gradients travel (overlapped: during the interior's backward)
        halo_grads, slab_gws = [], []
        for row, slab, (start, count) in s.slabs(local, rows):
            gs, gws, _ = s.conv_backward(grad.narrow(s.dim, row, s.pad).contiguous(), slab, w, None, True,
                                         [needs_x, True, False])  # fmt: skip
            slab_gws.append(gws)
            if needs_x:
                halo_grads.append(gs.narrow(s.dim, start, count))
        p, mesh = g.plans[0], g.in_spec.mesh
        returning = halo.post_send_back(_unbatched(s, _joined(halo_grads, rows, s.dim)), p, mesh) if needs_x else None
        if overlap:
            gx, gw, gb = interior()
        for gws in slab_gws:  # in the same order on both paths: the same bits
            gw = gw + gws
        grad_x = None
        if needs_x:
            grad_x = wrap(halo.add_returned(_unbatched(s, gx), returning, p, in_place=True), grad_layout(g.in_spec))
        grad_w = wrap(gw, partial_spec(g.in_spec, tuple(w.shape), w.dtype))
        grad_b = None if gb is None else wrap(gb, partial_spec(g.in_spec, *ctx.bias_meta))
        return None, grad_x, grad_w, grad_b


def _joined(halo_grads, rows, dim):
    """The received rows' gradient: the seams' parts in arrival order (none: this rank received nothing)."""
    return torch.cat(halo_grads, dim) if halo_grads else torch.zeros_like(rows)


def _batched(s: SeamConv, t):
    return t if s.batched else t.unsqueeze(0)


def _unbatched(s: SeamConv, t):
    return t if s.batched else t.squeeze(0)
