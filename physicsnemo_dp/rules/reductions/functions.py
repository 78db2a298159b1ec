"""Function-level handlers of reductions whose ATen backward would not stay in the input's layout.

ATen differentiates ``sum``/``mean``/``nansum`` with ``grad.expand(input
shape)``: on a ShardTensor that is a full-size tensor on every rank (P times a
shard). ``max(dim)``/``min(dim)`` scatter into ``new_zeros(input shape)`` (full
size again), and ``prod`` reshapes to 1-D and runs ``cumprod`` across the
shards. The autograd Functions here run the same forward (the dispatch rules)
but build each gradient directly in the input's layout, from the output
gradient brought to the kept-dims layout (``_combine.kept_grad``):

* ``sum``/``mean``: a local expand of it (divided by the global count);
  ``nansum``: the same, zero where the input is NaN. No communication beyond
  resolving a pending gradient.
* ``max(dim)``/``min(dim)``: the gradient lands where the global index of the
  winner falls inside this rank's slice. No communication.
* ``prod``: product of the *other* elements, from the global product of the
  non-zero elements and the global number of zeros (one all-gather and one
  all-reduce of reduced-size statistics) — exact with zeros, like torch.

``nanmean``, ``var_mean`` and ``std_mean`` are compositions of handled calls.
Anything these handlers do not recognise (``out=``, named dims, the binary
``max(a, b)``) takes the ordinary path to the dispatch rules.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..._redistribute import grad_layout
from ..._torch_compat import (
    Function,
    any_autocast_enabled,
    dispatch_mode_active,
    non_differentiable,
    torch_function_disabled,
)
from ...dispatch.registry import dispatch_handlers_registered, function_handlers
from ...rule_kit import shard_tensor_cls, wrap
from ._combine import all_reduce_sum, gather_combine, kept_grad
from ._layout import Reduction, reduced_dims
from .rules import _sum_like

aten = torch.ops.aten


def _default(func, args, kwargs):
    """The call as if no handler existed: straight to the dispatch rules."""
    with torch_function_disabled():
        return func(*args, **kwargs)


def _dims(dim):
    """``dim`` as the ATen ops take it (None, or a tuple of ints); False for names."""
    if dim is None or isinstance(dim, int):
        return dim if dim is None else (dim,)
    dims = tuple(dim)
    return dims if all(isinstance(d, int) for d in dims) else False


def _resolved(x):
    """``x`` with pending reductions done (differentiably), for backwards that read its values."""
    placements = x._spec.placements
    if not any(issubclass(type(p), Partial) for p in placements):
        return x
    return x.redistribute(placements=[Replicate() if issubclass(type(p), Partial) else p for p in placements])


# --------------------------------------------------------------------------- #
# sum / mean / nansum
# --------------------------------------------------------------------------- #
_LINEAR_OPS = {"sum": aten.sum.dim_IntList, "mean": aten.mean.dim, "nansum": aten.nansum.default}


def _intercepted(op) -> bool:
    """Whether something must see ``op`` on the ShardTensor itself: a handler, a dispatch mode, autocast."""
    return (
        dispatch_handlers_registered() or dispatch_mode_active() or any_autocast_enabled()
        or function_handlers.get(op) is not None
    )  # fmt: skip


class LinearReduction(Function):
    """``sum``/``mean``/``nansum`` whose gradient is a local expand in the input's layout."""

    @staticmethod
    def forward(x, kind, dims, keepdim, dtype):
        op = _LINEAR_OPS[kind]
        if _intercepted(op):
            return op(x, None if dims is None else list(dims), keepdim, dtype=dtype)
        # The op's dispatch rule, called as ``__torch_dispatch__`` would call it (the dispatcher drops
        # trailing arguments that equal their defaults): the same plan and result without the trip through
        # the torch-function hook and the dispatcher (~15 us of a ~90 us ``mean``).
        args = (x,) if dims is None and not keepdim and kind == "nansum" else (x, None if dims is None else list(dims))
        return _sum_like(op, (*args, True) if keepdim else args, {} if dtype is None else {"dtype": dtype})

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kind, dims, keepdim, _ = inputs
        spec = x._spec  # ndim and dtype from the spec: ``x.ndim``/``x.dtype`` go through __torch_function__
        ctx.red = Reduction(spec, reduced_dims(dims, len(spec.global_shape)), keepdim)
        ctx.kind, ctx.dtype = kind, spec.tensor_meta.dtype
        if kind == "nansum":
            ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad):
        red = ctx.red
        g = kept_grad(grad, red).to(ctx.dtype)
        if ctx.kind == "mean":
            g = g / red.count
        if ctx.kind == "nansum":
            (x,) = ctx.saved_tensors
            local = torch.where(x._local_tensor.isnan(), 0, g)
        else:
            # dense: autograd may accumulate into it in place
            local = g.expand(red.spec.local_shape).contiguous()
        return wrap(local, grad_layout(red.spec)), None, None, None, None


def _sum_signature(input, dim=None, keepdim=False, *, dtype=None):
    return input, dim, keepdim, dtype


def _linear_handler(kind):
    def handler(func, types, args, kwargs):
        bound = _bind(_sum_signature, args, kwargs)
        dims = _dims(bound[1]) if bound else False
        if dims is False:
            return _default(func, args, kwargs)
        x, _, keepdim, dtype = bound
        if kind == "nansum":
            x = _resolved(x)
        return LinearReduction.apply(x, kind, dims, bool(keepdim), dtype)

    return handler


def _nanmean(func, types, args, kwargs):
    bound = _bind(_sum_signature, args, kwargs)
    if not bound or _dims(bound[1]) is False:
        return _default(func, args, kwargs)
    x, dim, keepdim, dtype = bound
    return torch.nansum(x, dim, keepdim, dtype=dtype) / (~torch.isnan(x)).sum(dim, keepdim)


# --------------------------------------------------------------------------- #
# max(dim) / min(dim)
# --------------------------------------------------------------------------- #
class BestAlongDim(Function):
    """``max``/``min`` along one dim; the gradient goes to the winner's place in the input's layout."""

    @staticmethod
    def forward(x, largest, dim, keepdim):
        return (aten.max.dim if largest else aten.min.dim)(x, dim, keepdim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, dim, keepdim = inputs
        ctx.red = Reduction(x._spec, reduced_dims(dim, len(x._spec.global_shape)), keepdim)
        non_differentiable(ctx, output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        red = ctx.red
        (indices,) = ctx.saved_tensors
        g = kept_grad(grad, red)
        if red.dims:
            d = red.dims[0]
            n, start = red.spec.local_shape[d], red.spec.local_offsets()[d]
            position = torch.arange(start, start + n, device=g.device)
            position = position.reshape([n if k == d else 1 for k in range(g.ndim)])
            g = torch.where(position == kept_grad(indices, red), g, 0)
        return wrap(g, grad_layout(red.spec)), None, None, None


def _best_signature(input, dim=None, keepdim=False):
    return input, dim, keepdim


def _best_handler(largest: bool):
    def handler(func, types, args, kwargs):
        bound = _bind(_best_signature, args, kwargs)
        if not bound or not isinstance(bound[1], int) or isinstance(bound[1], bool):
            return _default(func, args, kwargs)  # full reduction, binary max, names, out=
        x, dim, keepdim = bound
        values, indices = BestAlongDim.apply(x, largest, dim, bool(keepdim))
        return (torch.return_types.max if largest else torch.return_types.min)((values, indices))

    return handler


# --------------------------------------------------------------------------- #
# prod
# --------------------------------------------------------------------------- #
class Prod(Function):
    """``prod`` whose gradient (the product of the other elements) is built in the input's layout."""

    @staticmethod
    def forward(x, dim, keepdim, dtype):
        if dim is None:
            return aten.prod.default(x, dtype=dtype)
        return aten.prod.dim_int(x, dim, keepdim, dtype=dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dim, keepdim, _ = inputs
        ctx.red = Reduction(x._spec, reduced_dims(dim, len(x._spec.global_shape)), keepdim and dim is not None)
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad):
        red = ctx.red
        (x,) = ctx.saved_tensors
        g = kept_grad(grad, red)
        local = x._local_tensor.to(g.dtype)
        zero = local == 0
        nonzero = torch.where(zero, 1, local)
        nonzero_prod = nonzero
        for d in red.dims:
            nonzero_prod = nonzero_prod.prod(d, keepdim=True)
        nonzero_prod = gather_combine(nonzero_prod, red, lambda s: s.prod(0))
        zeros = all_reduce_sum(zero.sum(list(red.dims), keepdim=True), red) if red.dims else zero.long()
        others = torch.where(
            zero,
            torch.where(zeros == 1, nonzero_prod, 0),
            torch.where(zeros == 0, nonzero_prod / nonzero, 0),
        )
        return wrap((g * others).to(x.dtype), grad_layout(red.spec)), None, None, None


def _prod(func, types, args, kwargs):
    bound = _bind(_sum_signature, args, kwargs)
    if not bound or not (bound[1] is None or (isinstance(bound[1], int) and not isinstance(bound[1], bool))):
        return _default(func, args, kwargs)
    x, dim, keepdim, dtype = bound
    return Prod.apply(_resolved(x), dim, bool(keepdim), dtype)


# --------------------------------------------------------------------------- #
# var_mean / std_mean
# --------------------------------------------------------------------------- #
def _var_signature(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if isinstance(dim, bool):  # var_mean(x, unbiased)
        dim = None
    return input, dim, keepdim


def _moments_and_mean(func, types, args, kwargs):
    """``(var or std, mean)``: the mean through the sum-like path, so its gradient stays in layout."""
    bound = _bind(_var_signature, args, kwargs)
    if not bound or _dims(bound[1]) is False:
        return _default(func, args, kwargs)
    x, dim, keepdim = bound
    first = (torch.var if func is torch.var_mean else torch.std)(*args, **kwargs)
    return first, torch.mean(x, dim, keepdim)


def _bind(signature, args, kwargs):
    """``signature(*args, **kwargs)`` if the call fits it and its input is a ShardTensor, else None."""
    try:
        bound = signature(*args, **kwargs)
    except TypeError:
        return None
    return bound if isinstance(bound[0], shard_tensor_cls()) else None


FUNCTIONS: dict = {
    **{f: _linear_handler("sum") for f in (torch.sum, torch.Tensor.sum)},
    **{f: _linear_handler("mean") for f in (torch.mean, torch.Tensor.mean)},
    **{f: _linear_handler("nansum") for f in (torch.nansum, torch.Tensor.nansum)},
    **{f: _nanmean for f in (torch.nanmean, torch.Tensor.nanmean)},
    **{f: _best_handler(True) for f in (torch.max, torch.Tensor.max)},
    **{f: _best_handler(False) for f in (torch.min, torch.Tensor.min)},
    **{f: _prod for f in (torch.prod, torch.Tensor.prod)},
    **{f: _moments_and_mean for f in (torch.var_mean, torch.std_mean)},
}
