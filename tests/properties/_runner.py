"""Run one drawn :class:`~._strategies.Case` on every rank and check it against one process.

Test-process side: :func:`check_case` ships the case as one harness job to the pool of
its world size (``tests._harness.run_job``) and turns the ranks' findings into one
``AssertionError`` that Hypothesis can shrink.

Rank side: :func:`_rank_body` builds every input's global tensor from the seed (the
same on every rank), cuts this rank's box, stores it in the drawn memory layout, wraps
it with ``ShardTensor.from_local(..., sharding_shapes=<explicit sizes>)``, runs the op
and compares with the op on the global tensors:

- forward values (dtype-dependent tolerances, exact for integer/bool outputs);
- gradients of every input for a random cotangent in the output's own layout;
- metadata: shape, dtype, requires_grad; ``full_tensor()`` contiguous with the
  reference's contiguous strides; ``is_contiguous()`` equal to the local tensor's;
  placements valid for the output's ndim; the local shape equal to the spec's box.

Findings are *returned*, not raised, after every collective of the case has run, so a
wrong value on one rank cannot leave the others waiting in a collective; an exception
in the op itself is caught the same way (ops raise on every rank alike).
"""

from __future__ import annotations

import dataclasses
import traceback

import torch
from hypothesis import assume, event
from hypothesis.control import currently_in_test_context
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensor, ShardTensorSpec
from tests._harness import run_job

from ..core._util import box
from ._ops import OPS
from ._strategies import DTYPES, Case, InputCase

JOB_TIMEOUT = 30.0  # seconds; a case is a few ms of work, a hang shows within this

#: (rtol, atol relative to the reference's largest magnitude)
_TOL = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.complex64: (1e-4, 1e-4),
    torch.complex128: (1e-9, 1e-9),
    torch.bfloat16: (4e-2, 4e-2),
}


#: Prefix of the memory-layout findings (``full_tensor()`` strides, ``is_contiguous()``):
#: ``test_contiguity.py`` checks them for every family, the family tests check the rest,
#: so one layout bug does not hide every other finding of a family.
CONTIGUITY = "[contiguity] "


def check_case(case: Case, *, contiguity: bool | None = False) -> None:
    """Run ``case`` on its pool; raise ``AssertionError`` with every rank's findings
    (only the :data:`CONTIGUITY` ones if ``contiguity``, all others if false, all if ``None``)."""
    if currently_in_test_context():  # not when a case is replayed by hand
        event(f"op {case.op}")  # --hypothesis-show-statistics shows what the examples covered
        event(f"mesh {case.mesh_shape}" + ("" if case.rank_order is None else " permuted"))
        for desc in case.inputs:
            for memory in set(desc.memory):
                event(f"memory {memory}")
    outcomes = run_job(case.world_size, case.mesh_shape, __name__, "_rank_body", {"case": case}, timeout=JOB_TIMEOUT)
    values = [o.value for o in outcomes]
    if any(v == "invalid" for v in values):
        assume(False)  # the op itself refuses these inputs
        return
    problems = {}
    for rank, found in enumerate(values):
        for problem in found:
            if contiguity is not None and problem.startswith(CONTIGUITY) != contiguity:
                continue
            problems.setdefault(problem, []).append(rank)
    if problems:
        lines = [f"ranks {ranks}: {p}" for p, ranks in problems.items()]
        raise AssertionError(f"{case.op}: {len(problems)} finding(s)\n" + "\n".join(lines))


# ----------------------------------------------------------------------------- rank side
def _global(desc: InputCase, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if desc.kind != "float":
        return torch.randint(0, max(desc.kind[1], 1), desc.shape, generator=gen)
    shape = list(desc.shape)
    if desc.constant_dim is not None:
        shape[desc.constant_dim] = 1
    values = torch.randn(shape, generator=gen, dtype=torch.complex128 if dtype.is_complex else torch.float64)
    return values.expand(desc.shape).to(dtype).contiguous()


def _store(piece: torch.Tensor, memory: str, constant_dim: int | None) -> torch.Tensor:
    """``piece``'s values in memory layout ``memory`` (see ``_strategies.MEMORY_LAYOUTS``)."""
    if memory == "transposed":
        return piece.transpose(-1, -2).contiguous().transpose(-1, -2)
    if memory == "permuted":
        order = [0, *range(2, piece.ndim), 1]
        inverse = sorted(range(piece.ndim), key=order.__getitem__)
        return piece.permute(order).contiguous().permute(inverse)
    if memory == "expanded":
        return piece.narrow(constant_dim, 0, min(1, piece.shape[constant_dim])).clone().expand(piece.shape) \
            if piece.shape[constant_dim] > 0 else piece.clone()
    if memory == "offset":
        buffer = torch.zeros([n + 2 for n in piece.shape], dtype=piece.dtype)
        inner = buffer[tuple(slice(1, 1 + n) for n in piece.shape)]
        inner.copy_(piece)
        return inner
    return piece.clone()


def _sharded(ctx, desc: InputCase, full: torch.Tensor) -> ShardTensor:
    spec = ShardTensorSpec.from_sizes(ctx.mesh, desc.placements, desc.shape, full.dtype, desc.dim_sizes)
    local = _store(full[box(spec)], desc.memory[ctx.rank], desc.constant_dim)
    assert torch.equal(local, full[box(spec)])  # a memory layout never changes values
    nested = any(sum(p == Shard(d) for p in desc.placements) > 1 for d in range(len(desc.shape)))
    if nested:
        shapes = "infer"
    else:
        shapes = {}
        for m, p in enumerate(desc.placements):
            if isinstance(p, Shard):
                shapes[m] = [tuple(n if k == p.dim else local.shape[k] for k in range(local.ndim))
                             for n in desc.dim_sizes[p.dim]]
    return ShardTensor.from_local(local, ctx.mesh, desc.placements, sharding_shapes=shapes, global_shape=desc.shape)


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _compare(actual: torch.Tensor, expected: torch.Tensor, what: str) -> list[str]:
    if tuple(actual.shape) != tuple(expected.shape):
        return [f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"]
    if actual.dtype != expected.dtype:
        return [f"{what}: dtype {actual.dtype} != {expected.dtype}"]
    if not (expected.is_floating_point() or expected.is_complex()):
        return [] if torch.equal(actual, expected) else [f"{what}: values differ (exact dtype {expected.dtype})"]
    rtol, atol = _TOL[expected.dtype]
    a, e = actual.to(torch.complex128 if expected.is_complex() else torch.float64), expected.to(
        torch.complex128 if expected.is_complex() else torch.float64)
    scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
    if not torch.allclose(a, e, rtol=rtol, atol=atol * scale, equal_nan=True):
        return [f"{what}: max abs diff {(a - e).abs().nan_to_num(0).max().item():.3e} (scale {scale:.3g})"]
    return []


def _metadata(ctx, op, out: ShardTensor, ref: torch.Tensor, full: torch.Tensor, what: str) -> list[str]:
    found = []
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        found.append(f"{what}: metadata shape/dtype {tuple(out.shape)}/{out.dtype} != {tuple(ref.shape)}/{ref.dtype}")
    if out.requires_grad != ref.requires_grad:
        found.append(f"{what}: requires_grad {out.requires_grad} != reference {ref.requires_grad}")
    expected = _contiguous_stride(ref.shape)
    if not full.is_contiguous() or full.numel() and any(n > 1 and a != e for n, a, e in zip(ref.shape, full.stride(), expected)):
        found.append(f"{CONTIGUITY}{what}: full_tensor() has stride {full.stride()}, expected contiguous {expected}")
    local = out._local_tensor
    if op.contiguous_output and not (out.is_contiguous() and local.is_contiguous()):
        found.append(f"{CONTIGUITY}{what}: is_contiguous() {out.is_contiguous()}, local stride {local.stride()}: "
                     "expected contiguous memory")
    if out.is_contiguous() != local.is_contiguous():
        found.append(f"{CONTIGUITY}{what}: is_contiguous() {out.is_contiguous()} but the local tensor's is {local.is_contiguous()} "
                     f"(local stride {local.stride()})")
    placements = out.placements
    if len(placements) != ctx.mesh.ndim or not all(
        isinstance(p, (Replicate, Partial)) or (isinstance(p, Shard) and 0 <= p.dim < out.ndim) for p in placements
    ):
        found.append(f"{what}: placements {placements} invalid for a {out.ndim}-d output on a {ctx.mesh.ndim}-d mesh")
    elif tuple(local.shape) != tuple(out._spec.local_shape):
        found.append(f"{what}: local shape {tuple(local.shape)} != the spec's box {tuple(out._spec.local_shape)}")
    return found


def _cotangent(ctx, out, ref: torch.Tensor, gen: torch.Generator):
    """The same random cotangent for both, the sharded one in ``out``'s gradient layout."""
    values = torch.randn(ref.shape, generator=gen, dtype=torch.complex128 if ref.is_complex() else torch.float64)
    values = values.to(ref.dtype).to(ref.device)
    if not isinstance(out, ShardTensor):
        return values, values
    spec = out._spec
    gspec = spec.with_layout(tuple(Replicate() if p.is_partial() else p for p in spec.placements), spec.dim_sizes)
    return ShardTensor(values[box(gspec)].clone(), gspec, requires_grad=False), values


#: Meshes over permuted ranks this worker built, by (shape, order): a mesh's process
#: groups are made once per worker (every rank of the pool runs the same jobs, so every
#: rank creates them in the same order).
_PERMUTED_MESHES: dict = {}


def _mesh_of(ctx, case: Case) -> DeviceMesh:
    if case.rank_order is None:
        return ctx.mesh
    key = (case.mesh_shape, case.rank_order)
    if key not in _PERMUTED_MESHES:
        ranks = torch.tensor(case.rank_order).reshape(case.mesh_shape)
        _PERMUTED_MESHES[key] = DeviceMesh(ctx.device.type, ranks, mesh_dim_names=ctx.mesh.mesh_dim_names)
    return _PERMUTED_MESHES[key]


def _rank_body(ctx, case: Case):
    """Build, run and check ``case`` on this rank; return its findings (``"invalid"`` if
    the op refuses the inputs even on one process)."""
    ctx = dataclasses.replace(ctx, mesh=_mesh_of(ctx, case))
    op = OPS[case.op]
    dtype = DTYPES[case.dtype]
    fulls = [_global(desc, dtype, case.seed + 7919 * i).to(ctx.device) for i, desc in enumerate(case.inputs)]
    differentiable = [case.requires_grad and desc.kind == "float" for desc in case.inputs]
    refs = [f.clone().requires_grad_(g) for f, g in zip(fulls, differentiable)]
    try:
        ref_out = op.fn(*refs, **case.args)
    except Exception:
        return "invalid"
    try:
        return _check(ctx, case, op, fulls, refs, ref_out, differentiable)
    except Exception as exc:  # ops and collectives raise on every rank alike: the pool stays in step
        return [f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"]


def _check(ctx, case: Case, op, fulls, refs, ref_out, differentiable) -> list[str]:
    inputs = [f.clone() if desc.placements is None else _sharded(ctx, desc, f) for desc, f in zip(case.inputs, fulls)]
    inputs = [t.requires_grad_(g) for t, g in zip(inputs, differentiable)]
    out = op.fn(*inputs, **case.args)
    found = []
    outs, ref_outs = _flat(out), _flat(ref_out)
    if len(outs) != len(ref_outs):
        return [f"{len(outs)} outputs, reference has {len(ref_outs)}"]
    for k, (o, r) in enumerate(zip(outs, ref_outs)):
        what = f"output {k}"
        if not isinstance(o, ShardTensor):
            found.append(f"{what}: a plain {type(o).__name__}, expected a ShardTensor")
            continue
        full = o.full_tensor()
        found += _compare(full.detach(), r.detach(), what)
        found += _metadata(ctx, op, o, r, full, what)
    if not case.requires_grad:  # the same on every rank: backward's collectives stay in step
        return found
    pairs = [(o, r) for o, r in zip(outs, ref_outs) if r.requires_grad and isinstance(o, ShardTensor)]
    if not pairs:
        return found
    gen = torch.Generator().manual_seed(case.seed + 1)
    cotangents = [_cotangent(ctx, o, r, gen) for o, r in pairs]
    torch.autograd.backward([r for _, r in pairs], [c for _, c in cotangents])
    torch.autograd.backward([o for o, _ in pairs], [c for c, _ in cotangents])
    for i, (t, r) in enumerate(zip(inputs, refs)):
        if r.grad is None:
            continue
        what = f"grad of input {i}"
        if t.grad is None:
            found.append(f"{what}: missing")
        elif case.inputs[i].placements is None:
            if isinstance(t.grad, ShardTensor):
                found.append(f"{what}: a ShardTensor for a plain input")
            else:
                found += _compare(t.grad, r.grad, what)
        elif not isinstance(t.grad, ShardTensor):
            found.append(f"{what}: a plain tensor for a ShardTensor input")
        else:
            found += _compare(t.grad.full_tensor(), r.grad, what)
    return found
