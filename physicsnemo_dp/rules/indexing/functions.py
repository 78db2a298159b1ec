"""Function-level handlers: reads whose ATen backward would materialise full-size gradients.

ATen's backward of ``index``/``index_select``/``gather`` starts from
``grad.new_zeros(x.shape)``: a tensor of the *global* shape on every rank,
because the output gradient cannot know ``x``'s layout. These autograd
Functions keep the forward's plan instead and scatter the output gradient
straight into ``x``'s own boxes (no communication, no full-size buffer).

``x[...]`` is split the way torch splits it: ints, slices, ``None`` and
``...`` are basic indexing (views, via the default path), the tensors that
remain form one advanced-indexing call on the view.
"""

from __future__ import annotations

import torch

from ..._torch_compat import Function, non_differentiable, torch_function_disabled
from ...rule_kit import broadcast_shape, shard_tensor_cls
from ._common import as_shard, mesh_of, replicated_local
from .masks import is_mask, mask_position, mask_read, mask_read_backward, plan_mask
from .read import gather, gather_backward, plan_gather, plan_read, read, read_backward, select_indices


def _default(func, args, kwargs):
    with torch_function_disabled():
        return func(*args, **kwargs)


def _specs(x, indices):
    mesh = x._spec.mesh
    return [None if t is None else as_shard(t, mesh)._spec for t in indices]


# --------------------------------------------------------------------------- #
# autograd Functions (forward + setup_context style)
# --------------------------------------------------------------------------- #
class IndexRead(Function):
    """``x[indices]`` with integer index tensors (``None`` for dims not indexed)."""

    @staticmethod
    def forward(x, indices, allow_negative):
        out, _, idx, owned = read(x, list(indices), allow_negative)
        extras = [t for t in idx if t is not None] + ([owned] if owned is not None else [])
        return (out, *extras)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, indices, allow_negative = inputs
        ctx.plan = plan_read(x._spec, _specs(x, indices), allow_negative)
        extras = output[1:]
        non_differentiable(ctx, *extras)
        ctx.save_for_backward(*extras)

    @staticmethod
    def backward(ctx, grad, *_):
        plan = ctx.plan
        saved = list(ctx.saved_tensors)
        owned = saved.pop() if plan.owners else None
        idx = [None] * (plan.positions[-1] + 1)
        for d, t in zip(plan.positions, saved):
            idx[d] = t
        return read_backward(plan, grad, idx, owned), None, None


class Gather(Function):
    @staticmethod
    def forward(x, dim, index):
        out, plan, idx, owned = gather(x, dim, index)
        return (out, idx) if owned is None else (out, idx, owned)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dim, index = inputs
        mesh = x._spec.mesh
        ctx.plan = plan_gather(x._spec, dim % max(x.ndim, 1), as_shard(index, mesh)._spec)
        non_differentiable(ctx, *output[1:])
        ctx.save_for_backward(*output[1:])

    @staticmethod
    def backward(ctx, grad, *_):
        idx, *owned = ctx.saved_tensors
        return gather_backward(ctx.plan, grad, idx, owned[0] if owned else None), None, None


class MaskRead(Function):
    """``x[mask]`` with one boolean mask over dims ``p .. p + mask.ndim - 1``."""

    @staticmethod
    def forward(x, p, mask):
        out, _, m_local = mask_read(x, [None] * p + [mask])
        return out, m_local

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, p, mask = inputs
        ctx.plan = plan_mask(x._spec, as_shard(mask, x._spec.mesh)._spec, p)
        ctx.input_spec = x._spec
        ctx.out_spec = output[0]._spec
        non_differentiable(ctx, output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        (m_local,) = ctx.saved_tensors
        return mask_read_backward(ctx.plan, ctx.out_spec, grad, m_local, ctx.input_spec), None, None


# --------------------------------------------------------------------------- #
# handlers
# --------------------------------------------------------------------------- #
def _bind(args, kwargs, names):
    values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(values) != len(names) or set(kwargs) - set(names):
        return None
    return values


def _index_select(func, types, args, kwargs):
    bound = _bind(args, kwargs, ("input", "dim", "index"))
    if bound is None or not isinstance(bound[1], int):
        return _default(func, args, kwargs)
    x, dim, index = bound
    x = as_shard(x, mesh_of(x, index))
    return IndexRead.apply(x, tuple(select_indices(x, dim, index)), False)[0]


def _gather(func, types, args, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if not (k == "sparse_grad" and v is False)}
    bound = _bind(args, kwargs, ("input", "dim", "index"))
    if bound is None or not isinstance(bound[1], int):
        return _default(func, args, kwargs)
    x, dim, index = bound
    return Gather.apply(as_shard(x, mesh_of(x, index)), dim, index)[0]


def _masked_select(func, types, args, kwargs):
    bound = _bind(args, kwargs, ("input", "mask"))
    if bound is None:
        return _default(func, args, kwargs)
    x, mask = bound
    mesh = mesh_of(x, mask)
    x, mask = as_shard(x, mesh), as_shard(mask, mesh)
    shape = broadcast_shape(tuple(x.shape), tuple(mask.shape))
    if tuple(x.shape) != shape:
        x = x.expand(shape)
    if tuple(mask.shape) != shape:
        mask = as_shard(replicated_local(mask).expand(shape), mesh)
    return MaskRead.apply(x, 0, mask)[0]


def _split_index(x, index):
    """``(basic, advanced)``: a basic index for a view of ``x`` and the tensor indices on that view.

    Returns None when torch's own path should handle it (no tensors; bool scalars).
    """
    ShardTensor = shard_tensor_cls()
    items = index if isinstance(index, tuple) else (index,)
    items = tuple(torch.tensor(i) if isinstance(i, list) else i for i in items)
    items = tuple(
        (int(i._local_tensor) if isinstance(i, ShardTensor) else int(i))
        if isinstance(i, torch.Tensor) and i.ndim == 0 and not is_mask(i) else i
        for i in items
    )
    tensors = [i for i in items if isinstance(i, torch.Tensor)]
    if not tensors or any(isinstance(i, bool) or (is_mask(i) and i.ndim == 0) for i in items):
        return None
    consumed = sum(1 if not isinstance(i, torch.Tensor) else (i.ndim if is_mask(i) else 1)
                   for i in items if i is not None and i is not Ellipsis)
    basic, advanced, dim = [], [], 0
    for item in items:
        if item is Ellipsis:
            basic.append(Ellipsis)
            dim += x.ndim - consumed
        elif isinstance(item, torch.Tensor):
            width = item.ndim if is_mask(item) else 1
            basic.extend([slice(None)] * width)
            advanced.extend([None] * (dim - len(advanced)) + [item])
            dim += width
        elif isinstance(item, int):
            basic.append(item)
        elif item is None or isinstance(item, slice):  # one dim of the view
            basic.append(item)
            dim += 1
        else:  # e.g. a NumPy array: torch's own path converts it
            return None
    return tuple(basic), advanced


def _is_identity(basic) -> bool:
    return all(i is Ellipsis or i == slice(None) for i in basic)


def _getitem(func, types, args, kwargs):
    x, index = args
    ShardTensor = shard_tensor_cls()
    split = _split_index(x, index) if isinstance(x, ShardTensor) else None
    if split is None:
        return _default(func, args, kwargs)
    basic, advanced = split
    view = x if _is_identity(basic) else x[basic]
    p = mask_position(advanced)
    if p is not None:
        return MaskRead.apply(view, p, advanced[p])[0]
    return IndexRead.apply(view, tuple(advanced), True)[0]


FUNCTIONS = {
    torch.index_select: _index_select,
    torch.Tensor.index_select: _index_select,
    torch.gather: _gather,
    torch.Tensor.gather: _gather,
    torch.masked_select: _masked_select,
    torch.Tensor.masked_select: _masked_select,
    torch.Tensor.__getitem__: _getitem,
}
