"""Running a planned contraction on local tensors, and its autograd Function.

:func:`prepare` plans and :func:`run` brings each operand to the layout the plan gives it, runs
the contraction on the local pieces (with the plain op's kernel, see
:mod:`.local`) and wraps the result. It computes
``alpha * einsum(...) + beta * bias`` so that ``addmm``-style ops and
``linear`` with a bias are one step: the bias is laid out like the result (a
pending-sum result gets the bias on one rank of the group only).

Everything but the local kernels and the redistributions is metadata, read
from the specs (never through ShardTensor attributes such as ``.shape``, each
of which is a ``__torch_function__`` call) and memoised where it is pure: the
plan (:func:`.labels.plan_contraction`) and the local program.

:class:`Contraction` makes that differentiable above autograd. Its backward is
made of contractions too (the gradient of an einsum operand is an einsum of
the output gradient with the other operands), planned with the operand's own
layout as the preferred output layout, so gradients usually arrive in the
inputs' layouts without communication. Where an input is replicated, its
gradient may stay a pending sum (``Partial``): a plain weight promoted at the
function layer then gets it all-reduced once, by the promotion step. For
complex operands the gradients follow torch's convention (conjugate
Wirtinger): the other operands and the scale factors enter conjugated, as in
``grad_a = grad @ b.mH`` of ``mm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ... import _gathers
from ..._redistribute import grad_layout, redistribute_local
from ..._torch_compat import SubclassFunction, once_differentiable
from ...rule_kit import grad_like, grad_like_is_identity, shard_tensor_cls, wrap
from .labels import NO_FREE, label_extents, plan_contraction
from .local import direct_kernel, local_program


@dataclass(frozen=True)
class Equation:
    """Labels of each operand and of the output (a bias, if any, takes a suffix of ``out``).

    Hashed once (it keys the memoised plans on every call).
    """

    operands: tuple
    out: tuple

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = self.__dict__["_hash"] = hash((self.operands, self.out))
            return h


def prepare(eq: Equation, operands, bias=None, beta=1, out_shape=None, prefer=None) -> Prepared:
    """The memoised plan of :func:`propagate` for these ShardTensors (a bias times ``beta == 0`` is left out)."""
    dtype = operands[0]._local_tensor.dtype
    if len(operands) == 2 and bias is None and out_shape is None and prefer is None:
        return _prepare_pair(eq, operands[0]._spec, operands[1]._spec, dtype)
    return propagate(
        eq,
        tuple(x._spec for x in operands),
        bias._spec if bias is not None and beta != 0 else None,
        None if out_shape is None else tuple(out_shape),
        prefer,
        dtype,
    )


#: (id(eq), id(a), id(b), dtype) -> (eq, a, b, plan) of two-operand contractions without a bias (``x @ w``,
#: ``linear``): looked up by the identity of the memoised equation and specs, since hashing a spec or an
#: equation is a Python call (~0.15 us each, five per lookup of :func:`propagate`). The entry keeps its keys'
#: objects alive, so no other object can have their ids while it stands; an equal but distinct object misses.
_PAIRS: dict = {}
_PAIRS_SIZE = 4096


def _prepare_pair(eq: Equation, a, b, dtype) -> Prepared:
    key = (id(eq), id(a), id(b), dtype)
    hit = _PAIRS.get(key)
    if hit is not None:
        return hit[3]
    prepared = propagate(eq, (a, b), None, None, None, dtype)
    if len(_PAIRS) >= _PAIRS_SIZE:
        _PAIRS.clear()
    _PAIRS[key] = (eq, a, b, prepared)
    return prepared


def run(prepared: Prepared, operands, bias=None, alpha=1, beta=1):
    """Execute ``prepared`` (from :func:`prepare`) on ShardTensors: move, contract locally, wrap.

    ``bias`` is read only if the plan has one (it has none when ``beta == 0``).
    """
    direct = prepared.direct
    if direct is not None and alpha == 1:  # the plain op's kernel, called as the local program calls it
        return wrap(direct(operands[0]._local_tensor, operands[1]._local_tensor), prepared.out)
    if prepared.moves:
        locals_ = [
            x._local_tensor if dst is None else redistribute_local(x._local_tensor, x._spec, dst)
            for x, dst in zip(operands, prepared.operands)
        ]
    else:
        locals_ = [x._local_tensor for x in operands]
    bias_local = None
    if prepared.with_bias:
        dst = prepared.bias
        bias_local = bias._local_tensor if dst is None else redistribute_local(bias._local_tensor, bias._spec, dst)
    out_spec = prepared.out
    return wrap(prepared.program.run(locals_, out_spec, bias_local, alpha, beta), out_spec)


@dataclass(frozen=True)
class Prepared:
    """Everything a contraction decides from metadata: see :func:`propagate`."""

    eq: Equation  # what is contracted (the backward's gradients are planned from it)
    specs: tuple  # the operands' specs (the layouts of their gradients)
    operands: tuple  # per operand: the spec it is moved to, or None when it already has it
    moves: bool  # whether any operand is moved
    with_bias: bool  # whether a bias is added
    bias: object  # the spec the bias is moved to (None: as it is, or no bias)
    out: object  # the output spec
    program: object  # the local program (:func:`.local.local_program`)
    #: ``torch.mm`` or ``F.linear`` where that one call on the two operands' local tensors as they are is the whole
    #: program (no move, no bias, nothing squeezed or inserted) and ``alpha`` is 1; else None
    direct: object = None


@lru_cache(maxsize=2048)
def propagate(eq: Equation, specs, bias_spec, out_shape, prefer, dtype) -> Prepared:
    """The pure half of :func:`prepare`: output spec, operand layouts and local program, memoised.

    Keyed by the operands' specs (size tables included, so uneven layouts
    are their own keys) and the call's metadata; no tensor enters. A step of
    a model repeats the same few contractions, so after the first call a
    contraction costs one cache lookup besides its kernel and the data it
    must move: no O(P) work (size tables, offsets) on the hot path.
    """
    shapes = tuple(s.global_shape for s in specs)
    out_shape = output_shape(eq, shapes) if out_shape is None else out_shape
    plan = plan_contraction(specs, eq.operands, eq.out, out_shape, prefer=prefer)
    targets = tuple(_target(s, layout) for s, layout in zip(specs, plan.operands))
    placements, dim_sizes = plan.out
    # The kernels' dtype (they take operands of one dtype); wrap() re-types the spec if alpha or the bias promote it.
    out_spec = type(specs[0]).from_sizes(specs[0].mesh, placements, out_shape, dtype, dim_sizes)
    bias_target = None
    if bias_spec is not None:
        bias_target = _target(bias_spec, _bias_layout(bias_spec, placements, dim_sizes, len(out_shape)))
    program = local_program(eq, shapes, out_shape, None if bias_spec is None else len(bias_spec.global_shape))
    moves = any(t is not None for t in targets)
    direct = None if moves or bias_spec is not None or len(specs) != 2 else direct_kernel(program)
    return Prepared(eq, specs, targets, moves, bias_spec is not None, bias_target, out_spec, program, direct)


def _target(spec, layout):
    """The spec ``spec`` must be moved to for ``layout`` (placements, dim_sizes), or None if it has it."""
    placements, dim_sizes = layout
    if spec.placements == placements and spec.dim_sizes == dim_sizes:
        return None
    return spec.with_layout(placements, dim_sizes)


@lru_cache(maxsize=1024)
def output_shape(eq: Equation, shapes) -> tuple[int, ...]:
    """Global shape of the result (operands' sizes, broadcast); ``shapes`` a tuple of int tuples."""
    ext = label_extents(shapes, eq.operands)
    return tuple(ext[lab] for lab in eq.out)


def _bias_layout(bias_spec, out_placements, out_dim_sizes, out_ndim):
    """The layout of the bias's local piece laid out like the output (right-aligned broadcasting)."""
    bias_shape = bias_spec.global_shape
    offset = out_ndim - len(bias_shape)
    placements, dim_sizes = [], [None] * len(bias_shape)
    for p in out_placements:
        d = p.dim - offset if issubclass(type(p), Shard) else -1
        if issubclass(type(p), Shard) and d >= 0 and bias_shape[d] != 1:
            placements.append(Shard(d))
            dim_sizes[d] = out_dim_sizes[p.dim]
        elif issubclass(type(p), Partial):
            placements.append(p)  # added on one rank of the group: the sum stays exact
        else:
            placements.append(Replicate())
    return tuple(placements), tuple(dim_sizes)


# --------------------------------------------------------------------------- #
# Gradients
# --------------------------------------------------------------------------- #
def _prefer(spec, labels):
    """Plan hint: shard the gradient like the input, nothing else."""
    return tuple(
        (labels[p.dim], spec.dim_sizes[p.dim]) if issubclass(type(p), Shard) else NO_FREE for p in spec.placements
    )


class Contraction(SubclassFunction):
    """Differentiable :func:`run` of a plan from :func:`prepare` (``forward`` + ``setup_context`` style).

    It takes the plan, not the equation: the caller needs the plan anyway (to
    skip this Function under ``no_grad``), and looking it up twice would cost
    a second cache lookup per call.
    """

    @staticmethod
    def forward(prepared, alpha, beta, bias, *operands):
        return run(prepared, operands, bias, alpha, beta)

    @staticmethod
    def setup_context(ctx, inputs, output):
        bias = inputs[3]  # one attribute (plan, alpha, beta, bias spec, output spec): each set costs ~0.1 us
        ctx.call = (inputs[0], inputs[1], inputs[2], None if bias is None else bias._spec, output._spec)
        # An operand is read only by the other operands' gradients (as torch's mm keeps ``mat1`` for ``mat2``'s):
        # activations times a frozen weight keep nothing alive, a weight times data without grad is not saved.
        needs = ctx.needs_input_grad
        if len(inputs) == 6:  # two operands, spelled out: this runs on every x @ w (~0.5 us less)
            ctx.save_for_backward(_compact(inputs[4]) if needs[5] else None, _compact(inputs[5]) if needs[4] else None)
        else:
            wanted = sum(needs[4:])
            ctx.save_for_backward(*[_compact(x) if wanted > n else None for x, n in zip(inputs[4:], needs[4:])])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        ShardTensor = shard_tensor_cls()
        prepared, alpha, beta, bias_spec, out_spec = ctx.call
        if not isinstance(grad, ShardTensor):
            grad = wrap(grad, grad_layout(out_spec))
        operands = ctx.saved_tensors
        needs = ctx.needs_input_grad
        plans = _backward_plans(prepared, grad, operands, needs[3:], bias_spec)
        grads = []
        scale = _conj_scalar(alpha)
        for plan in plans.operands:
            if plan is None:
                grads.append(None)
                continue
            tensors = [grad] + [_conj(operands[j]) for j in plan.others]
            grads.append(plan.run(tensors, scale))
        grad_bias = None if plans.bias is None else plans.bias.run([grad], _conj_scalar(beta))
        return None, None, None, grad_bias, *grads


@dataclass(frozen=True)
class _GradPlan:
    """The gradient of one input of a contraction: an einsum of the output gradient with the other operands.

    ``prepared`` is that einsum's plan (from :func:`propagate`, with the
    input's own layout preferred for the result), ``others`` the indices of
    the other operands it reads, ``target`` the input's spec and ``whole``
    whether the input is replicated: what its gradient gathers is then not an
    implicit gather (the forward that used the whole tensor is where one would
    be reported).
    """

    prepared: Prepared
    others: tuple
    target: object
    whole: bool
    as_is: bool  # whether :func:`grad_like` returns a result of spec ``prepared.out`` as it is

    def run(self, tensors, scale):
        prepared = self.prepared
        if self.whole and prepared.moves:
            with _gathers.explicit():
                g = run(prepared, tensors, None, scale, 1)
        else:
            g = run(prepared, tensors, None, scale, 1)
        if self.as_is and g._spec is prepared.out:  # (wrap() re-types the spec of a result of another dtype)
            return g
        return grad_like(g, self.target)


@dataclass(frozen=True)
class _GradPlans:
    operands: tuple  # per operand: its :class:`_GradPlan`, or None where no gradient is needed
    bias: _GradPlan | None


#: Backward plans of a contraction, keyed by the identity of the forward's plan, of the specs of the output
#: gradient and the saved operands, and by which inputs need a gradient: a contraction's backward plans its
#: gradient einsums once per layout (as :func:`_prepare_pair` does its forward), instead of building their
#: equations and hints and looking their plans up on every call. Each entry keeps its keys' objects alive.
_GRADS: dict = {}
_GRADS_SIZE = 4096


def _backward_plans(prepared: Prepared, grad, operands, needs, bias_spec) -> _GradPlans:
    """The memoised :class:`_GradPlans` of ``prepared`` for this output gradient and saved operands.

    ``needs`` is ``needs_input_grad`` from the bias on (bias, then the operands).
    """
    specs = tuple(None if y is None else y._spec for y in operands)
    dtype = grad._local_tensor.dtype
    key = (id(prepared), id(grad._spec), dtype, tuple(map(id, specs)), needs, id(bias_spec))
    hit = _GRADS.get(key)
    if hit is not None:
        return hit[-1]
    eq = prepared.eq
    plans = []
    for k, spec in enumerate(prepared.specs):
        if not needs[1 + k]:
            plans.append(None)
            continue
        others = tuple(j for j in range(len(operands)) if j != k)
        labels = (eq.out,) + tuple(eq.operands[j] for j in others)
        tensor_specs = (grad._spec,) + tuple(specs[j] for j in others)
        plans.append(_grad_plan(eq.operands[k], spec, tensor_specs, labels, others, dtype))
    bias_plan = None
    if bias_spec is not None and needs[0]:
        bias_labels = eq.out[len(eq.out) - len(bias_spec.global_shape) :]
        bias_plan = _grad_plan(bias_labels, bias_spec, (grad._spec,), (eq.out,), (), dtype)
    result = _GradPlans(tuple(plans), bias_plan)
    if len(_GRADS) >= _GRADS_SIZE:
        _GRADS.clear()
    _GRADS[key] = (prepared, grad._spec, specs, bias_spec, result)
    return result


def _grad_plan(target_labels, target_spec, tensor_specs, labels, others, dtype) -> _GradPlan:
    """The :class:`_GradPlan` of one input (labelled ``target_labels``, of spec ``target_spec``)."""
    sub_eq = Equation(tuple(labels), tuple(target_labels))
    prepared = propagate(
        sub_eq, tensor_specs, None, tuple(target_spec.global_shape), _prefer(target_spec, target_labels), dtype
    )
    whole = all(issubclass(type(p), Replicate) for p in target_spec.placements)
    return _GradPlan(prepared, others, target_spec, whole, grad_like_is_identity(prepared.out, target_spec))


def _compact(x):
    """``x`` to save for backward: a copy when its local tensor is a view of less than half its storage.

    Saving a small view (the retained modes ``x_ft[..., :m1, :m2]`` of an FNO
    spectrum) would keep the whole storage alive until backward; torch's own
    ``einsum`` saves the compact copies its permute/reshape make, so plain
    code never holds them (measured on the FNO at P = 1: +20 % of peak
    memory otherwise). Views that cover their storage (``w.t()``) are saved
    as they are. The storage decides, not ``_base``: a local made inside a
    rule (under ``__torch_dispatch__``, or detached) can share its storage
    without naming it as its base (the FNO's modes were such views: +20 %
    at P = 1 again).
    """
    local = x._local_tensor
    if local.untyped_storage().nbytes() <= 2 * local.nbytes:
        return x
    return wrap(local.clone(memory_format=torch.contiguous_format), x._spec)


def _conj(x):
    """``x`` conjugated (materialized, in its own layout: conjugation is linear, a pending sum stays one)."""
    if not x._local_tensor.is_complex():
        return x
    return wrap(torch.conj_physical(x._local_tensor), x._spec)


def _conj_scalar(value):
    """A Python scale factor conjugated (ints and floats are their own conjugate)."""
    return value.conjugate() if isinstance(value, complex) else value
