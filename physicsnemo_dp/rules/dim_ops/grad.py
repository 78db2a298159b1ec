"""Function-level handlers for cumprod, cummax, cummin, sort and topk.

Their ATen backward formulas build a plain full-size ``zeros`` and scatter
into it with the indices (or, for cumprod with zeros, gather and scatter along
the dim), which loses the sharding. Here the forward is the sharded rule of
the op and the backward is written for shards:

* value-selecting ops (cummax, cummin, sort, topk) scatter-add the gradient
  into the positions their forward indices name, on a layout that holds the
  dim whole: the gradient's own when it already does (``topk`` along a
  sharded dim, or any op along an unsharded one: no communication at all),
  otherwise after one all-to-all of the gradient and one of the indices; the
  result comes back to the input's layout (a slice, or one all-to-all);
* ``cumprod`` runs torch's local backward (which handles zeros) on the
  layout of ``unshard_dims`` (input and gradient moved by one all-to-all each,
  the op recomputed locally, the gradient moved back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._redistribute import grad_layout
from ..._torch_compat import Function, non_differentiable, once_differentiable, torch_function_disabled
from ...rule_kit import normalize_dim, shard_tensor_cls, unshard_dims, wrap
from . import scans, select
from ._common import local_as, move

aten = torch.ops.aten


@dataclass(frozen=True)
class _DimOp:
    """One ATen call along ``dim``: the op, its sharded rule and its keyword arguments."""

    func: object
    rule: object
    kwargs: tuple  # (name, value) pairs, including "dim"

    def local(self, t):
        return self.func(t, **dict(self.kwargs))


class _AlongDim(Function):
    @staticmethod
    def forward(x, op: _DimOp):
        return op.rule(op.func, (x,), dict(op.kwargs))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, op = inputs
        ctx.op = op
        if isinstance(output, tuple):  # (values, indices): the indices say where gradients go
            non_differentiable(ctx, *output[1:])
            ctx.save_for_backward(x, output[1])
            ctx.values_spec = output[0]._spec
        else:
            ctx.save_for_backward(x)
            ctx.values_spec = output._spec

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, *_):
        x, *indices = ctx.saved_tensors
        d = normalize_dim(dict(ctx.op.kwargs)["dim"], x.ndim)
        if not isinstance(grad, shard_tensor_cls()):
            grad = wrap(grad, grad_layout(ctx.values_spec))
        if indices:
            local, spec = _scatter_back(grad, indices[0], x, d)
        else:
            local, spec = _local_backward(ctx.op, grad, x, d)
        target = grad_layout(x._spec)
        return wrap(move(local, spec, target), target), None


def _scatter_back(grad, indices, x, d):
    """Gradient of a value-selecting op: ``grad`` added at the positions ``indices`` name."""
    g_local, g_spec = unshard_dims(grad, [d])
    spec = type(g_spec).from_sizes(g_spec.mesh, g_spec.placements, x._spec.global_shape, grad.dtype, g_spec.dim_sizes)
    local = g_local.new_zeros(tuple(spec.local_shape)).scatter_add_(d, local_as(indices, g_spec), g_local)
    return local, spec


def _local_backward(op, grad, x, d):
    """torch's own backward of ``op`` on a layout holding dim ``d`` whole (recomputes the op)."""
    u_local, u_spec = unshard_dims(x, [d])
    grad_spec = type(u_spec).from_sizes(u_spec.mesh, u_spec.placements, tuple(grad.shape), grad.dtype, u_spec.dim_sizes)
    with torch.enable_grad():
        leaf = u_local.detach().requires_grad_(True)
        (local,) = torch.autograd.grad(op.local(leaf), leaf, local_as(grad, grad_spec))
    return local, u_spec


def _handler(func, signature, result_type):
    def handler(python_func, types, args, kwargs):
        if "out" in kwargs or not args or not isinstance(args[0], shard_tensor_cls()):
            with torch_function_disabled():
                return python_func(*args, **kwargs)
        named = signature(*args[1:], **kwargs)
        op = _DimOp(func, _RULES[func], tuple(sorted(named.items())))
        out = _AlongDim.apply(args[0], op)
        return result_type(out) if result_type is not None else out

    return handler


_RULES = {**scans.RULES, **select.RULES}

_OPS = {
    (torch.cumprod, torch.Tensor.cumprod): (aten.cumprod.default, lambda dim, *, dtype=None: dict(dim=dim, dtype=dtype), None),
    (torch.cummax, torch.Tensor.cummax): (aten.cummax.default, lambda dim: dict(dim=dim), torch.return_types.cummax),
    (torch.cummin, torch.Tensor.cummin): (aten.cummin.default, lambda dim: dict(dim=dim), torch.return_types.cummin),
    (torch.sort, torch.Tensor.sort): (
        aten.sort.stable,
        lambda dim=-1, descending=False, stable=False: dict(dim=dim, descending=descending, stable=stable),
        torch.return_types.sort,
    ),
    (torch.topk, torch.Tensor.topk): (
        aten.topk.default,
        lambda k, dim=-1, largest=True, sorted=True: dict(k=k, dim=dim, largest=largest, sorted=sorted),
        torch.return_types.topk,
    ),
}

FUNCTIONS = {f: _handler(*spec) for funcs, spec in _OPS.items() for f in funcs}
