"""Ops whose output has the input's layout: copies, casts, detaches, ``*_like`` factories.

They run on the local tensor and keep placements and shard sizes. ``Partial``
survives copies and casts (the pending reduction is unchanged) but not
factories: ``zeros_like`` of a pending sum is a plain zero tensor, labelled
Replicate.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from .._torch_compat import plain_eager, torch_function_disabled
from ..dispatch.registry import dispatch_handlers_registered
from ..rule_kit import replicated_to_box, shard_tensor_cls, to_layout, wrap

aten = torch.ops.aten


def _same_layout(func, args, kwargs):
    x, *rest = args
    return wrap(func(x._local_tensor, *rest, **kwargs), x._spec)


def _factory_like(func, args, kwargs):
    x, *rest = args
    return wrap(func(x._local_tensor, *rest, **kwargs), _without_partial(x._spec))


def _new_factory(func, args, kwargs):
    """``x.new_empty(size)`` and friends: laid out like ``x`` where ``size`` keeps ``x``'s sharded extents.

    Autograd uses ``new_empty_strided(param.shape, param.stride())`` to give a
    gradient the parameter's strides, so "same shape" must mean "same layout".
    A size that differs only along unsharded dims (a spectrum buffer with
    other channels or a shorter last dim, ``x.new_zeros(b, c_out, h, w // 2 + 1)``
    for ``x`` sharded along ``h``) is sharded like ``x`` too: no rank allocates
    the global tensor. Any other size is a new replicated tensor.
    """
    x, size, *rest = args
    size = tuple(size)
    spec = x._spec
    if len(size) == len(spec.global_shape) and all(
        table is None or size[d] == spec.global_shape[d] for d, table in enumerate(spec.dim_sizes)
    ):
        spec = _without_partial(spec)
        if size != tuple(spec.global_shape):
            spec = type(spec).from_sizes(spec.mesh, spec.placements, size, x.dtype, spec.dim_sizes)
        local_size = tuple(spec.local_shape)
    else:
        spec = type(spec).chunked(spec.mesh, (Replicate(),) * spec.mesh.ndim, size, x.dtype)
        local_size = size
    if func in (aten.new_empty_strided.default,):
        rest = [_contiguous_stride(local_size), *rest[1:]]
    return wrap(func(x._local_tensor, local_size, *rest, **kwargs), spec)


def _contiguous_stride(shape):
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _copy_(func, args, kwargs):
    dst, src, *rest = args
    ShardTensor = shard_tensor_cls()
    dst._spec = _without_partial(dst._spec)  # after the copy every element is known
    if isinstance(src, ShardTensor):
        local = to_layout(src, dst._spec)
    else:
        local = replicated_to_box(src, dst._spec) if src.ndim else src
    func(dst._local_tensor, local, *rest, **kwargs)
    return dst


def _in_place_fill(func, args, kwargs):
    """``zero_``: every element becomes known, so pending reductions are gone."""
    x, *rest = args
    func(x._local_tensor, *rest, **kwargs)
    x._spec = _without_partial(x._spec)
    return x


def _without_partial(spec):
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements)
    return spec if placements == spec.placements else spec.with_layout(placements, spec.dim_sizes)


RULES = {
    **{
        op: _same_layout
        for op in (aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default)
    },
    **{
        op: _factory_like
        for op in (
            aten.zeros_like.default,
            aten.ones_like.default,
            aten.empty_like.default,
            aten.full_like.default,
        )  # random *_like ops: rules/random.py (decomposition-invariant values, not a local draw)
    },
    **{
        op: _new_factory
        for op in (
            aten.new_empty.default,
            aten.new_empty_strided.default,
            aten.new_zeros.default,
            aten.new_ones.default,
            aten.new_full.default,
        )
    },
    aten.copy_.default: _copy_,
    aten.zero_.default: _in_place_fill,  # fill/fill_: rules/pointwise.py (a ShardTensor value may be pending)
}


# --------------------------------------------------------------------------- #
# Function level: ``torch.zeros_like(x)`` / ``torch.ones_like(x)`` without a trip through the dispatcher
# --------------------------------------------------------------------------- #
def _like_function(func, types, args, kwargs):
    """``torch.zeros_like(x)`` / ``torch.ones_like(x)`` of a ShardTensor, with no other argument: what the
    dispatch-level rule (:func:`_factory_like`) gives, computed here (no gradient is recorded for a factory, so
    the way down through autograd and the dispatcher, ~8 us a call, does nothing but cost). Any other call, and
    any call a dispatch handler, a dispatch mode, torch.compile or a functorch transform must see, takes that way."""
    if len(args) == 1 and not kwargs and type(args[0]) is shard_tensor_cls() and plain_eager() and not (
        dispatch_handlers_registered()
    ):
        x = args[0]
        return wrap(func(x._local_tensor), _without_partial(x._spec))
    with torch_function_disabled():
        return func(*args, **kwargs)


FUNCTIONS = {torch.zeros_like: _like_function, torch.ones_like: _like_function}
