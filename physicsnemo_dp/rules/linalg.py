"""Batched linear algebra: local per matrix when the sharded dims are batch dims.

``torch.linalg`` works on the trailing one or two dims of its operands (the
*core* dims: a matrix, a vector of pivots or a right-hand side) and loops over
the leading *batch* dims, which broadcast. One rule serves every op listed in
``_CORE`` (``inv``/``inverse``, ``solve``, ``lu_factor``/``lu``/``lu_solve``,
``svd``/``svdvals``, ``qr``, ``cholesky``, ``det``/``slogdet``/``logdet``,
``eigh``/``eigvalsh``, ``lstsq``, ``solve_triangular``, ``cholesky_solve``,
``cholesky_inverse``, ``matrix_exp``, ``householder_product``: every ATen op
they and their backward formulas reach), keyed on how many trailing dims each
tensor argument holds whole.

Communication, per call:

* **Batch dims sharded** (the intended use: one small matrix per point, cell or
  sample): none. Every operand is cut to this rank's batch entries (a
  replicated operand that broadcasts along a batch dim is sliced, not moved),
  the op runs on the local batch, and every output is sharded like the batch.
* **A core (matrix) dim sharded**: the shard first moves to a batch dim (one
  all-to-all, ``unshard_dims``), or, when there is no batch dim at least as
  long as the mesh dim, the operand is **gathered** (all-gather-v): a single
  matrix sharded by rows is computed whole on every rank. The outputs stay in
  that layout (sharded along the batch dim the shard moved to, or replicated).
* **Error checks** (``torch.linalg.inv``/``solve``/``cholesky``/``lu_factor``
  and the ``*_ex`` forms with ``check_errors=True``, ``torch.cholesky``): torch
  checks the ``info`` tensor of the factorization; here that check is one
  all-reduce of a single integer over the mesh dims that shard the batch, and
  only when some matrix failed, a gather of ``info``, so that every rank raises
  torch's own message with the *global* batch index. The ``*_ex`` forms with
  ``check_errors=False`` (torch's default) communicate nothing.
* ``lstsq``: one all-reduce of two integers (whether any rank's LAPACK call
  failed, e.g. ``driver="gels"`` on a rank-deficient matrix, and whether every
  rank computed the residuals, which ``gelsd``/``gelss`` do only when every
  matrix has full rank); a failure raises on every rank.

Pending sums (``Partial``) are resolved first (none of these ops is linear).
Gradients are torch's own formulas, run by the other families on the sharded
outputs (matmul, triangular solves, ``lu_solve``...), all batch-local.
Convergence failures inside LAPACK (``svd``/``eigh`` of a matrix of NaNs) are
raised by the rank that holds the matrix; the stall check turns that into a
``PlacementError`` on the others at their next collective.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from .. import collectives
from .._agreement import _gather_messages
from ..rule_kit import (
    bind_args,
    broadcast_shape,
    meta_output,
    replicated_to_box,
    shard_tensor_cls,
    to_layout,
    unshard_dims,
    wrap,
)
from ..spec import ShardTensorSpec

aten = torch.ops.aten

_RHS = "rhs"  # a right-hand side: a vector (1 core dim) when torch reads it as one, else a matrix

#: ATen op -> {tensor argument: number of trailing core dims}.
_CORE = {
    aten.linalg_inv_ex.default: {"A": 2},
    aten._linalg_solve_ex.default: {"A": 2, "B": _RHS},
    aten.linalg_lu_factor_ex.default: {"A": 2},
    aten.linalg_lu.default: {"A": 2},
    aten.lu_unpack.default: {"LU_data": 2, "LU_pivots": 1},
    aten.linalg_lu_solve.default: {"LU": 2, "pivots": 1, "B": 2},
    aten._linalg_svd.default: {"A": 2},
    aten.linalg_qr.default: {"A": 2},
    aten.linalg_cholesky_ex.default: {"self": 2},
    aten.cholesky.default: {"self": 2},
    aten._linalg_det.default: {"A": 2},
    aten._linalg_slogdet.default: {"A": 2},
    aten._linalg_eigh.default: {"A": 2},
    aten.linalg_lstsq.default: {"self": 2, "b": _RHS},
    aten.linalg_solve_triangular.default: {"self": 2, "B": 2},
    aten.triangular_solve.default: {"self": 2, "A": 2},
    aten.cholesky_solve.default: {"self": 2, "input2": 2},
    aten.cholesky_inverse.default: {"self": 2},
    aten.linalg_matrix_exp.default: {"self": 2},
    aten.linalg_householder_product.default: {"input": 2, "tau": 1},
    aten.linalg_pinv.atol_rtol_tensor: {"self": 2, "atol": 0, "rtol": 0},  # lstsq's backward
}

#: Ops with an ``info`` output that torch checks: the api name its error messages use.
_CHECKED = {
    aten.linalg_inv_ex.default: "linalg.inv_ex",
    aten._linalg_solve_ex.default: "linalg.solve_ex",
    aten.linalg_lu_factor_ex.default: "linalg.lu_factor_ex",
    aten.linalg_cholesky_ex.default: "linalg.cholesky_ex",
}


def _is_vector_rhs(a_shape, b_shape) -> bool:
    """torch's ``linalg_solve_is_vector_rhs``: ``B`` is a (batch of) vector(s)."""
    return len(b_shape) == 1 or (len(a_shape) - 1 == len(b_shape) and tuple(b_shape) == tuple(a_shape[:-1]))


def _operands(func, bound):
    """``[(name, tensor, core dims)]`` of the call's tensor arguments."""
    core = _CORE[func]
    first = next(iter(core))
    out = []
    for name, k in core.items():
        t = bound[name]
        if t is None:  # an optional tensor not given
            continue
        if k == _RHS:
            k = 1 if _is_vector_rhs(tuple(bound[first].shape), tuple(t.shape)) else 2
        out.append((name, t, min(k, t.ndim)))
    return out


def _spec_of(t):
    return t._spec if isinstance(t, shard_tensor_cls()) else None


def _batch_layout(operands, batch):
    """Per mesh dim ``(placement, table)`` of the broadcast batch dims (``Shard(b)`` or Replicate).

    Taken from the first ShardTensor operand that spans the whole batch, after
    its core dims are made whole (``unshard_dims``); returns that operand's
    local tensor in that layout too (it is the one operand that may move).
    """
    nb = len(batch)
    for i, (name, t, k) in enumerate(operands):
        spec = _spec_of(t)
        if spec is None or tuple(t.shape[: t.ndim - k]) != batch:
            continue
        local, spec = unshard_dims(t, range(nb, t.ndim))
        layout = tuple((p, spec.dim_sizes[p.dim]) if issubclass(type(p), Shard) else (Replicate(), None) for p in spec.placements)
        return layout, (i, local, spec)
    mesh = next(_spec_of(t) for _, t, _ in operands if _spec_of(t) is not None).mesh
    return ((Replicate(), None),) * mesh.ndim, None


def _spec_for(mesh, layout, batch, shape, dtype, lead: int):
    """Spec of a tensor of ``shape`` whose dims ``lead..`` align with batch dims (the rest whole)."""
    placements, tables = [], [None] * len(shape)
    for p, table in layout:
        j = p.dim - (len(batch) - lead) if issubclass(type(p), Shard) else -1
        if issubclass(type(p), Shard) and 0 <= j < lead and shape[j] == batch[p.dim]:
            placements.append(Shard(j))
            tables[j] = table
        else:
            placements.append(Replicate())
    return ShardTensorSpec.from_sizes(mesh, placements, tuple(shape), dtype, tuple(tables))


def _call(func, bound, **overrides):
    args, kwargs = [], {}
    for a in func._schema.arguments:
        value = overrides.get(a.name, bound[a.name])
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return func(*args, **kwargs)


def _batch_mesh_dims(layout) -> list[int]:
    return [m for m, (p, _) in enumerate(layout) if issubclass(type(p), Shard)]


def _agreed_check(info_local, info_spec, api: str, is_matrix: bool) -> None:
    """torch's check of an ``info`` tensor, with the same verdict and message on every rank."""
    mesh_dims = [m for m, p in enumerate(info_spec.placements) if issubclass(type(p), Shard)]
    if not mesh_dims:
        aten._linalg_check_errors.default(info_local, api, is_matrix=is_matrix)
        return
    flag = (info_local != 0).any().to(torch.int64).reshape(1)
    for m in mesh_dims:
        flag = collectives.all_reduce(flag, "max", info_spec.mesh, m)
    if flag.item():
        whole = info_spec.with_layout((Replicate(),) * info_spec.mesh.ndim, (None,) * len(info_spec.global_shape))
        full = to_layout(wrap(info_local, info_spec), whole)
        aten._linalg_check_errors.default(full, api, is_matrix=is_matrix)


def _batched(func, args, kwargs):
    bound = bind_args(func, args, kwargs)
    lstsq = func is aten.linalg_lstsq.default  # torch has no meta kernel for it: its checks run locally
    meta = None if lstsq else meta_output(func, args, kwargs)  # global shapes; torch's checks, before any move
    operands = _operands(func, bound)
    batch = broadcast_shape(*(tuple(t.shape[: t.ndim - k]) for _, t, k in operands))
    layout, moved = _batch_layout(operands, batch)
    mesh = next(_spec_of(t) for _, t, _ in operands if _spec_of(t) is not None).mesh
    locals_ = {}
    for i, (name, t, k) in enumerate(operands):
        if moved is not None and i == moved[0]:
            locals_[name] = moved[1]
            continue
        spec = _spec_for(mesh, layout, batch, tuple(t.shape), t.dtype, t.ndim - k)
        if isinstance(t, shard_tensor_cls()):
            locals_[name] = to_layout(t, spec)
        else:
            locals_[name] = replicated_to_box(t, spec)
    check = func in _CHECKED and bound.get("check_errors")
    if lstsq:
        return _lstsq(bound, locals_, layout, batch, mesh)
    if func is aten.cholesky.default:  # checked here with torch's message, on every rank alike
        local, info = aten.linalg_cholesky_ex.default(locals_["self"], upper=bound["upper"])
        info_spec = _spec_for(mesh, layout, batch, batch, info.dtype, len(batch))
        _agreed_check(info, info_spec, "cholesky", len(batch) == 0)
        return _wrap_output(local, meta, layout, batch, mesh)
    local = _call(func, bound, **locals_, **({"check_errors": False} if check else {}))
    single = isinstance(local, torch.Tensor)
    outs = [local] if single else list(local)
    metas = [meta] if single else list(meta)
    wrapped = [_wrap_output(o, m, layout, batch, mesh) for o, m in zip(outs, metas)]
    if check:
        info = wrapped[-1]
        _agreed_check(info._local_tensor, info._spec, _CHECKED[func], len(batch) == 0)
    return wrapped[0] if single else tuple(wrapped)


def _wrap_output(local, meta, layout, batch, mesh):
    shape = tuple(meta.shape)
    nb = len(batch)
    if len(shape) >= nb and shape[:nb] == tuple(batch):
        spec = _spec_for(mesh, layout, batch, shape, local.dtype, nb)
    else:  # an output that is not computed (an empty placeholder): the same on every rank
        spec = _spec_for(mesh, ((Replicate(), None),) * mesh.ndim, batch, shape, local.dtype, 0)
    return wrap(local, spec)


def _lstsq(bound, locals_, layout, batch, mesh):
    """``lstsq`` (no meta kernel in torch): output shapes from the local results, failures agreed."""
    A = bound["self"]
    driver = bound["driver"] or ("gels" if A.device.type == "cuda" else "gelsy")
    error, outs = None, None
    try:
        outs = _call(aten.linalg_lstsq.default, bound, **locals_)
    except RuntimeError as e:  # e.g. gels on a rank-deficient matrix: only the rank holding it fails
        error = e
    nb, mesh_dims = len(batch), _batch_mesh_dims(layout)
    if not mesh_dims:  # every rank solved the same whole problem
        if error is not None:
            raise error
        whole = ((Replicate(), None),) * mesh.ndim
        return tuple(wrap(o, _spec_for(mesh, whole, batch, tuple(o.shape), o.dtype, 0)) for o in outs)
    # residuals: (*batch, k) where torch computes them (gelsd/gelss only if every matrix has full rank), else (0,)
    computed = outs is not None and outs[1].ndim == nb + 1
    flags = torch.tensor([int(error is not None), int(not computed)], dtype=torch.int64)
    for m in mesh_dims:
        flags = collectives.all_reduce(flags, "max", mesh, m)
    failed, incomplete = flags.tolist()
    if failed:
        text = next(t for t in _gather_messages("" if error is None else str(error), mesh) if t)
        raise RuntimeError(
            f"{text} (raised by the rank holding that matrix; a batch index in this message counts that "
            "rank's own batch entries: torch.linalg.lstsq ran on each rank's part of the batch)"
        )
    solution, residuals, rank, sv = outs

    def batched(local):
        return wrap(local, _spec_for(mesh, layout, batch, tuple(batch) + tuple(local.shape[nb:]), local.dtype, nb))

    def empty(local):
        spec = _spec_for(mesh, ((Replicate(), None),) * mesh.ndim, batch, (0,), local.dtype, 0)
        return wrap(local.new_empty((0,)), spec)

    return (
        batched(solution),
        empty(residuals) if incomplete else batched(residuals),
        empty(rank) if driver == "gels" else batched(rank),
        batched(sv) if driver in ("gelsd", "gelss") else empty(sv),
    )


def _check_errors(func, args, kwargs):
    """``_linalg_check_errors`` on a sharded ``info``: the same verdict and message on every rank."""
    bound = bind_args(func, args, kwargs)
    info = bound["info"]
    _agreed_check(info._local_tensor, info._spec, bound["api_name"], bound["is_matrix"])


RULES: dict = {**dict.fromkeys(_CORE, _batched), aten._linalg_check_errors.default: _check_errors}
