"""Dispatch rules of the reductions (below autograd), one per kind of combination.

Every rule first looks up the op's plan (``_propagate.propagate``, memoised
on the op, the input's spec and the other arguments), which runs the op on a
meta tensor of the global shape: that raises torch's own error for bad
arguments (out-of-range or repeated dims, ``mean`` of an integer tensor, ...)
identically on every rank, and gives the result's dtype for ranks that
compute no local result. The rule then runs the plan: resolves the pending
reductions it names, reduces locally, and combines over the plan's mesh dims. Reductions over dims
that no mesh dim (of size > 1) shards run locally, keeping the sharding of the
other dims. Over sharded dims:

* sums (``sum``, ``mean``, ``count_nonzero``, ``nansum``) leave a pending sum
  (``Partial("sum")``) and communicate nothing; ``mean`` divides the local sum
  by the *global* count, so every element weighs the same whatever the shard
  sizes;
* ``amax``/``amin``/``max()``/``min()``, ``prod``, ``logsumexp``, norms,
  ``any``/``all`` combine the per-rank results with one all-gather of the
  reduced-size results per mesh dim (see ``_combine``) and return Replicate:
  a pending max would be resolved by the first nonlinear op anyway (and again
  by the backward's ``result == self``), so nothing is saved by deferring it;
* ``max(dim)``/``min(dim)``/``argmax``/``argmin`` gather values and global
  indices of the per-rank winners;
* ``var``/``std``/``var_mean``/``std_mean`` take two passes, each one
  all-reduce of a reduced-size statistic: the sum (giving the exact global
  mean), then the sum of squared deviations from it. No cancellation, and the
  result does not depend on the shard sizes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..._redistribute import redistribute_local
from ..._torch_compat import pytree
from ...rule_kit import bind_args, wrap
from ._combine import NO_INDEX, all_reduce_sum, gather_combine, identity, pick
from ._propagate import plan_of, propagate_entry

aten = torch.ops.aten


def _prepare(func, args, kwargs):
    """``(local, reduction, bound args, output dtype)`` from the memoised plan, pending reductions it resolves done."""
    rp = plan_of(func, args, kwargs)
    x = bind_args(func, args, kwargs)["self"]
    local = x._local_tensor if rp.resolved is None else redistribute_local(x._local_tensor, x._spec, rp.resolved)
    return local, rp.red, rp.bound, rp.out_dtypes[0]


def _local(func, local, args, kwargs):
    return func(local, *args[1:], **kwargs)


def _result(out, red, reduced=Replicate()):
    """Wrap a local result (or a tuple of them) in the reduction's output layout."""
    if isinstance(out, torch.Tensor):
        return wrap(out, red.out_spec(out.dtype, reduced))
    return tuple(wrap(t, red.out_spec(t.dtype, reduced)) for t in out)


# --------------------------------------------------------------------------- #
# Sums: pending, no communication
# --------------------------------------------------------------------------- #
def _sum_like(func, args, kwargs):
    packet = func.overloadpacket
    local, red, b, _ = _prepare(func, args, kwargs)
    if packet is aten.mean and red.mesh_dims:
        out = aten.sum.dim_IntList(local, list(red.dims), red.keepdim, dtype=b.get("dtype")) / red.count
    else:
        out = _local(func, local, args, kwargs)
    return _result(out, red, Partial("sum"))


# --------------------------------------------------------------------------- #
# Reductions combined from per-rank results
# --------------------------------------------------------------------------- #
def _norm_kind(b):
    """(identity op, combine) of a vector norm of order ``ord``/``p``."""
    order = b.get("ord", b.get("p"))
    order = 2.0 if order is None else float(order)
    if order == 0:
        return "sum", lambda s: s.sum(0)
    return ("sum" if order > 0 else "min"), lambda s: torch.linalg.vector_norm(s, order, dim=0)


_COMBINED = {
    aten.amax: lambda b: ("max", lambda s: s.amax(0)),
    aten.max: lambda b: ("max", lambda s: s.amax(0)),
    aten.amin: lambda b: ("min", lambda s: s.amin(0)),
    aten.min: lambda b: ("min", lambda s: s.amin(0)),
    aten.prod: lambda b: ("prod", lambda s: s.prod(0)),
    aten.logsumexp: lambda b: ("logsumexp", lambda s: torch.logsumexp(s, 0)),
    aten.any: lambda b: ("any", lambda s: s.any(0)),
    aten.all: lambda b: ("all", lambda s: s.all(0)),
    aten.linalg_vector_norm: _norm_kind,
    aten.norm: _norm_kind,
}


def _combined(func, args, kwargs):
    packet = func.overloadpacket
    local, red, b, dtype = _prepare(func, args, kwargs)
    if not red.mesh_dims:
        return _result(_local(func, local, args, kwargs), red)
    op, combine = _COMBINED[packet](b)
    if red.locally_empty() and red.count:
        shape = red.out_spec(dtype).local_shape
        out = torch.full(shape, identity(op, dtype), dtype=dtype, device=local.device)
    else:
        out = _local(func, local, args, kwargs)
    return _result(gather_combine(out, red, combine), red)


# --------------------------------------------------------------------------- #
# Value and global index of the best element
# --------------------------------------------------------------------------- #
def _local_best(local, red, dim, largest: bool):
    """This rank's best values and their *global* indices, in the output's local shape."""
    shape = red.out_spec(local.dtype).local_shape
    if red.locally_empty():
        values = torch.full(shape, identity("max" if largest else "min", local.dtype), dtype=local.dtype, device=local.device)
        return values, torch.full(shape, NO_INDEX, dtype=torch.int64, device=local.device)
    offsets = red.spec.local_offsets()
    if dim is None:  # index into the flattened global tensor
        flat = local.reshape(-1)
        i = flat.argmax() if largest else flat.argmin()
        coords = torch.unravel_index(i, tuple(local.shape))
        strides = red.spec.tensor_meta.stride
        index = sum((c + o) * s for c, o, s in zip(coords, offsets, strides))
        return flat[i].reshape(shape), index.reshape(shape)
    values, index = (torch.max if largest else torch.min)(local, dim, red.keepdim)
    return values, index + offsets[red.dims[0]]


def _indexed(func, args, kwargs):
    packet = func.overloadpacket
    local, red, b, _ = _prepare(func, args, kwargs)
    if not red.mesh_dims:
        out = _local(func, local, args, kwargs)
    else:
        if red.count == 0:  # torch's error, raised by every rank alike
            _local(func, local, args, kwargs)
        largest = packet in (aten.max, aten.argmax)
        values, index = pick(*_local_best(local, red, b.get("dim"), largest), red, largest)
        out = index if packet in (aten.argmax, aten.argmin) else (values, index)
    return _result(out, red)


# --------------------------------------------------------------------------- #
# Moments: two passes, two all-reduces of reduced-size statistics
# --------------------------------------------------------------------------- #
def _moments(func, args, kwargs):
    packet = func.overloadpacket
    local, red, b, _ = _prepare(func, args, kwargs)
    if not red.mesh_dims:
        out = _local(func, local, args, kwargs)
    else:
        dims = list(red.dims)
        mean = all_reduce_sum(local.sum(dims, keepdim=True), red) / red.count
        dev = local - mean
        # |dev|^2 from the parts: a lazy dev.conj() would be read unconjugated here (inside
        # __torch_dispatch__ torch does not resolve the conjugate bit), giving dev * dev.
        square = dev.real.square() + dev.imag.square() if dev.is_complex() else dev * dev
        m2 = all_reduce_sum(square.sum(dims, keepdim=True), red)
        correction = 1 if b.get("correction") is None else b["correction"]
        var = m2 / max(red.count - correction, 0)
        first = var.sqrt() if packet in (aten.std, aten.std_mean) else var
        out = (first, mean) if packet in (aten.var_mean, aten.std_mean) else first
        if not red.keepdim:
            out = pytree.tree_map(lambda t: t.squeeze(dims), out)
    return _result(out, red)


RULES: dict = {
    **{
        op: _sum_like
        for op in (
            aten.sum.default,
            aten.sum.dim_IntList,
            aten.mean.default,
            aten.mean.dim,
            aten.nansum.default,
            aten.count_nonzero.default,
            aten.count_nonzero.dim_IntList,
        )
    },
    **{
        op: _combined
        for op in (
            aten.amax.default,
            aten.amin.default,
            aten.max.default,
            aten.min.default,
            aten.prod.default,
            aten.prod.dim_int,
            aten.logsumexp.default,
            aten.linalg_vector_norm.default,
            aten.norm.Scalar,
            aten.norm.ScalarOpt_dim,
            aten.norm.ScalarOpt_dim_dtype,
            aten.norm.ScalarOpt_dtype,
            aten.any.default,
            aten.any.dim,
            aten.any.dims,
            aten.all.default,
            aten.all.dim,
            aten.all.dims,
        )
    },
    **{op: _indexed for op in (aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)},
    **{
        op: _moments
        for op in (aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
    },
}

#: ``propagation.plan`` entries: every reduction plans apart from execution (``_propagate``).
PROPAGATORS: dict = dict.fromkeys(RULES, propagate_entry)
