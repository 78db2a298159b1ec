"""The pure half of a reduction: from the input's spec and the arguments to layouts and collectives.

:func:`propagate` is memoised on ``(op, frozen arguments)`` with the input
given by its spec (uneven size tables included), so the rules in ``rules``
only look the plan up and run it on the local tensor, and
``propagation.plan`` answers the same question without a tensor. The plan
says which pending reductions of the input are resolved first, the
:class:`~._layout.Reduction` (reduced dims, the mesh dims that hold pieces of
them), every output's spec, and the collectives ``_combine`` then issues:

* ``sum``-like: none (the result stays ``Partial("sum")``);
* combined (``amax``, ``prod``, norms, ``any``, ...): one all-gather of the
  reduced-size local result per reduced mesh dim;
* value-and-index (``max(dim)``, ``argmax``, ...): two all-gathers (values,
  then global indices) per reduced mesh dim;
* moments (``var``, ``std``, ...): one all-reduce of the keepdim sum per
  reduced mesh dim, then one of the keepdim sum of squared deviations.

A rank whose local result is empty is empty on its whole group (the kept dims
are sharded by other mesh dims), so the group skips the collective and the
plan lists none.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from ...propagation import OpPlan, cached, collective_step, freeze, redistribution_steps
from ...rule_kit import bind_args
from ...spec import ShardTensorSpec
from ._layout import Reduction, reduced_dims

aten = torch.ops.aten

#: The kind of combination of each reduction the rules serve (a packet, or an overload when the packet mixes kinds).
KIND: dict = {
    **dict.fromkeys((aten.sum, aten.mean, aten.nansum, aten.count_nonzero), "sum"),
    **dict.fromkeys(
        (aten.amax, aten.amin, aten.prod, aten.logsumexp, aten.linalg_vector_norm, aten.norm, aten.any, aten.all),
        "combined",
    ),
    **dict.fromkeys((aten.max.default, aten.min.default), "combined"),
    **dict.fromkeys((aten.max.dim, aten.min.dim, aten.argmax, aten.argmin), "indexed"),
    **dict.fromkeys((aten.var, aten.std, aten.var_mean, aten.std_mean), "moments"),
}


@dataclass(frozen=True)
class ReductionPlan:
    """A reduction decided from metadata.

    Attributes:
        kind: ``sum``, ``combined``, ``indexed`` or ``moments``.
        resolved: the layout the input is brought to first (pending reductions the op cannot
            keep done), or None when it is used as it is.
        red: the reduction of the (resolved) input.
        bound: the op's arguments by schema name (the input as its spec).
        out_dtypes: dtype of every output, from torch's meta kernel.
        plan: output specs and collectives (:class:`~physicsnemo_dp.propagation.OpPlan`).
    """

    kind: str
    resolved: object
    red: Reduction
    bound: dict
    out_dtypes: tuple
    plan: OpPlan


def kind_of(func) -> str:
    """How the rules combine ``func``'s per-rank results (see :data:`KIND`)."""
    return KIND.get(func) or KIND[func.overloadpacket]


def _meta(value):
    if isinstance(value, ShardTensorSpec):
        return torch.empty(value.global_shape, dtype=value.tensor_meta.dtype, device="meta")
    return value


@lru_cache(maxsize=4096)
def propagate(func, args: tuple, kwargs: tuple) -> ReductionPlan:
    """The plan of reduction ``func`` on frozen ``args``/``kwargs`` (the input as its spec); memoised.

    Bad arguments raise torch's own error from the meta kernel on the global
    shape, identically on every rank and before any communication; errors are
    not memoised.
    """
    kw = dict(kwargs)
    meta = func(*(_meta(a) for a in args), **kw)
    metas = (meta,) if isinstance(meta, torch.Tensor) else tuple(meta)
    b = bind_args(func, args, kw)
    spec = b["self"]
    kind = kind_of(func)
    packet = func.overloadpacket
    keep = ("sum", "avg") if packet in (aten.sum, aten.mean) else ()
    placements = tuple(
        Replicate() if issubclass(type(p), Partial) and p.reduce_op not in keep else p for p in spec.placements
    )
    resolved = None if placements == spec.placements else spec.with_layout(placements, spec.dim_sizes)
    steps = list(redistribution_steps(spec, resolved, 0)) if resolved is not None else []
    inner = resolved or spec
    empty_means_all = not (kind == "combined" and packet in (aten.any, aten.all))
    dims = reduced_dims(b.get("dim"), len(spec.global_shape), empty_means_all=empty_means_all)
    red = Reduction(inner, dims, bool(b.get("keepdim") or False))
    reduced = Partial("sum") if kind == "sum" else Replicate()
    outs = tuple(red.out_spec(m.dtype, reduced) for m in metas)
    steps.extend(_combine_steps(kind, red, inner, outs))
    return ReductionPlan(kind, resolved, red, b, tuple(m.dtype for m in metas), OpPlan(outs, tuple(steps), (resolved,)))


def _combine_steps(kind, red, spec, outs) -> list:
    """The collectives ``_combine`` issues for ``red`` (see the module docstring)."""
    if kind == "sum" or not red.mesh_dims:
        return []
    mesh = spec.mesh
    numel = prod(outs[0].local_shape)
    if not numel:
        return []
    if kind == "combined":
        itemsize = outs[0].tensor_meta.dtype.itemsize
        return [collective_step("all_gather", m, numel, itemsize, mesh.size(m)) for m in red.mesh_dims]
    if kind == "indexed":
        value_size = spec.tensor_meta.dtype.itemsize  # argmax gathers the values too
        return [
            collective_step("all_gather", m, numel, size, mesh.size(m))
            for m in red.mesh_dims
            for size in (value_size, torch.int64.itemsize)
        ]
    dtype = spec.tensor_meta.dtype
    real = dtype.to_real() if dtype.is_complex else dtype
    return [
        collective_step("all_reduce", m, numel, size, mesh.size(m))
        for size in (dtype.itemsize, real.itemsize)
        for m in red.mesh_dims
    ]


def plan_of(func, args, kwargs) -> ReductionPlan:
    """The memoised plan of a call whose tensors are ShardTensors or their specs."""
    return cached(propagate, func, freeze(args), tuple(sorted((k, freeze(v)) for k, v in kwargs.items())))


def propagate_entry(func, args, kwargs) -> OpPlan:
    """``propagation.plan``'s entry for the reductions."""
    return plan_of(func, args, kwargs).plan
