"""Python values out of ShardTensors: ``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``, ``torch.equal``.

A training loop's first lines read a number out of a tensor (``loss.item()``,
``if loss < best:``), and every rank runs them. Each rank must get the same,
global answer, so:

* a replicated tensor (every placement ``Replicate``) answers from its local
  tensor: no communication;
* a pending sum (``Partial``) or a sharded tensor is first brought to
  ``Replicate`` (the same collective as ``full_tensor()``), so **every rank
  of the mesh must make the call**, as for any collective. Calling it on one
  rank alone (``if rank == 0: loss.item()``) waits for the others; read the
  value on every rank, then print it on one.

``torch.equal`` compares whole tensors: each rank compares its own box and one
all-reduce per mesh dim combines the verdicts (every rank must call it too).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from .. import collectives
from ..rule_kit import replicated_to_box, shard_tensor_cls, to_layout

aten = torch.ops.aten

__all__ = ["RULES", "FUNCTIONS"]


def _replicated_local(x) -> torch.Tensor:
    """The whole tensor as a local tensor: free when already replicated, else one gather (collective)."""
    spec = x._spec
    if all(issubclass(type(p), Replicate) for p in spec.placements):
        return x._local_tensor
    target = spec.with_layout((Replicate(),) * spec.mesh.ndim, (None,) * len(spec.global_shape))
    return to_layout(x, target, implicit=False)  # a Python value is the whole tensor by definition


def _local_scalar_dense(func, args, kwargs):
    (x,) = args
    numel = math.prod(x._spec.global_shape)
    if numel != 1:  # torch's message, on every rank alike (the global shape is the same everywhere)
        raise RuntimeError(f"a Tensor with {numel} elements cannot be converted to Scalar")
    return func(_replicated_local(x))


def _tolist(func, types, args, kwargs):
    (x,) = args
    return _replicated_local(x).tolist()


def _local_piece(t, spec) -> torch.Tensor:
    """``t`` (ShardTensor or plain, whole on every rank) in this rank's box of ``spec``."""
    if isinstance(t, shard_tensor_cls()):
        if t._spec.mesh != spec.mesh:
            raise ValueError("torch.equal: both ShardTensors must live on the same device mesh")
        return to_layout(t, spec)
    return replicated_to_box(t, spec)


def _equal(func, args, kwargs):
    x, y = args
    ref = x if isinstance(x, shard_tensor_cls()) else y
    other = y if ref is x else x
    if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
        return False  # global metadata: the same verdict on every rank without communicating
    spec = ref._spec
    if any(issubclass(type(p), Partial) for p in spec.placements):
        spec = spec.with_layout(
            tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements), spec.dim_sizes
        )
    same = func(_local_piece(ref, spec), _local_piece(other, spec))
    verdict = torch.tensor([int(same)], dtype=torch.int32, device=ref._local_tensor.device)
    for m in range(spec.mesh.ndim):
        verdict = collectives.all_reduce(verdict, "min", spec.mesh, m)
    return bool(verdict.item())


RULES = {
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.equal.default: _equal,
}

FUNCTIONS = {
    torch.Tensor.tolist: _tolist,
}
