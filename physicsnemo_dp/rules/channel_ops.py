"""Channel ops on ShardTensors: ``F.prelu``, ``F.glu``, ``F.pixel_shuffle``, ``F.pixel_unshuffle``.

Each is torch's own op on the local pieces, inside ``_local.LocalCall`` (its
backward is torch's local backward; gradients come back to the input's layout):

* ``prelu(input, weight)`` (``nn.PReLU``): the input keeps its layout. A weight
  of one parameter is read whole; one of ``C`` parameters is cut to the local
  channels when the channel dim 1 is sharded. The weight's gradient is a pending
  sum over the mesh dims that shard the input, reduced once by the promotion
  step of the plain parameter, like any promoted weight's. No communication in
  the forward.
* ``glu(input, dim)``: local when ``dim`` is not sharded. A sharded ``dim`` is
  first made whole (``rule_kit.unshard_dims``' layout: its shard moves to the
  largest free dim, one all-to-all; replicated if there is none), and the output
  keeps that layout (the gradient goes back with the reverse all-to-all).
* ``pixel_shuffle(input, r)``: ``(*, C r^2, H, W) -> (*, C, H r, W r)``. Batch
  dims, ``H`` and ``W`` may be sharded, unevenly and with empty shards: the
  output keeps the placements, and its ``H``/``W`` shard sizes are ``r`` times
  the input's (a 5/3/2 split of ``H`` gives 10/6/4). A sharded channel dim
  whose shard sizes are multiples of ``r^2`` stays (output channel shards are
  ``1/r^2`` of the input's); otherwise it is first re-split into multiples of
  ``r^2`` (the ``torch.chunk`` rule over ``C``; one all-to-all between
  neighbours), and the output's channel shards follow that split.
* ``pixel_unshuffle(input, r)``: the inverse. ``H``/``W`` shards that are
  multiples of ``r`` stay (output sizes ``1/r`` of them); others are first
  re-split into multiples of ``r`` the same way. A sharded channel dim stays,
  its output shards ``r^2`` times the input's.

Argument errors are torch's, from meta tensors of the global shapes, on every rank alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rule_kit import meta_output, normalize_dim, unshard_target
from ..split import chunk_sizes
from ._local import Job, aligned, as_shard, cut, local_call, resolved, spec_of

__all__ = ["RULES", "FUNCTIONS"]


def _args(names, defaults, args, kwargs):
    values = dict(defaults)
    values.update(zip(names, args))
    values.update(kwargs)
    return [values[n] for n in names]


def _prelu(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    x, w = _args(("input", "weight"), {}, args, kwargs)
    w = as_shard(w, x)
    common = resolved(x._spec)
    if x.ndim >= 2 and w.ndim == 1 and w.shape[0] > 1:
        weight = cut((1,))  # one parameter per channel: this rank's channels
    else:
        weight = cut((None,) * w.ndim)
    (out,) = local_call(Job(lambda x, w: (F.prelu(x, w),), (aligned(common), weight), common, (common,)), x, w)
    return out


def _glu(func, types, args, kwargs):
    meta_output(func, args, kwargs)
    x, dim = _args(("input", "dim"), {"dim": -1}, args, kwargs)
    d = normalize_dim(dim, x.ndim)
    common = unshard_target(x._spec, (d,))
    shape = list(common.global_shape)
    shape[d] //= 2
    out_spec = spec_of(common, common.placements, shape, x.dtype, common.dim_sizes)
    (out,) = local_call(Job(lambda x: (F.glu(x, d),), (aligned(common),), common, (out_spec,)), x)
    return out


def _multiples(spec, dim, multiple):
    """``spec`` with the shards of ``dim`` re-split into multiples of ``multiple`` (itself if they are)."""
    table = spec.dim_sizes[dim]
    if table is None or all(s % multiple == 0 for s in table):
        return spec
    extent = spec.global_shape[dim]
    tables = list(spec.dim_sizes)
    tables[dim] = tuple(k * multiple for k in chunk_sizes(extent // multiple, len(table)))
    return spec.with_layout(spec.placements, tuple(tables))


def _scaled(table, numerator, denominator):
    return None if table is None else tuple(s * numerator // denominator for s in table)


def _pixel(unshuffle):
    names = ("input", "downscale_factor" if unshuffle else "upscale_factor")

    def handler(func, types, args, kwargs):
        meta = meta_output(func, args, kwargs)
        x, r = _args(names, {}, args, kwargs)
        n = x.ndim
        c, h, w = n - 3, n - 2, n - 1
        common = resolved(x._spec)
        if unshuffle:
            common = _multiples(_multiples(common, h, r), w, r)
            up, down = (r * r, 1), (1, r)
        else:
            common = _multiples(common, c, r * r)
            up, down = (1, r * r), (r, 1)
        tables = list(common.dim_sizes)
        tables[c] = _scaled(tables[c], *up)
        tables[h], tables[w] = _scaled(tables[h], *down), _scaled(tables[w], *down)
        out_spec = spec_of(common, common.placements, tuple(meta.shape), x.dtype, tables)
        local_shape = tuple(out_spec.local_shape)

        def fn(x):  # torch's backward of an empty pixel_(un)shuffle returns the wrong shape: reshape instead
            return (func(x, r) if x.numel() else x.reshape(local_shape),)

        (out,) = local_call(Job(fn, (aligned(common),), common, (out_spec,)), x)
        return out

    return handler


#: No ATen-level rules: every op here is handled above autograd.
RULES: dict = {}

FUNCTIONS = {
    F.prelu: _prelu,
    torch.Tensor.prelu: _prelu,
    F.glu: _glu,
    F.pixel_shuffle: _pixel(False),
    F.pixel_unshuffle: _pixel(True),
}
