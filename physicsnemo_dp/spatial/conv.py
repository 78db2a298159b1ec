"""Convolution and transposed convolution (1-3d) on inputs sharded along spatial dims.

Covers ``F.conv1d/2d/3d`` and ``F.conv_transpose1d/2d/3d`` (so the ``nn``
modules too): any kernel size (odd or even), stride, dilation, groups, padding
(int, tuple, ``"same"``, ``"valid"``), ``output_padding``, batched or
unbatched input.

**Convolution.** Each rank computes the outputs anchored in its shard (see
:mod:`._geometry`), from one window of input rows that one halo exchange per
sharded dim assembles with the zero padding already in it; the local conv then
runs with ``padding=0``. Backward rebuilds the window from the input and the
received halo rows (kept, not the whole window), uses ``convolution_backward``
and returns the window's gradient to its owners (the mirror exchange; skipped
when the input needs no gradient). The bytes moved are the halo rows and
nothing else.

A stride-1 "same" convolution sharded along one dim skips the window copy:
:mod:`._seam_conv` convolves the local rows with torch's own padding and
corrects the rows at the two seams from the received halo rows (linearity).

**Transposed convolution.** Output ``o`` sums contributions of the inputs
``i`` with ``o = i * stride - padding + j * dilation``. Each rank gathers the
inputs that touch its outputs (again one exchange per sharded dim), runs the
transposed conv locally without padding and crops (or zero-extends, where no
input reaches) the result to its output block; bias is added after.

``padding_mode`` other than zeros exists only on the ``nn`` modules, which
call ``F.pad`` (global-boundary padding, :mod:`.pad`) and then convolve with
``padding=0``. Reflect and replicate padding then cost no communication unless
the boundary shard is thinner than the padding; circular padding needs the
far end's rows, so such a conv issues two exchanges per sharded dim (same
total bytes as one).

Weight and bias gradients are ``Partial`` over the mesh dims that shard the
input; promotion sums them into the parameters' plain ``.grad``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rule_kit import meta_output
from . import _geometry, _seam_conv
from ._window_op import Kernel, apply, build, ntuple, prepare_input, replicated, whole_extent

aten = torch.ops.aten


def _conv_args(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return input, weight, bias, stride, padding, 0, groups, dilation


def _conv_transpose_args(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    return input, weight, bias, stride, padding, output_padding, groups, dilation


def _left_padding(padding, kernel, dilation, n) -> tuple[int, ...]:
    """Padding before each spatial dim (``"same"`` puts the odd extra after, as torch does).

    The padding after needs no separate handling: the output size (from torch)
    already accounts for it, and windows past the input read zeros.
    """
    if padding == "valid":
        return (0,) * n
    if padding == "same":
        return tuple(d * (k - 1) // 2 for d, k in zip(dilation, kernel))
    return ntuple(padding, n, "padding")


class _ConvKernel(Kernel):
    def __init__(self, geometry, maps, weight_shape, stride, dilation, groups, transposed, batched, padding):
        self.geometry = geometry
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.transposed, self.batched = transposed, batched
        self.bias_sizes = [weight_shape[1] * groups if transposed else weight_shape[0]]
        n = len(stride)
        self.zeros = [0] * n
        self.padding = list(padding)  # torch's own padding, on the dims the window leaves alone
        # Transposed: where the uncropped local output starts relative to this rank's outputs.
        self.crop = []
        for d, dim_map in maps.items():
            o0, o1 = geometry.ranges[d]
            if transposed and o1 > o0:
                lo, hi = dim_map.window(o0, o1)
                start = lo * dim_map.stride - dim_map.padding
                length = max(hi - lo - 1, 0) * dim_map.stride + dim_map.dilation * (dim_map.kernel - 1) + 1
                self.crop.append((start - o0, o1 - start - length))
            else:
                self.crop.append((0, 0))

    def _pads(self, sign: int) -> list[int]:
        return [sign * v for left, right in reversed(self.crop) for v in (left, right)]

    def run(self, window, params):
        weight, bias = params
        x = window if self.batched else window.unsqueeze(0)
        if not self.transposed:
            out = aten.convolution(x, weight, bias, self.stride, self.padding, self.dilation, False, self.zeros, self.groups)
        else:
            out = self._transposed(x, weight)
            if bias is not None:
                out = out + bias.reshape(-1, *([1] * len(self.stride)))
        return out if self.batched else out.squeeze(0)

    def _transposed(self, x, weight):
        if x.numel() == 0:
            shape = list(self.geometry.out_spec.local_shape)
            return x.new_zeros(shape if self.batched else [1, *shape])
        full = aten.convolution(x, weight, None, self.stride, self.zeros, self.dilation, True, self.zeros, self.groups)
        return F.pad(full, self._pads(1))

    def vjp(self, window, params, grad, needs_window=True):
        weight, bias = params
        x = window if self.batched else window.unsqueeze(0)
        g = grad if self.batched else grad.unsqueeze(0)
        grad_bias = None
        if self.transposed:
            grad_bias = None if bias is None else g.sum(dim=[d for d in range(g.ndim) if d != 1])
            if x.numel() == 0:
                return torch.zeros_like(window), (torch.zeros_like(weight), grad_bias)
            g = F.pad(g, self._pads(-1))
        gx, gw, gb = aten.convolution_backward(
            g, x, weight, None if bias is None or self.transposed else self.bias_sizes,
            self.stride, self.padding, self.dilation, self.transposed, self.zeros, self.groups,
            [needs_window, True, bias is not None and not self.transposed],
        )  # fmt: skip
        if gx is not None and not self.batched:
            gx = gx.squeeze(0)
        return gx, (gw, grad_bias if self.transposed else gb)


def _convolution(func, n: int, transposed: bool, args, kwargs):
    binder = _conv_transpose_args if transposed else _conv_args
    x, weight, bias, stride, padding, _, groups, dilation = binder(*args, **kwargs)
    out_shape = tuple(meta_output(func, args, kwargs).shape)
    stride, dilation = ntuple(stride, n, "stride"), ntuple(dilation, n, "dilation")
    kernel = tuple(weight.shape[2:])
    spatial = tuple(range(x.ndim - n, x.ndim))
    x = prepare_input(x, spatial, whole_dims=(x.ndim - n - 1,))
    if transposed:
        pads = ntuple(padding, n, "padding")
        maps = {
            d: _geometry.Transposed(x.shape[d], out_shape[d], k, s, dl, p)
            for d, k, s, dl, p in zip(spatial, kernel, stride, dilation, pads)
        }
    else:
        left = _left_padding(padding, kernel, dilation, n)
        maps = {
            d: _geometry.Strided(x.shape[d], out_shape[d], k, s, dl, p)
            for d, k, s, dl, p in zip(spatial, kernel, stride, dilation, left)
        }
    # Dims this rank holds whole with symmetric padding need no window: torch pads them itself.
    native = () if transposed else [d for d, m in maps.items() if whole_extent(x._spec, d) and m.symmetric()]
    padding = [maps[d].pad_left if d in native else 0 for d in spatial]
    geometry = build(x._spec, maps, out_shape, mode="zeros", native=native)
    seams = None if transposed else _seam_conv.plan(geometry, maps, x.ndim == n + 2, dilation, groups, padding)
    if seams is not None:
        return _seam_conv.SeamConvFunction.apply(seams, x, replicated(weight), replicated(bias))[0]
    conv_kernel = _ConvKernel(
        geometry, maps, tuple(weight.shape), stride, dilation, groups, transposed, x.ndim == n + 2, padding
    )
    return apply(conv_kernel, x, replicated(weight), replicated(bias))


def _handler(n: int, transposed: bool):
    def handler(func, types, args, kwargs):
        return _convolution(func, n, transposed, args, kwargs)

    return handler


FUNCTIONS = {
    F.conv1d: _handler(1, False),
    F.conv2d: _handler(2, False),
    F.conv3d: _handler(3, False),
    F.conv_transpose1d: _handler(1, True),
    F.conv_transpose2d: _handler(2, True),
    F.conv_transpose3d: _handler(3, True),
}
