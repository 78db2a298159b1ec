"""Elementwise ops with broadcasting, on any mix of layouts.

The output takes the layout (placements and shard sizes) of the first
ShardTensor operand that has the output's full shape — for in-place ops, of
``self``. Every other operand is brought to that layout: same-shape
ShardTensors are redistributed; broadcasting ones take the output's sharding
along the dims they share and are replicated along the dims they broadcast;
plain tensors are sliced to the local box (no communication for the usual
cases: a bias, a scale, a mask, a reduced statistic kept with keepdim).

Pending reductions (``Partial``) survive only where the op is linear in them:
``a + b``, ``a - b`` and ``torch.complex(a, b)`` with both pending, ``a * r``
and ``a / r`` with one pending and the rest not, ``-a`` and ``a.conj()``.
Anything else reduces first, so ``Partial`` keeps meaning "sum the
contributions to get the value".

Complex tensors: ``x.conj()`` (``aten._conj``) and ``aten._neg_view`` are lazy
views in torch (a bit on the tensor, no copy). Rules run local kernels inside
``__torch_dispatch__``, where torch excludes the Conjugate and Negative keys
that normally resolve such bits, so most kernels would silently read the raw
memory. A local tensor therefore never keeps a bit: ShardTensor's constructor
resolves it (a copy, ``conj_physical``'s cost). The ShardTensor itself never
carries the bit either: ``is_conj()`` is False, ``resolve_conj()`` returns it
as is, and ``x.conj()`` does not alias ``x``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._torch_compat import pytree
from ..rule_kit import broadcast_shape, replicated_to_box, resolve_partial, shard_tensor_cls, to_layout, wrap

_ADDITIVE = {"add", "add_", "sub", "sub_", "complex"}
#: Linear in their one pending operand (conjugation too: conj(a + b) = conj(a) + conj(b)).
_SCALING = {"mul", "mul_", "div", "div_", "neg", "neg_", "_neg_view", "_conj", "_conj_physical", "conj_physical_"}


def _keeps_partial(func, operands, m: int, reduce_op: str) -> bool:
    """Whether the op commutes with the pending reduction on mesh dim ``m``."""
    if reduce_op not in ("sum", "avg"):
        return False
    name = func.overloadpacket.__name__
    ShardTensor = shard_tensor_cls()

    def pending(x):
        return isinstance(x, ShardTensor) and x._spec.placements[m] == Partial(reduce_op)

    if name in _ADDITIVE:
        return all(pending(x) for x in operands)
    if name in _SCALING:
        flags = [pending(x) for x in operands]
        if name.startswith("div"):
            return flags[0] and not any(flags[1:])
        return sum(flags) == 1
    return False


def _output_spec(func, ref, operands):
    placements = []
    for m, p in enumerate(ref._spec.placements):
        if isinstance(p, Partial) and _keeps_partial(func, operands, m, p.reduce_op):
            placements.append(p)
        elif isinstance(p, Partial):
            placements.append(Replicate())
        else:
            placements.append(p)
    placements = tuple(placements)
    if placements == ref._spec.placements:
        return ref._spec
    return ref._spec.with_layout(placements, ref._spec.dim_sizes)


def _operand_target(x, out_spec):
    """Layout operand ``x`` must have: the output's, keeping its own pending sums where the output pends."""
    placements = []
    for m, p in enumerate(out_spec.placements):
        mine = x._spec.placements[m]
        if isinstance(p, Partial):
            placements.append(p if mine == p else Replicate())
        else:
            placements.append(p)
    return out_spec.with_layout(tuple(placements), out_spec.dim_sizes)


def _broadcast_local(x, out_spec):
    """Local tensor of a ShardTensor operand that broadcasts against the output.

    Along dims where the operand has the output's full extent it takes the
    output's sharding and sizes (no data moves if it is already laid out so);
    along dims it broadcasts (extent 1, or missing) it is replicated. Pending
    sums the output keeps stay pending.
    """
    offset = len(out_spec.global_shape) - len(x._spec.global_shape)
    placements, tables = [], [None] * len(x._spec.global_shape)
    for m, p in enumerate(out_spec.placements):
        if isinstance(p, Partial):
            placements.append(p if x._spec.placements[m] == p else Replicate())
            continue
        e = p.dim - offset if isinstance(p, Shard) else -1
        if e >= 0 and x._spec.global_shape[e] == out_spec.global_shape[p.dim]:
            placements.append(Shard(e))
            tables[e] = out_spec.dim_sizes[p.dim]
        else:
            placements.append(Replicate())
    spec = x._spec.with_layout(tuple(placements), tuple(tables))
    return to_layout(x, spec)


def _same_spec_fast_path(func, args, kwargs, ShardTensor):
    """Result for the common call, or None: every ShardTensor shares one spec, no pending sums,
    the rest are Python scalars or 0-d tensors."""
    spec = None
    local_args = []
    for a in args:
        if type(a) is ShardTensor:
            if spec is None:
                spec = a._spec
            elif a._spec is not spec:
                return None
            local_args.append(a._local_tensor)
        elif isinstance(a, torch.Tensor):
            if a.ndim:
                return None
            local_args.append(a)
        elif isinstance(a, (list, tuple)):
            return None
        else:
            local_args.append(a)
    if spec is None or spec.has_partial or kwargs and any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    local = func(*local_args, **kwargs)
    if _is_mutable(func) and type(args[0]) is ShardTensor:
        return args[0]
    return _wrap_result(local, spec)


_MUTABLE: dict = {}


def _is_mutable(func) -> bool:
    """``func._schema.is_mutable``, memoised (ops are fixed objects; the schema lookup is not free)."""
    try:
        return _MUTABLE[func]
    except KeyError:
        mutable = _MUTABLE[func] = func._schema.is_mutable
        return mutable


def pointwise_rule(func, args, kwargs):
    ShardTensor = shard_tensor_cls()
    fast = _same_spec_fast_path(func, args, kwargs, ShardTensor)
    if fast is not None:
        return fast
    flat, tree = pytree.tree_flatten((args, kwargs))
    shards = [x for x in flat if isinstance(x, ShardTensor)]
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    out_shape = broadcast_shape(*(tuple(t.shape) for t in tensors))
    in_place = func._schema.is_mutable and isinstance(args[0], ShardTensor)

    if in_place:
        ref = args[0]
        if tuple(ref.shape) != tuple(out_shape):
            raise RuntimeError(f"{func}: in-place output of shape {tuple(ref.shape)} cannot broadcast to {tuple(out_shape)}")
    else:
        full = [x for x in shards if tuple(x.shape) == tuple(out_shape)]
        ref = next((x for x in full if any(p.is_shard() for p in x._spec.placements)), full[0] if full else None)
    if ref is None:  # every ShardTensor broadcasts: compute on replicated data
        spec = shards[0]._spec
        out_spec = type(spec).chunked(
            spec.mesh, (Replicate(),) * spec.mesh.ndim, out_shape, spec.tensor_meta.dtype
        )
        local_args = [_broadcast_local(x, out_spec) if isinstance(x, ShardTensor) else x for x in flat]
        largs, lkwargs = _rebuild(local_args, tree)
        return _wrap_result(func(*largs, **lkwargs), out_spec)

    operands = [x for x in flat if isinstance(x, torch.Tensor) or isinstance(x, (int, float, complex, bool))]
    out_spec = _output_spec(func, ref, operands)
    if in_place and out_spec != ref._spec:
        ref._local_tensor, ref._spec = resolve_partial(ref)
    local_args = []
    for x in flat:
        if isinstance(x, ShardTensor):
            if tuple(x.shape) == tuple(out_shape):
                local_args.append(to_layout(x, _operand_target(x, out_spec)))
            else:
                local_args.append(_broadcast_local(x, out_spec))
        elif isinstance(x, torch.Tensor) and x.ndim > 0:
            local_args.append(replicated_to_box(x, out_spec))
        else:
            local_args.append(x)
    largs, lkwargs = _rebuild(local_args, tree)
    result = func(*largs, **lkwargs)
    if in_place:
        return ref
    return _wrap_result(result, out_spec)


def _rebuild(flat, tree):
    return pytree.tree_unflatten(flat, tree)


def _wrap_result(result, spec):
    if isinstance(result, (tuple, list)):
        return type(result)(wrap(r, spec) for r in result)
    return wrap(result, spec)


aten = torch.ops.aten

#: Elementwise ops that lack ATen's ``pointwise`` tag (``_conj``/``_neg_view``: the lazy views behind
#: ``conj()`` and ``imag`` of a conjugate; the constructor resolves the bit they set, see above).
RULES: dict = {
    op: pointwise_rule
    for op in (
        aten.complex.default,
        aten.polar.default,
        aten._conj.default,
        aten._neg_view.default,
        aten.masked_fill_.Scalar,
        aten.masked_fill_.Tensor,
        aten.masked_fill.Tensor,
        aten.native_dropout.default,
        aten.bernoulli_.float,
        aten.bernoulli.default,
        aten.hardtanh_backward.default,
        aten.leaky_relu_backward.default,
        aten.elu_backward.default,
        aten.softplus_backward.default,
        aten.softshrink_backward.default,
        aten.hardshrink_backward.default,
    )
}
