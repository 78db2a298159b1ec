"""``F.pad`` in every mode on sharded tensors: padding only at the global boundary.

Padding is the simplest window op: output ``o`` along a padded dim reads input
``o - pad_left`` (a kernel-1 window), so the window *is* the output. The
first non-empty shard takes the left padding and the last one the right
padding; the others keep their sizes (see :mod:`._geometry`). Negative
padding crops the same way. ``constant`` padding never communicates;
``replicate`` and ``reflect`` only when the boundary shard is thinner than the
padding; ``circular`` sends the far end's rows across the domain (periodic
boundaries).
"""

from __future__ import annotations

import torch.nn.functional as F

from ..rule_kit import meta_output
from .._torch_compat import pad_builtin

from . import _geometry
from ._window_op import Kernel, apply, build, prepare_input


def _pad_args(input, pad, mode="constant", value=None):
    return input, tuple(pad), mode, value


class _Identity(Kernel):
    """The assembled window is the padded output."""

    def __init__(self, geometry):
        self.geometry = geometry

    def run(self, window, params):
        return window

    def vjp(self, window, params, grad, needs_window=True):
        return grad.clone(), ()  # a new tensor: the halo gradients are added into it in place


def _pad(func, types, args, kwargs):
    x, pad, mode, value = _pad_args(*args, **kwargs)
    out_shape = tuple(meta_output(func, args, kwargs).shape)  # torch's checks and errors, alike on every rank
    if mode == "circular" and any(p < 0 for p in pad):
        # torch crops first and wraps the *cropped* tensor (its period is the cropped extent), which a
        # window over the original input cannot express: crop with narrow, then pad the rest.
        return _pad(func, types, (_crop(x, pad), tuple(max(p, 0) for p in pad), mode, value), {})
    dims = [x.ndim - 1 - i for i in range(len(pad) // 2)]
    x = prepare_input(x, dims)
    maps = {
        d: _geometry.Strided(x.shape[d], out_shape[d], pad_left=pad[2 * (x.ndim - 1 - d)])
        for d in dims
    }
    geometry = build(x._spec, maps, out_shape, mode=mode, fill_value=0.0 if value is None else value)
    return apply(_Identity(geometry), x)


def _crop(x, pad):
    """``x`` with the negative entries of ``pad`` removed from its ends (``pad`` lists the last dim first)."""
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        before, after = max(-pad[2 * i], 0), max(-pad[2 * i + 1], 0)
        if before or after:
            x = x.narrow(d, before, x.shape[d] - before - after)
    return x


#: Under torch.compile the call arrives as ``pad_builtin`` (same signature).
FUNCTIONS = {F.pad: _pad, pad_builtin: _pad}
