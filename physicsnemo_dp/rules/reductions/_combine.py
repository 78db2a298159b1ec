"""Combining per-rank partial results of a reduction, and the way back for gradients.

Each rank first reduces its own slice; only those reduced-size partial results
cross the network, one mesh dim at a time over :attr:`Reduction.mesh_dims`:

* :func:`gather_combine` all-gathers the partial results of a mesh dim's group
  and reduces the stack locally with the reduction itself (``amax`` of the
  maxima, ``logsumexp`` of the log-sum-exps, a norm of the norms, ...). Every
  rank then holds exactly torch's result: NaN propagates as torch does (a
  backend's ``max`` all-reduce does not promise that) and the order of the
  combination is the rank order, so every rank gets the same bits.
* :func:`all_reduce_sum` for sums of statistics (variance).
* :func:`pick` for value-and-index reductions (``max(dim)``, ``argmax``): the
  winner is the best value and, among ties, the lowest *global* index — what
  torch returns. Ranks with an empty slice offer the identity and an index no
  real element has, so they never win.
"""

from __future__ import annotations

import torch

from ... import collectives
from ...rule_kit import replicated_to_box, shard_tensor_cls, to_layout

#: Index offered by ranks holding no element of the reduced dims (loses every tie).
NO_INDEX = torch.iinfo(torch.int64).max


def identity(op: str, dtype: torch.dtype):
    """Identity element of ``op`` ("max", "min", "sum", "prod", "any", "all", "logsumexp")."""
    if op in ("sum", "any"):
        return False if dtype == torch.bool else 0
    if op in ("prod", "all"):
        return True if dtype == torch.bool else 1
    if op == "logsumexp":
        return -float("inf")
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point or dtype.is_complex:
        return -float("inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _gather(local: torch.Tensor, mesh, m: int) -> torch.Tensor:
    """Every group member's ``local`` of mesh dim ``m``, stacked along a new dim 0."""
    send = local.unsqueeze(0)
    if local.dtype == torch.bool:  # gloo has no bool collectives
        send = send.view(torch.uint8)
    stacked = collectives.all_gather_v(send, [1] * mesh.size(m), 0, mesh, m)
    return stacked.view(torch.bool) if local.dtype == torch.bool else stacked


def gather_combine(local: torch.Tensor, red, combine) -> torch.Tensor:
    """``combine(stack)`` over the partial results of every rank sharing this rank's output box.

    Group members along a reduced mesh dim hold outputs of the same shape (the
    kept dims are sharded by other mesh dims), so an empty output is empty on
    the whole group and needs no communication.
    """
    mesh = red.spec.mesh
    for m in red.mesh_dims:
        if local.numel():
            local = combine(_gather(local, mesh, m))
    return local


def all_reduce_sum(local: torch.Tensor, red) -> torch.Tensor:
    mesh = red.spec.mesh
    for m in red.mesh_dims:
        if local.numel():
            local = collectives.all_reduce(local, "sum", mesh, m)
    return local


def pick(values: torch.Tensor, indices: torch.Tensor, red, largest: bool):
    """Global best ``values`` with their global ``indices`` (lowest index among ties, NaN wins)."""
    mesh = red.spec.mesh
    for m in red.mesh_dims:
        if values.numel():
            vals, idxs = _gather(values, mesh, m), _gather(indices, mesh, m)
            values = vals.amax(0) if largest else vals.amin(0)
            hit = (vals == values) | (vals.isnan() & values.isnan())
            indices = torch.where(hit, idxs, NO_INDEX).amin(0)
    return values, indices


def kept_grad(grad, red) -> torch.Tensor:
    """Local gradient of a reduction's output in keepdim form, laid out to broadcast against the input.

    The gradient arrives in whatever layout autograd hands over; it is brought
    to the output layout with kept dims sharded like the input and Replicate on
    the reduced mesh dims (resolving pending sums there, the only
    communication), then given back its reduced dims as size-1 dims.
    """
    if isinstance(grad, shard_tensor_cls()):
        spec = red.grad_spec(grad._spec.tensor_meta.dtype)  # not ``grad.dtype``: a torch-function call
        local = to_layout(grad, spec)
    else:
        spec = red.grad_spec(grad.dtype)
        local = replicated_to_box(grad, spec) if grad.ndim else grad
    return red.with_kept_dims(local)
