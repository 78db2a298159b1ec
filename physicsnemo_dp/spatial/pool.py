"""Pooling (max, avg, adaptive max, adaptive avg; 1-3d) on inputs sharded along spatial dims.

Every option of the torch functions is supported: any kernel, stride,
padding, dilation, ``ceil_mode``, ``count_include_pad``, ``divisor_override``,
``return_indices`` (global flat indices, as torch gives them) and any adaptive
output size. Pooling never mixes channels, so batch and channel dims may stay
sharded.

**max / avg.** One halo exchange per sharded dim assembles each rank's window
(:mod:`._geometry` gives the outputs each rank owns and the rows they read).
Padding is materialised as ``-inf`` (max) or ``0`` (avg), windows running past
the padded input with ``ceil_mode`` likewise, so the local op runs with
``padding=0``. Average pooling's divisor depends on where a window sits in
the *global* grid (``count_include_pad``, clipped ``ceil_mode`` windows); it is
a product of per-dim counts, applied as a separable factor to the local sums.

**adaptive.** Window ``o`` along a dim is ``[floor(o N / O), ceil((o + 1) N / O))``:
boxes of varying size. Each rank gathers its boxes from the local window
(one ``index_select`` per dim, shorter boxes padded by repeating their last
row and masked) and reduces them; max scans a box in torch's order, so ties
resolve to the same index.
"""

from __future__ import annotations

from math import prod

import torch
import torch.nn.functional as F

from .._torch_compat import graph_constant, on_real_tensors
from ..rule_kit import meta_output, wrap
from . import _geometry
from ._window_op import Kernel, WindowFunction, build, ntuple, prepare_input


def _max_args(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    return input, kernel_size, stride, padding, dilation, ceil_mode, return_indices


def _avg_args(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override


def _adaptive_args(input, output_size, return_indices=False):
    return input, return_indices


# --------------------------------------------------------------------------- #
# max / avg pooling
# --------------------------------------------------------------------------- #
class _MaxPool(Kernel):
    def __init__(self, geometry, maps, n, kernel, stride, dilation):
        self.geometry, self.maps = geometry, maps
        self.pool = getattr(F, f"max_pool{n}d")
        self.kernel, self.stride, self.dilation = kernel, stride, dilation

    def run(self, window, params):
        return self.pool(window, self.kernel, self.stride, 0, self.dilation)

    def global_indices(self, window, shape):
        """torch's indices (flat over the spatial grid) translated from the window to the global grid."""
        local = self.pool(window, self.kernel, self.stride, 0, self.dilation, return_indices=True)[1]
        dims = list(self.maps)
        flat, stride = torch.zeros_like(local), 1
        for d in reversed(dims):
            lo, hi = self.maps[d].window(*self.geometry.ranges[d])
            flat = flat + (local.remainder(hi - lo) + lo) * stride
            local = local.div(hi - lo, rounding_mode="floor")
            stride *= shape[d]
        return flat


class _AvgPool(Kernel):
    def __init__(self, geometry, maps, n, kernel, stride, count_include_pad, divisor_override):
        self.geometry = geometry
        self.pool = getattr(F, f"avg_pool{n}d")
        self.kernel, self.stride = kernel, stride
        # Local op computes sum / prod(kernel); torch divides the sum by a global-position divisor.
        self.scale = [
            _divisor_factors(m, *geometry.ranges[d], count_include_pad, divisor_override is not None)
            for d, m in maps.items()
        ]
        self.constant = prod(kernel) / divisor_override if divisor_override else prod(kernel)

    def run(self, window, params):
        out = self.pool(window, self.kernel, self.stride, 0, False, True) * self.constant
        n = len(self.scale)
        for i, factor in enumerate(self.scale):
            if factor is not None:
                out = out * graph_constant(factor, like=out).to(out.dtype).reshape(-1, *([1] * (n - 1 - i)))
        return out


@on_real_tensors
def _divisor_factors(m: _geometry.Strided, o0, o1, count_include_pad, overridden):
    """Per-dim ``1 / count`` for outputs ``[o0, o1)``, following torch's avg-pool divisor."""
    if overridden:
        return None
    o = torch.arange(o0, o1, dtype=torch.float64)
    start = o * m.stride - m.pad_left
    end = torch.clamp(start + m.kernel, max=m.in_size + m.pad_left)
    if not count_include_pad:
        start, end = start.clamp(min=0), end.clamp(max=m.in_size)
    count = (end - start).clamp(min=0)
    return torch.where(count > 0, 1.0 / count.clamp(min=1), 0.0)


def _strided_maps(x, out_shape, n, kernel, stride, padding, dilation):
    dims = range(x.ndim - n, x.ndim)
    return {
        d: _geometry.Strided(x.shape[d], out_shape[d], k, s, dl, p)
        for d, k, s, p, dl in zip(dims, kernel, stride, padding, dilation)
    }


def _max_pool(n):
    def handler(func, types, args, kwargs):
        x, kernel, stride, padding, dilation, _, return_indices = _max_args(*args, **kwargs)
        out_shape = _shape(meta_output(func, args, kwargs))
        kernel = ntuple(kernel, n, "kernel_size")
        stride = ntuple(stride or kernel, n, "stride")
        padding, dilation = ntuple(padding, n, "padding"), ntuple(dilation, n, "dilation")
        x = prepare_input(x, range(x.ndim - n, x.ndim))
        maps = _strided_maps(x, out_shape, n, kernel, stride, padding, dilation)
        geometry = build(x._spec, maps, out_shape, mode="constant", fill_value=float("-inf"))
        pool = _MaxPool(geometry, maps, n, kernel, stride, dilation)
        out, window, *_ = WindowFunction.apply(pool, x)
        return (out, _indices(pool, window, x.shape)) if return_indices else out

    return handler


def _avg_pool(n):
    def handler(func, types, args, kwargs):
        x, kernel, stride, padding, _, count_include_pad, divisor_override = _avg_args(*args, **kwargs)
        out_shape = tuple(meta_output(func, args, kwargs).shape)
        kernel = ntuple(kernel, n, "kernel_size")
        stride = ntuple(stride or kernel, n, "stride")
        padding = ntuple(padding, n, "padding")
        x = prepare_input(x, range(x.ndim - n, x.ndim))
        maps = _strided_maps(x, out_shape, n, kernel, stride, padding, (1,) * n)
        geometry = build(x._spec, maps, out_shape, mode="zeros")
        return WindowFunction.apply(_AvgPool(geometry, maps, n, kernel, stride, count_include_pad, divisor_override), x)[0]

    return handler


# --------------------------------------------------------------------------- #
# adaptive pooling (also interpolation's "area" mode)
# --------------------------------------------------------------------------- #
class Boxes(Kernel):
    """Reduce (``"avg"`` or ``"max"``) varying-size boxes given by Tabulated maps' ``lo``/``hi``.

    Along each dim, output ``o`` reads rows ``lo[o] + t`` for ``t < width``
    (the widest box), rows past ``hi[o]`` repeating the last one and masked.
    Boxes are flattened in row-major order, torch's scan order.
    """

    def __init__(self, geometry, maps, reduce: str):
        self.geometry, self.reduce = geometry, reduce
        self.dims = list(maps)
        self.base, self.index, self.mask = _box_tables(geometry, maps)

    def _boxes(self, window):
        """``(..., n_1, ..., n_k, box)`` values and the matching validity mask."""
        x, k = window, len(self.dims)
        lead = window.ndim - k
        for i, d in enumerate(self.dims):
            x = x.index_select(d + i, graph_constant(self.index[i], like=x).flatten()).unflatten(d + i, self.index[i].shape)
        order = [*range(lead), *(lead + 2 * i for i in range(k)), *(lead + 2 * i + 1 for i in range(k))]
        return x.permute(order).flatten(-k), graph_constant(self.mask, like=x)

    def run(self, window, params):
        x, mask = self._boxes(window)
        if self.reduce == "avg":
            return (x * mask).sum(-1) / mask.sum(-1)
        return x.masked_fill(~mask, float("-inf")).max(-1).values

    def global_indices(self, window, shape):
        """Flat index of each box's maximum within the global spatial grid ``shape``."""
        x, mask = self._boxes(window)
        t = x.masked_fill(~mask, float("-inf")).max(-1).indices
        lead = t.ndim - len(self.dims)
        flat, stride = torch.zeros_like(t), 1
        for i in reversed(range(len(self.dims))):
            n, width = self.index[i].shape
            o = torch.arange(n, device=t.device).reshape([n if a == lead + i else 1 for a in range(t.ndim)])
            row = graph_constant(self.index[i], like=t).flatten()[o * width + t.remainder(width)] + self.base[i]
            t = t.div(width, rounding_mode="floor")
            flat = flat + row * stride
            stride *= shape[self.dims[i]]
        return flat


@on_real_tensors
def _box_tables(geometry, maps):
    """Per window dim: the box origin ``base``, the ``(n, width)`` row table; and the joint validity mask.

    Along each dim, output ``o`` reads rows ``lo[o] + t`` for ``t < width``
    (rows past ``hi[o]`` repeat the last one); the mask, over the flattened
    product of the dims' boxes, says which reads are real.
    """
    bases, index, valid = [], [], []
    for d, m in maps.items():
        o0, o1 = geometry.ranges[d]
        base = m.window(o0, o1)[0] if o1 > o0 else 0
        lo = torch.tensor(m.lo[o0:o1], dtype=torch.long) - base
        hi = torch.tensor(m.hi[o0:o1], dtype=torch.long) - base
        steps = lo[:, None] + torch.arange(int((hi - lo).max()) if o1 > o0 else 0)
        bases.append(base)
        valid.append(steps < hi[:, None])
        index.append(torch.minimum(steps, hi[:, None] - 1))
    mask = valid[0]
    for v in valid[1:]:
        mask = (mask.unsqueeze(-2).unsqueeze(-1) & v.reshape(*([1] * (mask.ndim - 1)), v.shape[0], 1, v.shape[1])).flatten(-2)
    return bases, index, mask


def adaptive_pool(x, out_shape, n: int, reduce: str):
    """Adaptive ``reduce`` pooling of ShardTensor ``x`` to ``out_shape``; returns ``(out, window, kernel)``."""
    x = prepare_input(x, range(x.ndim - n, x.ndim))
    maps = {d: _geometry.adaptive(x.shape[d], out_shape[d]) for d in range(x.ndim - n, x.ndim)}
    geometry = build(x._spec, maps, out_shape, mode="zeros")
    kernel = Boxes(geometry, maps, reduce)
    out, window, *_ = WindowFunction.apply(kernel, x)
    return out, window, kernel


def _adaptive(n: int, reduce: str):
    def handler(func, types, args, kwargs):
        x, return_indices = _adaptive_args(*args, **kwargs)
        out_shape = _shape(meta_output(func, args, kwargs))
        out, window, pool = adaptive_pool(x, out_shape, n, reduce)
        return (out, _indices(pool, window, x.shape)) if return_indices else out

    return handler


def _shape(meta):
    return tuple((meta[0] if isinstance(meta, tuple) else meta).shape)


def _indices(pool, window, shape):
    """``return_indices`` output: global flat indices (int64) in the output's layout."""
    out_spec = pool.geometry.out_spec
    local_shape = tuple(out_spec.local_shape)
    local = window.new_zeros(local_shape, dtype=torch.long) if 0 in local_shape else pool.global_indices(window, shape)
    return wrap(local, out_spec)


FUNCTIONS: dict = {}
for _n in (1, 2, 3):
    _max = _max_pool(_n)
    _adaptive_max = _adaptive(_n, "max")
    FUNCTIONS[getattr(F, f"max_pool{_n}d")] = _max
    FUNCTIONS[getattr(F, f"max_pool{_n}d_with_indices")] = _max
    FUNCTIONS[getattr(F, f"avg_pool{_n}d")] = _avg_pool(_n)
    FUNCTIONS[getattr(F, f"adaptive_avg_pool{_n}d")] = _adaptive(_n, "avg")
    FUNCTIONS[getattr(F, f"adaptive_max_pool{_n}d")] = _adaptive_max
    FUNCTIONS[getattr(F, f"adaptive_max_pool{_n}d_with_indices")] = _adaptive_max
