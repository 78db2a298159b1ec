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

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._redistribute import redistribute_local
from .._torch_compat import TensorBase, dispatch_mode_active, pytree, torch_function_disabled
from ..dispatch.registry import dispatch_handlers_registered
from ..propagation import OpPlan, redistribution_steps
from ..rule_kit import broadcast_shape, replicated_to_box, shard_tensor_cls, wrap
from ..spec import ShardTensorSpec

_ADDITIVE = {"add", "add_", "sub", "sub_", "rsub", "complex"}
#: Linear in their one pending operand (conjugation too: conj(a + b) = conj(a) + conj(b)).
_SCALING = {"mul", "mul_", "div", "div_", "neg", "neg_", "_neg_view", "_conj", "_conj_physical", "conj_physical_"}


def _keeps_partial(func, descs, m: int, reduce_op: str) -> bool:
    """Whether the op commutes with the pending reduction on mesh dim ``m`` (``descs``: the operands' descriptions)."""
    if reduce_op not in ("sum", "avg"):
        return False
    name = func.overloadpacket.__name__

    def pending(desc):
        return isinstance(desc, ShardTensorSpec) and desc.placements[m] == Partial(reduce_op)

    if name in _ADDITIVE:
        return all(pending(x) for x in descs)
    if name in _SCALING:
        flags = [pending(x) for x in descs]
        if name.startswith("div"):
            return flags[0] and not any(flags[1:])
        return sum(flags) == 1
    return False


def _output_spec(func, ref, descs):
    placements = []
    for m, p in enumerate(ref.placements):
        if issubclass(type(p), Partial) and _keeps_partial(func, descs, m, p.reduce_op):
            placements.append(p)
        elif issubclass(type(p), Partial):
            placements.append(Replicate())
        else:
            placements.append(p)
    placements = tuple(placements)
    if placements == ref.placements:
        return ref
    return ref.with_layout(placements, ref.dim_sizes)


def _operand_target(spec, out_spec):
    """Layout a full-shape operand must have: the output's, keeping its own pending sums where the output pends."""
    placements = []
    for m, p in enumerate(out_spec.placements):
        mine = spec.placements[m]
        if issubclass(type(p), Partial):
            placements.append(p if mine == p else Replicate())
        else:
            placements.append(p)
    return out_spec.with_layout(tuple(placements), out_spec.dim_sizes)


def _broadcast_target(spec, out_spec):
    """Layout of an operand that broadcasts against the output.

    Along dims where the operand has the output's full extent it takes the
    output's sharding and sizes; along dims it broadcasts (extent 1, or
    missing) it is replicated. Pending sums the output keeps stay pending.
    """
    offset = len(out_spec.global_shape) - len(spec.global_shape)
    placements, tables = [], [None] * len(spec.global_shape)
    for m, p in enumerate(out_spec.placements):
        if issubclass(type(p), Partial):
            placements.append(p if spec.placements[m] == p else Replicate())
            continue
        e = p.dim - offset if issubclass(type(p), Shard) else -1
        if e >= 0 and spec.global_shape[e] == out_spec.global_shape[p.dim]:
            placements.append(Shard(e))
            tables[e] = out_spec.dim_sizes[p.dim]
        else:
            placements.append(Replicate())
    return spec.with_layout(tuple(placements), tuple(tables))


def _moved(spec, target):
    """``target``, or None when ``spec`` already has its placements and sizes (nothing to move)."""
    return None if spec.placements == target.placements and spec.dim_sizes == target.dim_sizes else target


@dataclass(frozen=True)
class _Plan:
    """A pointwise call decided from metadata: output spec, and per flat argument what the executor does.

    ``actions[i]`` is None (pass the argument on), ``"box"`` (a plain tensor:
    slice it to the output's box) or a spec (a ShardTensor: its local tensor in
    that layout; the spec itself when it stays). ``resolve`` is set for an
    in-place op whose destination must first lose its pending sums.
    """

    out: ShardTensorSpec
    actions: tuple
    resolve: ShardTensorSpec | None
    plan: OpPlan


@lru_cache(maxsize=4096)
def _propagate(func, descs, in_place: bool) -> _Plan:
    """The pure half of :func:`pointwise_rule`: memoised on the op and its arguments' descriptions.

    ``descs`` has one entry per flat argument: a ShardTensor's spec (size
    tables included, so uneven layouts key apart), ``("tensor", shape)`` for a
    plain tensor, ``("scalar",)`` for a 0-dim plain tensor or a Python
    number, anything else as it is.
    """
    specs = [d for d in descs if isinstance(d, ShardTensorSpec)]
    shapes = [d.global_shape if isinstance(d, ShardTensorSpec) else d[1] for d in descs if _is_tensor_desc(d)]
    out_shape = broadcast_shape(*shapes)
    if in_place:
        ref = descs[0]
        if ref.global_shape != out_shape:
            raise RuntimeError(f"{func}: in-place output of shape {ref.global_shape} cannot broadcast to {out_shape}")
    else:
        full = [d for d in specs if d.global_shape == out_shape]
        ref = next((d for d in full if any(issubclass(type(p), Shard) for p in d.placements)), full[0] if full else None)
    operands = tuple(d for d in descs if _is_tensor_desc(d) or d == ("scalar",))
    resolve = None
    if ref is None:  # every ShardTensor broadcasts: compute on replicated data
        mesh = specs[0].mesh
        out = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, out_shape, specs[0].tensor_meta.dtype)
        actions = tuple(_moved(d, _broadcast_target(d, out)) or d if isinstance(d, ShardTensorSpec) else None for d in descs)
    else:
        out = _output_spec(func, ref, operands)
        if in_place and out != ref:
            resolve = ref.with_layout(tuple(Replicate() if issubclass(type(p), Partial) else p for p in ref.placements), ref.dim_sizes)
        actions = []
        for k, d in enumerate(descs):
            if isinstance(d, ShardTensorSpec):
                src = resolve if (k == 0 and resolve is not None) else d
                if d.global_shape == out_shape:
                    target = _operand_target(src, out)
                else:
                    target = _broadcast_target(src, out)
                actions.append(_moved(src, target) or src)
            elif _is_tensor_desc(d):
                actions.append("box")
            else:
                actions.append(None)
        actions = tuple(actions)
    steps, targets, k = [], [], 0
    for d, a in zip(descs, actions):
        if not _is_tensor_desc(d):
            continue
        if isinstance(d, ShardTensorSpec):
            src = d
            if k == 0 and resolve is not None:
                steps += redistribution_steps(d, resolve, k)
                src = resolve
            if a is not src:
                steps += redistribution_steps(src, a, k)
            targets.append(None if a is d else a)
        else:
            targets.append(None)
        k += 1
    op_plan = OpPlan((out,), tuple(steps), tuple(targets))
    return _Plan(out, actions, resolve, op_plan)


def _is_tensor_desc(d) -> bool:
    return isinstance(d, ShardTensorSpec) or (isinstance(d, tuple) and len(d) == 2 and d[0] == "tensor")


def _describe(x, ShardTensor):
    if type(x) is ShardTensor or isinstance(x, ShardTensor):
        return x._spec
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape)) if x.ndim > 0 else ("scalar",)
    if isinstance(x, (int, float, complex, bool)):
        return ("scalar",)
    return _Opaque(x)


class _Opaque:
    """A non-tensor argument the layout does not depend on (a dtype, a memory format, None): one key for all."""

    __slots__ = ()

    def __new__(cls, value=None):
        return _OPAQUE

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other) -> bool:
        return other is self


_OPAQUE = object.__new__(_Opaque)


def propagate(func, args, kwargs) -> OpPlan:
    """The plan of a pointwise call given by specs (``propagation.plan``'s entry for this family)."""
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    descs = tuple(
        d if isinstance(d, ShardTensorSpec) else ("scalar",) if isinstance(d, (int, float, complex, bool)) else _OPAQUE
        for d in flat
    )
    in_place = func._schema.is_mutable and isinstance(descs[0], ShardTensorSpec)
    return _propagate(func, descs, in_place).plan


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
    """``func._schema.is_mutable``, memoised by the op's ``id`` (ops are fixed objects, kept alive by the entry and
    checked by identity; the schema lookup is not free, and an ``OpOverload``'s ``__hash__`` is a Python call)."""
    hit = _MUTABLE.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    mutable = func._schema.is_mutable
    _MUTABLE[id(func)] = (func, mutable)
    return mutable


_ADD = torch.ops.aten.add.Tensor


def pointwise_rule(func, args, kwargs):
    ShardTensor = shard_tensor_cls()
    if len(args) == 2 and not kwargs:
        # Two ShardTensors of one spec (a residual add, autograd's sum of two gradients of one tensor): the
        # general fast path below without its loop and frames, ~2 us less a call
        a, b = args
        if type(a) is ShardTensor and type(b) is ShardTensor:
            spec = a._spec
            if b._spec is spec and not spec.has_partial:
                local = func(a._local_tensor, b._local_tensor)
                if func is _ADD:
                    return wrap(local, spec)
                if _is_mutable(func):
                    return a
                return wrap(local, spec) if type(local) is torch.Tensor else _wrap_result(local, spec)
    fast = _same_spec_fast_path(func, args, kwargs, ShardTensor)
    if fast is not None:
        return fast
    flat, tree = pytree.tree_flatten((args, kwargs))
    in_place = _is_mutable(func) and isinstance(args[0], ShardTensor)
    plan = _propagate(func, tuple(_describe(x, ShardTensor) for x in flat), in_place)
    if plan.resolve is not None:  # the destination of an in-place op loses its pending sums first
        ref = args[0]
        ref._local_tensor = redistribute_local(ref._local_tensor, ref._spec, plan.resolve)
        ref._spec = plan.resolve
    local_args = []
    for x, action in zip(flat, plan.actions):
        if action is None:
            local_args.append(x)
        elif action == "box":
            local_args.append(replicated_to_box(x, plan.out))
        elif action is x._spec:
            local_args.append(x._local_tensor)
        else:
            local_args.append(redistribute_local(x._local_tensor, x._spec, action))
    largs, lkwargs = _rebuild(local_args, tree)
    result = func(*largs, **lkwargs)
    if in_place:
        return args[0]
    return _wrap_result(result, plan.out)


def _rebuild(flat, tree):
    return pytree.tree_unflatten(flat, tree)


def _wrap_result(result, spec):
    if isinstance(result, (tuple, list)):
        return type(result)(wrap(r, spec) for r in result)
    return wrap(result, spec)


aten = torch.ops.aten


# --------------------------------------------------------------------------- #
# fill: every element becomes the value, so the input's values are never needed
# --------------------------------------------------------------------------- #
def _fill_value(value):
    """The fill value as this rank can use it: a 0-d ShardTensor's local value, its pending sum done."""
    if isinstance(value, shard_tensor_cls()):
        if value.ndim:
            raise RuntimeError(f"fill: the value must be a 0-dimensional tensor, not one of shape {tuple(value.shape)}")
        spec = value._spec
        if spec.has_partial:
            replicated = spec.with_layout(tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements), spec.dim_sizes)
            return redistribute_local(value._local_tensor, spec, replicated)
        return value._local_tensor
    return value


def _without_partial(spec):
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements)
    return spec if placements == spec.placements else spec.with_layout(placements, spec.dim_sizes)


def _fill(func, args, kwargs):
    """``torch.fill(x, v)`` / ``x.fill_(v)``: the input's layout, without its pending sums (nothing moves).

    A pending sum of ``x`` is dropped rather than reduced (every element is
    overwritten); a 0-d ShardTensor value is reduced if pending (one
    all-reduce of one element).
    """
    x, value = args
    if not isinstance(x, shard_tensor_cls()):  # a plain tensor filled with a ShardTensor value
        return func(x, _fill_value(value), **kwargs)
    spec = _without_partial(x._spec)
    local = func(x._local_tensor, _fill_value(value), **kwargs)
    if _is_mutable(func):
        x._spec = spec
        return x
    return wrap(local, spec)


def _propagate_fill(func, args, kwargs) -> OpPlan:
    x, value = args[0], args[1] if len(args) > 1 else kwargs.get("value")
    steps = ()
    if isinstance(value, ShardTensorSpec) and value.has_partial:
        steps = redistribution_steps(value, _without_partial(value), 1)
    return OpPlan((_without_partial(x),), steps, (None, None))


_FILLS = (aten.fill.Scalar, aten.fill.Tensor, aten.fill_.Scalar, aten.fill_.Tensor)

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
        aten.rsub.Tensor,
        aten.floor_divide.default,
        aten.floor_divide.Scalar,
        aten.floor_divide_.Tensor,
        aten.floor_divide_.Scalar,
    )
}
RULES.update(dict.fromkeys(_FILLS, _fill))

# --------------------------------------------------------------------------- #
# Function-level fast path: elementwise calls that record no gradient
# --------------------------------------------------------------------------- #
def _elementwise_handler(func, types, args, kwargs):
    """An elementwise call on ShardTensors of one layout, computed above the dispatcher when nothing is recorded.

    The usual route goes down through autograd and the dispatcher to
    :func:`pointwise_rule`, whose fast path then runs the same function on
    the local tensors and wraps the result in the same spec. When no
    gradient is recorded (grad mode off, or no argument requires grad), no
    dispatch mode watches and no user dispatch handler may claim the ATen op,
    that detour does nothing but cost (about 2 us a call): the function runs
    on the local tensors right here. Anything else takes the usual route.
    """
    ShardTensor = shard_tensor_cls()
    spec, local_args = None, []
    for a in args:
        if type(a) is ShardTensor:
            if spec is None:
                spec = a._spec
            elif a._spec is not spec:
                return _usual(func, args, kwargs)
            local_args.append(a._local_tensor)
        elif isinstance(a, torch.Tensor):
            if a.ndim or a.requires_grad:
                return _usual(func, args, kwargs)
            local_args.append(a)
        elif isinstance(a, (int, float, complex)) and not isinstance(a, bool):  # F.relu(x, True) is in place
            local_args.append(a)
        else:
            return _usual(func, args, kwargs)
    if (
        spec is None or spec.has_partial
        or (kwargs and any(isinstance(v, torch.Tensor) or k in ("out", "inplace") for k, v in kwargs.items()))
        or dispatch_handlers_registered() or dispatch_mode_active()
    ):
        return _usual(func, args, kwargs)
    with torch_function_disabled():
        if torch.is_grad_enabled() and any(type(a) is ShardTensor and _requires_grad(a) for a in args):
            return func(*args, **kwargs)
        return wrap(func(*local_args, **kwargs), spec)


_requires_grad = TensorBase.requires_grad.__get__


def _usual(func, args, kwargs):
    with torch_function_disabled():
        return func(*args, **kwargs)


_nn = torch.nn.functional
#: Out-of-place elementwise functions (each maps to one ATen op tagged pointwise) served by the fast path.
_ELEMENTWISE = (
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__,
    torch.Tensor.__neg__, torch.Tensor.__pow__,
    torch.add, torch.sub, torch.mul, torch.div, torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul,
    torch.Tensor.div, torch.maximum, torch.minimum,
    torch.tanh, torch.sigmoid, torch.relu, torch.exp, torch.log, torch.sin, torch.cos, torch.sqrt, torch.rsqrt,
    torch.abs, torch.neg, torch.erf, torch.Tensor.tanh, torch.Tensor.sigmoid, torch.Tensor.relu, torch.Tensor.exp,
    torch.Tensor.abs, _nn.relu, _nn.gelu, _nn.silu, _nn.sigmoid, _nn.tanh,
)
FUNCTIONS: dict = {f: _elementwise_handler for f in _ELEMENTWISE}


def _sgn(func, types, args, kwargs):
    """``torch.sgn`` of a real tensor is ``torch.sign``, whose backward is ``zeros_like(grad)``.

    ATen's backward of ``sgn`` on a real input is ``_efficientzerotensor(self.sizes())``:
    a factory without tensor arguments, so it never reaches a ShardTensor and
    returns a plain tensor of the *global* shape. ``sign`` gives the same values
    and a gradient laid out like the input. Complex inputs keep ``sgn`` (their
    backward is a pointwise formula).
    """
    x = args[0]
    if isinstance(x, torch.Tensor) and not x.is_complex():
        return _usual(torch.sign, args, kwargs)
    return _usual(func, args, kwargs)


FUNCTIONS.update({torch.sgn: _sgn, torch.Tensor.sgn: _sgn})

#: ``propagation.plan`` entry of this family; ``"pointwise"`` also serves every ATen op tagged pointwise.
PROPAGATORS: dict = {"pointwise": propagate, **{op: propagate for op in RULES}, **dict.fromkeys(_FILLS, _propagate_fill)}
