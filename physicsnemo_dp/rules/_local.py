"""One torch call on aligned local pieces, differentiated by torch's own backward of that local call.

The losses (:mod:`.losses`) and the channel ops (:mod:`.channel_ops`) are ops
whose result on a rank's box depends only on the operands' values in (or
broadcast to) that box, once their layouts agree. ``local_call(job, *operands)``
runs such an op inside the autograd Function :class:`LocalCall`:

* an ``aligned(spec)`` operand is redistributed to ``spec`` (nothing moves when
  it is already there); its gradient comes back to the operand's own gradient
  layout (``grad_like``);
* a ``cut(dims)`` operand (weights, broadcasting operands) is read whole on
  every rank, then cut to this rank's box of the job's ``common`` layout along
  ``dims`` (operand dim -> common dim, ``None``: kept whole; extent-1 dims
  broadcast and are kept). Its local gradient is put back into a zero tensor of
  the whole shape, a pending sum over the mesh dims that shard ``common``,
  reduced by whoever reads it (the promotion step of a plain weight).

The job's ``fn`` is torch's op on plain local tensors, run with autograd on,
so its backward is torch's (and its errors, e.g. a weight torch does not
differentiate, are torch's, raised alike on every rank). Double backward is not
supported (``once_differentiable``).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._torch_compat import Function, once_differentiable
from ..promotion import promote
from ..rule_kit import grad_like, shard_tensor_cls, to_layout, unshard_target, wrap

__all__ = [
    "Job",
    "aligned",
    "cut",
    "trailing",
    "local_call",
    "spec_of",
    "replicated_spec",
    "as_shard",
    "resolved",
    "without_dim",
    "sharding_mesh_dims",
]


# --------------------------------------------------------------------------- #
# Layouts
# --------------------------------------------------------------------------- #
def spec_of(spec, placements, shape, dtype, dim_sizes):
    """A layout on ``spec``'s mesh with the given placements, global shape, dtype and size tables."""
    return type(spec).from_sizes(spec.mesh, placements, tuple(shape), dtype, tuple(dim_sizes))


def replicated_spec(spec, shape, dtype):
    """A fully replicated layout of ``shape`` on ``spec``'s mesh."""
    return spec_of(spec, (Replicate(),) * spec.mesh.ndim, shape, dtype, (None,) * len(shape))


def as_shard(t, like):
    """``t`` as a ShardTensor on ``like``'s mesh.

    A plain tensor here skipped the hooks' promotion (a 0-dim target without
    grad, or the ``weight`` torch does not pass on for ``l1_loss``): promoted
    now, so a gradient it needs is summed over the mesh like any promoted weight's.
    """
    if t is None or isinstance(t, shard_tensor_cls()):
        return t
    return promote(t, like._spec.mesh)


def resolved(spec):
    """``spec`` with pending sums replaced by Replicate (the layout an operand is computed in)."""
    return unshard_target(spec, ())


def without_dim(spec, dim, dtype):
    """``spec`` with tensor dim ``dim`` (not sharded) removed."""
    placements = tuple(Shard(p.dim - (p.dim > dim)) if issubclass(type(p), Shard) else p for p in spec.placements)
    shape = spec.global_shape[:dim] + spec.global_shape[dim + 1 :]
    sizes = spec.dim_sizes[:dim] + spec.dim_sizes[dim + 1 :]
    return spec_of(spec, placements, shape, dtype, sizes)


def sharding_mesh_dims(spec):
    return tuple(m for m, p in enumerate(spec.placements) if issubclass(type(p), Shard))


# --------------------------------------------------------------------------- #
# Operands and the Function
# --------------------------------------------------------------------------- #
class _Operand:
    __slots__ = ("spec", "dims")

    def __init__(self, spec=None, dims=None):
        self.spec, self.dims = spec, dims


def aligned(spec):
    """An operand computed in layout ``spec``."""
    return _Operand(spec=spec)


def cut(dims):
    """An operand read whole and cut to the box of the job's common layout along ``dims`` (per operand dim)."""
    return _Operand(dims=tuple(dims))


def trailing(ndim, common_ndim):
    """``cut`` for an operand that broadcasts against the common layout (dims aligned from the right)."""
    return cut(range(common_ndim - ndim, common_ndim))


class Job:
    """One call: ``fn`` on the local pieces, each operand's mode, the common layout, the outputs' layouts."""

    __slots__ = ("fn", "operands", "common", "out_specs")

    def __init__(self, fn, operands, common, out_specs):
        self.fn, self.operands, self.common, self.out_specs = fn, tuple(operands), common, tuple(out_specs)

    def _cuts(self, shape, dims):
        offsets = self.common.local_offsets()
        local = self.common.local_shape
        for d, cd in enumerate(dims):
            if cd is not None and self.common.dim_sizes[cd] is not None and shape[d] != 1:
                yield d, offsets[cd], local[cd]

    def local(self, i, t):
        how = self.operands[i]
        if how.spec is not None:
            return to_layout(t, how.spec)
        whole = to_layout(t, replicated_spec(t._spec, tuple(t.shape), t.dtype))
        for d, start, length in self._cuts(tuple(t.shape), how.dims):
            whole = whole.narrow(d, start, length)
        return whole

    def grad(self, i, g, spec):
        """The local gradient ``g`` of operand ``i`` as a ShardTensor in that operand's gradient layout."""
        how = self.operands[i]
        if how.spec is not None:
            return grad_like(wrap(g, how.spec), spec)
        shape = tuple(spec.global_shape)
        cuts = list(self._cuts(shape, how.dims))
        if cuts:  # put the box back into a whole-size tensor: the other ranks' boxes add to it
            full = g.new_zeros(shape)
            region = full
            for d, start, length in cuts:
                region = region.narrow(d, start, length)
            region.copy_(g)
            g = full
        sharding = sharding_mesh_dims(self.common)
        placements = tuple(Partial() if m in sharding else Replicate() for m in range(spec.mesh.ndim))
        return grad_like(wrap(g, spec_of(spec, placements, shape, g.dtype, (None,) * len(shape))), spec)


class LocalCall(Function):
    """``job.fn`` on the local pieces; the first output carries the gradient, the others none."""

    @staticmethod
    def forward(ctx, job, *operands):
        local = [job.local(i, t) for i, t in enumerate(operands)]
        needs = [ctx.needs_input_grad[i + 1] for i in range(len(local))]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() if need else t for t, need in zip(local, needs)]
            with warnings.catch_warnings():  # torch's warnings about shapes were given once, on the global shapes
                warnings.simplefilter("ignore")
                outs = job.fn(*leaves)
        ctx.job, ctx.leaves, ctx.first = job, leaves, outs[0]
        ctx.specs = [t._spec for t in operands]
        ctx.needs = needs
        results = tuple(wrap(o.detach(), s) for o, s in zip(outs, job.out_specs))
        ctx.mark_non_differentiable(*results[1:])
        ctx.set_materialize_grads(False)
        return results if len(results) > 1 else results[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, *_):
        n = len(ctx.leaves)
        if grad is None:
            return (None,) * (n + 1)
        job = ctx.job
        spec = job.out_specs[0]
        if isinstance(grad, shard_tensor_cls()):
            g = to_layout(grad, spec)
        else:  # a plain gradient is the whole tensor on every rank
            g = to_layout(wrap(grad, replicated_spec(spec, tuple(grad.shape), grad.dtype)), spec)
        wanted = [i for i in range(n) if ctx.needs[i]]
        grads = torch.autograd.grad(ctx.first, [ctx.leaves[i] for i in wanted], g, allow_unused=True)
        result = [None] * n
        for i, gi in zip(wanted, grads):
            if gi is None:
                gi = torch.zeros_like(ctx.leaves[i])
            result[i] = job.grad(i, gi, ctx.specs[i])
        ctx.leaves = ctx.first = None
        return (None, *result)


def local_call(job, *operands):
    """Run ``job`` on ShardTensor ``operands``: a tuple of the outputs (ShardTensors in ``job.out_specs``)."""
    out = LocalCall.apply(job, *operands)
    return out if isinstance(out, tuple) else (out,)
