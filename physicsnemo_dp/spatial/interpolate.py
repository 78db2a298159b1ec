"""``F.interpolate`` / ``nn.Upsample`` on inputs sharded along spatial dims.

Every mode torch has for these inputs (nearest, nearest-exact, linear,
bilinear, bicubic, trilinear, area; ``align_corners`` both ways; ``size`` or
``scale_factor``, ``recompute_scale_factor``; ``antialias``) is a *separable*
linear map: along each spatial dim, output ``o`` is a weighted sum of a few
input rows (``area`` is adaptive average pooling, handled by :mod:`.pool`).

**Exactness by construction.** Instead of re-deriving torch's index and weight
formulas (single-precision scales for nearest, clamping rules, antialias
filters), each dim's taps are *measured* by running torch's own kernel on a
comb: channel ``c`` of the probe is 1 on rows ``n = c (mod P)``. With ``P``
wider than any output's footprint every output row meets each channel at
most once, so the probe returns the weights, and a second probe holding
``n // P + 1`` on those rows returns their positions. A random vector checks
the reconstruction (``P`` doubles until it holds). The probe runs on one row of
length ``N`` per dim and is cached per geometry.

Each output row is anchored at its heaviest tap (:mod:`._geometry`), so a 2x
upsampling sends input row ``i`` to outputs ``2i, 2i + 1``; one halo exchange
per sharded dim fetches the neighbour rows the local taps reach.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..rule_kit import meta_output
from .._torch_compat import graph_constant, on_real_tensors, upsample_kernels
from . import _geometry
from ._window_op import Kernel, WindowFunction, build, prepare_input
from .pool import adaptive_pool

_KERNELS = upsample_kernels
_FIRST_P = {"nearest": 1, "nearest-exact": 1, "linear": 2, "cubic": 4}


def _interpolate_args(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                      recompute_scale_factor=None, antialias=False):  # fmt: skip
    return input, scale_factor, mode, align_corners, recompute_scale_factor, antialias


def _apply_1d(kind, rows: torch.Tensor, out_size: int, align_corners, scale) -> torch.Tensor:
    """The 1-D operator of ``kind`` applied to each row of ``rows`` (``(P, N) -> (P, O)``).

    Runs the 2-D kernel along the last dim with a leading dim of size 1
    (mapped 1 -> 1, exactly the identity in every mode). The probe must run
    along the *last* dim: torch 2.13's antialiased kernels give wrong weights
    for an input whose last dim is 1.
    """
    x = rows[None, :, None, :]
    if scale is None:
        out = _KERNELS[kind](x, [1, out_size], align_corners, None)
    else:
        out = _KERNELS[kind](x, None, align_corners, [1.0, scale])
    return out[0, :, 0, :]


@functools.lru_cache(maxsize=256)
@on_real_tensors
def taps(kind: str, in_size: int, out_size: int, align_corners, scale, dtype: torch.dtype):
    """``(positions, weights, map)``: output ``o`` = sum_t weights[o, t] * input[positions[o, t]].

    ``positions`` and ``weights`` are ``(O, P)``; ``map`` is the dim's
    :class:`_geometry.Tabulated` (windows and anchors).
    """
    n = torch.arange(in_size)
    check = torch.randn(1, in_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = _apply_1d(kind, check, out_size, align_corners, scale)[0]
    p = min(_FIRST_P.get(kind, 4), in_size)
    while True:
        comb = (n[None, :] % p == torch.arange(p)[:, None]).to(torch.float64)
        weights = _apply_1d(kind, comb, out_size, align_corners, scale)
        blocks = _apply_1d(kind, comb * (n // p + 1), out_size, align_corners, scale)
        ratio = torch.where(weights != 0, blocks / torch.where(weights != 0, weights, 1.0), 1.0)
        positions = ((ratio.round().long() - 1) * p + torch.arange(p)[:, None]).clamp(0, in_size - 1)
        if p >= in_size or torch.allclose((weights * check[0][positions]).sum(0), expected, rtol=1e-12, atol=1e-12):
            break
        p = min(2 * p, in_size)
    if dtype != torch.float64:
        weights = _apply_1d(kind, comb.to(dtype), out_size, align_corners, scale)
    # Zero taps point at a used row of their output, so they widen no window.
    heaviest = weights.abs().argmax(0)
    positions = torch.where(weights != 0, positions, positions.gather(0, heaviest[None]))
    positions, weights = positions.T.contiguous(), weights.T.contiguous()
    return positions, weights, _tap_map(in_size, positions, weights)


def _tap_map(in_size: int, positions: torch.Tensor, weights: torch.Tensor) -> _geometry.Tabulated:
    anchors = positions.gather(1, weights.abs().argmax(1, keepdim=True))[:, 0].cummax(0).values
    lo = positions.min(1).values.flip(0).cummin(0).values.flip(0)
    hi = positions.max(1).values.cummax(0).values + 1
    return _geometry.Tabulated(in_size, tuple(anchors.tolist()), tuple(lo.tolist()), tuple(hi.tolist()))


class _Taps(Kernel):
    """Apply each window dim's taps in turn (index_select + weighted sum)."""

    def __init__(self, geometry, tap_tables):
        self.geometry = geometry
        self.steps = _local_taps(geometry, tap_tables)

    def run(self, window, params):
        x = window
        for d, positions, weights in self.steps:
            n, p = positions.shape
            picked = x.index_select(d, graph_constant(positions, like=x).flatten()).unflatten(d, (n, p))
            w = graph_constant(weights, like=x).to(x.dtype).reshape(n, p, *([1] * (x.ndim - d - 1)))
            x = (picked * w).sum(d + 1)
        return x


@on_real_tensors
def _local_taps(geometry, tap_tables):
    """``(dim, positions, weights)`` of this rank's outputs, positions relative to its window."""
    steps = []
    for d, (positions, weights, m) in tap_tables.items():
        o0, o1 = geometry.ranges[d]
        base = m.window(o0, o1)[0] if o1 > o0 else 0
        steps.append((d, positions[o0:o1] - base, weights[o0:o1]))
    return steps


def _kind(mode: str, antialias: bool) -> str:
    kind = {"bilinear": "linear", "trilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    return f"{kind}-aa" if antialias else kind


def _interpolate(func, types, args, kwargs):
    x, scale_factor, mode, align_corners, recompute, antialias = _interpolate_args(*args, **kwargs)
    out_shape = tuple(meta_output(func, args, kwargs).shape)
    n = x.ndim - 2
    if mode == "area":
        return adaptive_pool(x, out_shape, n, "avg")[0]
    if scale_factor is None or recompute:
        scales = (None,) * n
    else:
        scales = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * n
    kind = _kind(mode, antialias)
    if kind not in _KERNELS:
        raise NotImplementedError(
            f"interpolate mode {mode!r} (antialias={antialias}) is not supported on ShardTensor; "
            "gather the input first (x.full_tensor())"
        )
    align_corners = None if kind.startswith("nearest") else bool(align_corners)
    x = prepare_input(x, range(2, x.ndim))
    dtype = x._local_tensor.dtype
    tables = {
        d: taps(kind, x.shape[d], out_shape[d], align_corners, scales[i], dtype)
        for i, d in enumerate(range(2, x.ndim))
    }
    geometry = build(x._spec, {d: t[2] for d, t in tables.items()}, out_shape, mode="zeros")
    return WindowFunction.apply(_Taps(geometry, tables), x)[0]


FUNCTIONS = {F.interpolate: _interpolate}
