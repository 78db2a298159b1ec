"""Contractions (mm, bmm, mv, dot, addmm, baddbmm, addmv, matmul, linear, einsum).

All of them are einsums (see :mod:`.labels`): sharded dims that stay in the
output stay sharded, a sharded contracted dim gives a pending sum
(``Partial("sum")``), and a dim sharded differently in two operands is
redistributed in the smaller one. A replicated operand meeting a sharded one
is only sliced, so ``x @ W`` with ``W`` replicated communicates nothing.

Two levels:

* ``FUNCTIONS`` (above autograd) for the public functions. ATen decomposes
  ``linear``/``matmul``/``einsum`` on N-d inputs into reshapes that cross the
  sharded dim, and the ATen backward formulas go through transposes; here the
  whole op, forward and backward, is one :class:`.contract.Contraction`, whose
  gradients come in the inputs' layouts (a replicated weight's gradient as a
  pending sum that the promotion step all-reduces once).
* ``RULES`` (below autograd) for the ATen ops that still reach the dispatcher
  (calls with keyword tensors or ``out=``, other ops' backward formulas).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import torch

from ..._torch_compat import any_autocast_enabled, direct_apply, functorch_transforms_active, torch_function_disabled
from ... import promotion as _promotion, rule_kit as _rule_kit
from ...promotion import TensorPromotionMode, promote, promote_together
from ...propagation import OpPlan, moves
from ...rule_kit import shard_tensor_cls
from .contract import Contraction, Equation, Prepared, output_shape, prepare, propagate, run
from .einsum import parse_einsum

aten = torch.ops.aten


@dataclass(frozen=True, eq=False)
class _Product:
    """A matmul-like op: required operand ndims (None: matmul's rules) and whether it adds a bias.

    Compared and hashed by identity (each is a module constant): it keys the memoised equations on every call.
    """

    name: str
    ndims: tuple | None
    bias: bool = False


_MATMUL = _Product("matmul", None)
_MM, _BMM, _MV, _DOT = _Product("mm", (2, 2)), _Product("bmm", (3, 3)), _Product("mv", (2, 1)), _Product("dot", (1, 1))
_ADDMM, _BADDBMM, _ADDMV = _Product("addmm", (2, 2), True), _Product("baddbmm", (3, 3), True), _Product("addmv", (2, 1), True)


@lru_cache(maxsize=1024)
def matmul_equation(name: str, a_shape, b_shape, *, batch_broadcasts: bool = True) -> Equation:
    """Labels of ``a @ b`` with torch.matmul's rules (1-D operands, broadcast batch dims); memoised on int tuples."""
    a_nd, b_nd = len(a_shape), len(b_shape)
    if a_nd == 0 or b_nd == 0:
        raise RuntimeError(f"{name}: both arguments need to be at least 1D, but they are {a_nd}D and {b_nd}D")
    nb = max(a_nd - 2, b_nd - 2, 0)
    batch = tuple(("batch", i) for i in range(nb))
    a = ("k",) if a_nd == 1 else batch[nb - (a_nd - 2) :] + ("n", "k")
    b = ("k",) if b_nd == 1 else batch[nb - (b_nd - 2) :] + ("k", "m")
    out = batch + (("n",) if a_nd > 1 else ()) + (("m",) if b_nd > 1 else ())
    _check_sizes(name, (a_shape, b_shape), (a, b), broadcast=batch if batch_broadcasts else ())
    return Equation((a, b), out)


@lru_cache(maxsize=1024)
def linear_equation(x_shape, w_shape) -> Equation:
    """Labels of ``F.linear(x, w)``: ``x @ w.T`` over any leading dims of ``x`` (memoised on int tuples)."""
    if len(x_shape) == 0 or len(w_shape) not in (1, 2):
        raise RuntimeError(
            f"linear: input must be at least 1-D and weight 1-D or 2-D, got {len(x_shape)}-D and {len(w_shape)}-D"
        )
    lead = tuple(("lead", i) for i in range(len(x_shape) - 1))
    x, w = lead + ("in",), ("out", "in")[2 - len(w_shape) :]
    _check_sizes("linear", (x_shape, w_shape), (x, w), broadcast=())
    return Equation((x, w), lead + w[:-1])


def _check_sizes(name, shapes, labels, broadcast):
    """Shared dims must have equal sizes (only ``broadcast`` labels may be 1 on one side)."""
    seen: dict = {}
    for shape, labs in zip(shapes, labels):
        for n, lab in zip(shape, labs):
            m = seen.setdefault(lab, n)
            if m != n and not (lab in broadcast and 1 in (m, n)):
                shown = " and ".join("x".join(map(str, s)) for s in shapes)
                raise RuntimeError(f"{name}: shapes cannot be multiplied ({shown})")
            if m == 1:
                seen[lab] = n


def _check_bias(name, bias_shape, out_shape):
    if len(bias_shape) > len(out_shape) or any(
        b not in (1, o) for b, o in zip(reversed(bias_shape), reversed(out_shape))
    ):
        raise RuntimeError(f"{name}: the added tensor of shape {tuple(bias_shape)} does not broadcast to {tuple(out_shape)}")


@lru_cache(maxsize=1024)
def _product_equation(op: _Product, a_shape, b_shape) -> Equation:
    """Labels of ``op`` on operands of these global shapes (memoised on the op and int tuples)."""
    if op.ndims is not None and (len(a_shape), len(b_shape)) != op.ndims:
        raise RuntimeError(
            f"{op.name}: expected {op.ndims[0]}-D and {op.ndims[1]}-D tensors, got {len(a_shape)}-D and {len(b_shape)}-D"
        )
    return matmul_equation(op.name, a_shape, b_shape, batch_broadcasts=op.ndims is None)


def _shape(t):
    """Global shape of a ShardTensor (or None) from its spec: ``t.shape`` would be a ``__torch_function__`` call."""
    return None if t is None else t._spec.global_shape


def _replicated(t, mesh):
    """A plain tensor that reached a contraction (a 0-d one, never promoted) as a Replicate ShardTensor."""
    if isinstance(t, shard_tensor_cls()) or t is None:
        return t
    return promote(t, mesh)


def _parse_product(op: _Product, args, kwargs):
    """``(bias, a, b, beta, alpha)``, or None for call forms left to the default path."""
    n = 3 if op.bias else 2
    if len(args) != n or set(kwargs) - ({"beta", "alpha"} if op.bias else set()):
        return None
    bias, (a, b) = (args[0], args[1:]) if op.bias else (None, args)
    return bias, a, b, kwargs.get("beta", 1), kwargs.get("alpha", 1)


def _run_product(op: _Product, args, kwargs, differentiable: bool):
    bias, a, b, beta, alpha = _parse_product(op, args, kwargs)
    mesh = (a if isinstance(a, shard_tensor_cls()) else b)._spec.mesh
    a, b, bias = _replicated(a, mesh), _replicated(b, mesh), _replicated(bias, mesh)
    eq = _product_equation(op, a._spec.global_shape, b._spec.global_shape)
    if bias is not None:
        _check_bias(op.name, _shape(bias), output_shape(eq, (_shape(a), _shape(b))))
    if differentiable:
        return _differentiable(eq, alpha, beta, bias, a, b)
    return run(prepare(eq, (a, b), bias, beta), (a, b), bias, alpha, beta)


def _differentiable(eq, alpha, beta, bias, *operands):
    """:class:`.contract.Contraction` under grad mode, else the bare contraction.

    The autograd Function costs as much as a small kernel; under ``no_grad``
    (inference) it would record nothing, so it is skipped.
    """
    prepared = prepare(eq, operands, bias, beta)
    if torch.is_grad_enabled():  # autograd itself records nothing when no input requires grad
        return Contraction.apply(prepared, alpha, beta, bias, *operands)
    return run(prepared, operands, bias, alpha, beta)


def _default(func, args, kwargs):
    with torch_function_disabled():
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- #
# Function-level handlers
# --------------------------------------------------------------------------- #
def _product_handler(op: _Product, func, types, args, kwargs):
    if not kwargs and len(args) == 2 and not op.bias:  # ``x @ w``: no parsing, straight to the plan
        a, b = args
        ShardTensor = shard_tensor_cls()
        if type(a) is ShardTensor and type(b) is ShardTensor:
            return _differentiable(_product_equation(op, a._spec.global_shape, b._spec.global_shape), 1, 1, None, a, b)
    if _parse_product(op, args, kwargs) is None:
        return _default(func, args, kwargs)
    return _run_product(op, args, kwargs, differentiable=True)


def _linear_handler(func, types, args, kwargs):
    if not kwargs and 2 <= len(args) <= 3:  # the usual positional call, without building a dict
        x, w, bias = args[0], args[1], args[2] if len(args) == 3 else None
    else:
        names = ("input", "weight", "bias")
        bound = dict(zip(names, args), **kwargs)
        if len(args) > 3 or set(bound) - set(names) or "weight" not in bound:
            return _default(func, args, kwargs)
        x, w, bias = bound["input"], bound["weight"], bound.get("bias")
    ShardTensor = shard_tensor_cls()
    if type(x) is not ShardTensor or type(w) is not ShardTensor or (bias is not None and type(bias) is not ShardTensor):
        mesh = (x if isinstance(x, ShardTensor) else w if isinstance(w, ShardTensor) else bias)._spec.mesh
        x, w, bias = _replicated(x, mesh), _replicated(w, mesh), _replicated(bias, mesh)
    eq = linear_equation(x._spec.global_shape, w._spec.global_shape)
    if bias is not None:
        _check_bias("linear", _shape(bias), output_shape(eq, (_shape(x), _shape(w))))
    return _differentiable(eq, 1, 1, bias, x, w)


def _einsum_handler(func, types, args, kwargs):
    if kwargs or not args or not isinstance(args[0], str):
        return _default(func, args, kwargs)  # sublist format: left to ATen's decomposition
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    mesh = next(t for t in operands if isinstance(t, shard_tensor_cls())).device_mesh
    operands = tuple(_replicated(t, mesh) for t in operands)
    eq = parse_einsum(args[0], tuple(len(_shape(t)) for t in operands))
    return _differentiable(eq, 1, 1, None, *operands)


# --------------------------------------------------------------------------- #
# Fast path: a sharded operand times a plain weight (``x @ w``, ``F.linear(x, w, b)``)
# --------------------------------------------------------------------------- #
#: The plain tensor types a model's weights have (DTensors and other subclasses take the general path).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SILENT = TensorPromotionMode.SILENT

#: (kind, id(x spec), id(weight spec), id(bias spec) or None, dtype) -> (the specs, the plan): the plans of
#: the fast path, looked up by the identity of the memoised specs (the ShardTensor's, and the promoted
#: weight's and bias's from :func:`~physicsnemo_dp.promotion.promote`). Each entry keeps its specs alive, so
#: no other spec can have their ids while it stands. Bounded like the other plan caches.
_FAST: dict = {}
_FAST_SIZE = 4096


def _fast_applies(x, ShardTensor) -> bool:
    """Whether the fast path may serve a call with ShardTensor ``x`` first and plain tensors after it.

    What the general path would do differently otherwise: a promotion mode other than SILENT (an error, or a
    warning per promotion) and autocast (the operands' casts, :mod:`...dispatch.autocast`) take it.
    """
    return type(x) is ShardTensor and _promotion._mode is _SILENT and not any_autocast_enabled()


def _fast_plan(key, build) -> Prepared:
    hit = _FAST.get(key)
    if hit is not None:
        return hit[1]
    prepared, specs = build()
    if len(_FAST) >= _FAST_SIZE:
        _FAST.clear()
    _FAST[key] = (specs, prepared)
    return prepared


def _fast_product(op: _Product, func, types, args, kwargs):
    """``x @ w`` (``matmul``, ``mm``, ...) with ``x`` a ShardTensor and ``w`` a plain tensor, before promotion.

    The same steps as the general path (:func:`~physicsnemo_dp.promotion.promote` of the weight, the
    memoised plan, :class:`.contract.Contraction`), without its generic routing, argument rebuilds and
    equation and plan lookups: the plan is found by the identity of the two specs. ``NotImplemented``
    sends every other call form to the general path.
    """
    if kwargs or len(args) != 2:
        return NotImplemented
    x, w = args
    # _fast_applies inlined (this runs on every x @ w)
    if type(w) not in _PLAIN or type(x) is not _rule_kit._SHARD_TENSOR_CLS:
        return NotImplemented
    if _promotion._mode is not _SILENT or any_autocast_enabled():
        return NotImplemented
    wv = promote(w, x._spec.mesh)
    spec, w_spec = x._spec, wv._spec
    key = (op, id(spec), id(w_spec), None, x._local_tensor.dtype)
    hit = _FAST.get(key)
    if hit is not None:
        prepared = hit[1]
    else:

        def build():
            eq = _product_equation(op, spec.global_shape, w_spec.global_shape)
            return prepare(eq, (x, wv)), (spec, w_spec)

        prepared = _fast_plan(key, build)
    if torch.is_grad_enabled():
        if functorch_transforms_active():
            return Contraction.apply(prepared, 1, 1, None, x, wv)
        return _CONTRACT(prepared, 1, 1, None, x, wv)
    return run(prepared, (x, wv), None, 1, 1)


#: :class:`.contract.Contraction`'s C++ apply for two operands (what its ``apply`` calls outside torch.func
#: transforms), without the classmethod's checks: ~1 us a call on the fast paths.
_CONTRACT = direct_apply(Contraction, 6)


def _fast_linear(func, types, args, kwargs):
    """``F.linear(x, w)`` / ``F.linear(x, w, b)`` with ``x`` a ShardTensor and plain ``w``, ``b`` (see :func:`_fast_product`).

    The weight and bias are promoted together (one node, one reduction of their gradients), as
    :func:`~physicsnemo_dp.promotion.promote_args` promotes a layer's plain tensors.
    """
    if kwargs or not 2 <= len(args) <= 3:
        return NotImplemented
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    if type(w) not in _PLAIN or not _fast_applies(x, _rule_kit._SHARD_TENSOR_CLS):
        return NotImplemented
    mesh = x._spec.mesh
    if bias is None:
        wv, bv = promote(w, mesh), None
    elif type(bias) in _PLAIN and bias.ndim > 0 and w.ndim > 0:  # (0-dim ones: promoted alone, general path)
        wv, bv = promote_together((w, bias), mesh)
    else:
        return NotImplemented
    spec, w_spec, b_spec, dtype = x._spec, wv._spec, None if bv is None else bv._spec, x._local_tensor.dtype

    def build():
        eq = linear_equation(spec.global_shape, w_spec.global_shape)
        if bv is not None:
            _check_bias("linear", b_spec.global_shape, output_shape(eq, (spec.global_shape, w_spec.global_shape)))
        return prepare(eq, (x, wv), bv, 1), (spec, w_spec, b_spec)

    prepared = _fast_plan((_LINEAR, id(spec), id(w_spec), None if b_spec is None else id(b_spec), dtype), build)
    if torch.is_grad_enabled():
        if functorch_transforms_active():
            return Contraction.apply(prepared, 1, 1, bv, x, wv)
        return _CONTRACT(prepared, 1, 1, bv, x, wv)
    return run(prepared, (x, wv), bv, 1, 1)


_LINEAR = _Product("linear", None, True)  # a key of :data:`_FAST` only


def _with_fast_path(handler, fast):
    """``handler`` offering each call to ``fast`` first (the hook's ``before_promotion``, :mod:`...dispatch.table`)."""
    handler.before_promotion = fast
    return handler


def _product_functions():
    table = {
        _MATMUL: (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__),
        _MM: (torch.mm, torch.Tensor.mm),
        _BMM: (torch.bmm, torch.Tensor.bmm),
        _MV: (torch.mv, torch.Tensor.mv),
        _DOT: (torch.dot, torch.Tensor.dot),
        _ADDMM: (torch.addmm, torch.Tensor.addmm),
        _BADDBMM: (torch.baddbmm, torch.Tensor.baddbmm),
        _ADDMV: (torch.addmv, torch.Tensor.addmv),
    }
    return {
        f: _with_fast_path(partial(_product_handler, op), None if op.bias else partial(_fast_product, op))
        for op, funcs in table.items()
        for f in funcs
    }


FUNCTIONS: dict = {
    **_product_functions(),
    torch.nn.functional.linear: _with_fast_path(partial(_linear_handler), _fast_linear),
    torch.einsum: _einsum_handler,
}


# --------------------------------------------------------------------------- #
# Dispatch rules
# --------------------------------------------------------------------------- #
def _product_rule(op: _Product, func, args, kwargs):
    if _parse_product(op, args, kwargs) is None:
        raise NotImplementedError(f"{func}: unexpected arguments for a ShardTensor contraction")
    return _run_product(op, args, kwargs, differentiable=False)


RULES: dict = {
    aten.mm.default: partial(_product_rule, _MM),
    aten.bmm.default: partial(_product_rule, _BMM),
    aten.mv.default: partial(_product_rule, _MV),
    aten.dot.default: partial(_product_rule, _DOT),
    aten.addmm.default: partial(_product_rule, _ADDMM),
    aten.baddbmm.default: partial(_product_rule, _BADDBMM),
    aten.addmv.default: partial(_product_rule, _ADDMV),
}


# --------------------------------------------------------------------------- #
# Propagation (what a call will do, from specs: ``propagation.plan``)
# --------------------------------------------------------------------------- #
@lru_cache(maxsize=1024)
def _op_plan(eq: Equation, specs, bias_at, with_bias: bool) -> OpPlan:
    """The :class:`~physicsnemo_dp.propagation.OpPlan` of a contraction (memoised; the same one :func:`.contract.prepare` gives the contraction).

    ``specs`` are the operands' specs in call order, the bias among them at
    position ``bias_at`` (None: no bias); ``with_bias`` is False when the bias
    is multiplied by ``beta == 0`` (then it is neither moved nor read).
    """
    bias_spec = None if bias_at is None else specs[bias_at]
    operands = tuple(s for k, s in enumerate(specs) if k != bias_at)
    prepared = propagate(eq, operands, bias_spec if with_bias else None, None, None, operands[0].tensor_meta.dtype)
    targets = list(prepared.operands)
    if bias_at is not None:
        targets.insert(bias_at, prepared.bias if with_bias else None)
    return OpPlan((prepared.out,), moves(specs, targets), tuple(targets))


def _propagate_product(op: _Product, func, args, kwargs) -> OpPlan:
    parsed = _parse_product(op, args, kwargs)
    if parsed is None:
        raise NotImplementedError(f"propagation.plan: unexpected arguments for {func}")
    bias, a, b, beta, _ = parsed
    eq = _product_equation(op, a.global_shape, b.global_shape)
    if bias is None:
        return _op_plan(eq, (a, b), None, False)
    _check_bias(op.name, bias.global_shape, output_shape(eq, (a.global_shape, b.global_shape)))
    return _op_plan(eq, (bias, a, b), 0, beta != 0)


def _propagate_linear(func, args, kwargs) -> OpPlan:
    bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
    x, w, bias = bound["input"], bound["weight"], bound.get("bias")
    eq = linear_equation(x.global_shape, w.global_shape)
    if bias is None:
        return _op_plan(eq, (x, w), None, False)
    _check_bias("linear", bias.global_shape, output_shape(eq, (x.global_shape, w.global_shape)))
    return _op_plan(eq, (x, w, bias), 2, True)


def _propagate_einsum(func, args, kwargs) -> OpPlan:
    operands = tuple(args[1][0] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    eq = parse_einsum(args[0], tuple(len(s.global_shape) for s in operands))
    return _op_plan(eq, operands, None, False)


def _product_propagators():
    by_function = {
        f: partial(_propagate_product, op)
        for op, funcs in (
            (_MATMUL, (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)),
            (_MM, (torch.mm, aten.mm.default)),
            (_BMM, (torch.bmm, aten.bmm.default)),
            (_MV, (torch.mv, aten.mv.default)),
            (_DOT, (torch.dot, aten.dot.default)),
            (_ADDMM, (torch.addmm, aten.addmm.default)),
            (_BADDBMM, (torch.baddbmm, aten.baddbmm.default)),
            (_ADDMV, (torch.addmv, aten.addmv.default)),
        )
        for f in funcs
    }
    return by_function


#: ``propagation.plan`` entries of this family (installed by the catalog through ``dispatch/table.py``).
PROPAGATORS: dict = {
    **_product_propagators(),
    torch.nn.functional.linear: _propagate_linear,
    torch.einsum: _propagate_einsum,
}
