"""Order statistics along a dim: ``median``, ``nanmedian``, ``mode``, ``kthvalue``; global ``median``.

Along a dim that is not sharded each is local: every rank holds whole rows,
values and indices are one process's (the indices count along a whole dim,
so they are global). Along a sharded dim the shard first moves to another dim
(one all-to-all, ``unshard_dims``; a gather, all-gather-v, when no other dim
is at least as long as the mesh dim), then the op runs locally. The reduced
dim is gone (or has extent 1 with ``keepdim``), so the results **stay in that
layout**: sharded along the dim the shard moved to.

The backward (``FUNCTIONS``, above autograd: torch's formula scatters into a
plain full-size ``zeros``) puts each gradient at its index on the layout the
forward ran on, then brings it to the input's gradient layout: none along an
unsharded dim, one all-to-all back along a sharded one.

``torch.median(x)`` / ``torch.nanmedian(x)`` without a dim (the median of
every element) **gather** the whole tensor on every rank (all-gather-v over
each sharded mesh dim, O(global) memory per rank), then compute it locally:
a replicated 0-d result. Its gradient is torch's formula (shared evenly among
the elements equal to the median), run by the pointwise and reduction rules.
Prefer ``x.flatten()`` sharded + a dim form where memory matters.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate

from ..._redistribute import grad_layout
from ..._torch_compat import Function, non_differentiable, once_differentiable, torch_function_disabled
from ...rule_kit import bind_args, meta_output, normalize_dim, shard_tensor_cls, to_layout, unshard_dims, wrap
from ..views import derived_spec, without_dim
from ._common import local_as, move, resized

aten = torch.ops.aten


def _along_dim(func, args, kwargs):
    """values, indices of ``func`` along ``dim``, and the layout the op ran on."""
    meta_output(func, args, kwargs)  # torch's checks (dim, k in range, empty dims), alike on every rank
    b = bind_args(func, args, kwargs)
    x = b["self"]
    ndim = len(x._spec.global_shape)
    d = normalize_dim(b["dim"], ndim)
    local, spec = unshard_dims(x, [d] if ndim else [])
    values, indices = func(local, **{k: v for k, v in b.items() if k != "self"})
    if ndim == 0:
        out = spec
    elif b["keepdim"]:
        out = resized(spec, d, 1, unshard=False)
    else:
        placements, tables = without_dim(spec.placements, spec.dim_sizes, d)
        shape = spec.global_shape[:d] + spec.global_shape[d + 1 :]
        out = derived_spec(spec, placements, shape, tables)
    return (
        wrap(values, out),
        wrap(indices, type(out).from_sizes(out.mesh, out.placements, out.global_shape, torch.int64, out.dim_sizes)),
        spec,
    )


def _rule(func, args, kwargs):
    values, indices, _ = _along_dim(func, args, kwargs)
    return values, indices


def _global(func, args, kwargs):
    """median / nanmedian of every element: gathered on every rank, a replicated 0-d result."""
    meta = meta_output(func, args, kwargs)
    x = args[0]
    spec = x._spec
    whole = spec.with_layout((Replicate(),) * spec.mesh.ndim, (None,) * len(spec.global_shape))
    value = func(to_layout(x, whole))
    out = type(spec).from_sizes(spec.mesh, whole.placements, tuple(meta.shape), value.dtype, ())
    return wrap(value, out)


class _Pick(Function):
    """``(x, func, kwargs) -> (values, indices)``: the rule forward, a scatter backward on the forward's layout."""

    @staticmethod
    def forward(x, func, kwargs):
        return _along_dim(func, (x,), dict(kwargs))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, func, kwargs = inputs
        values, indices, spec = output
        non_differentiable(ctx, indices)
        ctx.save_for_backward(indices)
        kw = dict(kwargs)
        ctx.dim = normalize_dim(kw["dim"], max(x.ndim, 1)) if x.ndim else None
        ctx.keepdim, ctx.spec, ctx.values_spec, ctx.x_spec = kw["keepdim"], spec, values._spec, x._spec

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, *_):
        (indices,) = ctx.saved_tensors
        g = local_as(grad, ctx.values_spec) if isinstance(grad, shard_tensor_cls()) else grad
        spec, target = ctx.spec, grad_layout(ctx.x_spec)
        if ctx.dim is None:  # a 0-d input: the gradient is the gradient
            return wrap(move(g.reshape(spec.local_shape), spec, target), target), None, None
        idx = indices._local_tensor
        if not ctx.keepdim:
            g, idx = g.unsqueeze(ctx.dim), idx.unsqueeze(ctx.dim)
        local = g.new_zeros(tuple(spec.local_shape)).scatter_(ctx.dim, idx, g)
        return wrap(move(local, spec, target), target), None, None


def _handler(func, signature, result_type):
    def handler(python_func, types, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        try:
            named = signature(*args[1:], **{k: v for k, v in kwargs.items() if k != "input"})
        except TypeError:
            named = None
        if named is None or not isinstance(x, shard_tensor_cls()) or not isinstance(named.get("dim"), int):
            with torch_function_disabled():  # global median, named dims, out=: the ATen rules (or torch's error)
                return python_func(*args, **kwargs)
        values, indices, _ = _Pick.apply(x, func, tuple(sorted(named.items())))
        return result_type((values, indices))

    return handler


def _median_signature(dim=None, keepdim=False):
    return None if dim is None else dict(dim=dim, keepdim=keepdim)


_OPS = {
    (torch.median, torch.Tensor.median): (aten.median.dim, _median_signature, torch.return_types.median),
    (torch.nanmedian, torch.Tensor.nanmedian): (aten.nanmedian.dim, _median_signature, torch.return_types.nanmedian),
    (torch.mode, torch.Tensor.mode): (
        aten.mode.default,
        lambda dim=-1, keepdim=False: dict(dim=dim, keepdim=keepdim),
        torch.return_types.mode,
    ),
    (torch.kthvalue, torch.Tensor.kthvalue): (
        aten.kthvalue.default,
        lambda k, dim=-1, keepdim=False: dict(k=k, dim=dim, keepdim=keepdim),
        torch.return_types.kthvalue,
    ),
}

RULES = {
    aten.median.dim: _rule,
    aten.nanmedian.dim: _rule,
    aten.mode.default: _rule,
    aten.kthvalue.default: _rule,
    aten.median.default: _global,
    aten.nanmedian.default: _global,
}
FUNCTIONS = {f: _handler(*spec) for funcs, spec in _OPS.items() for f in funcs}
