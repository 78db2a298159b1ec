"""``check_all_ranks``: one rank's data error becomes every rank's error, before anyone blocks.

The pipe reads without communicating, so a rank that finds bad data (a NaN in
its slab under ``validate=True``, a missing file) is the only one that knows.
If it simply raised, the other ranks would walk into the step's first
collective and wait for it forever. Calling :func:`check_all_ranks` once per
step, after reading and before the first collective, turns that into the same
exception on every rank: the normal path costs one all-reduce of one integer
per mesh dim (measured in ``docs/reliability.md``); the details of the failing
ranks' errors travel only when something failed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_all_ranks"]


def check_all_ranks(error: BaseException | None, group=None) -> None:
    """Raise the same exception on every rank of ``group`` if ``error`` is not None on any of them.

    Collective: every rank of ``group`` calls it, with the exception it caught
    (or None). ``group`` is a ProcessGroup, a DeviceMesh (all of its dims) or
    None (the default group). The raised exception has the type of the first
    failing rank's error (e.g. :class:`~datapipes.errors.InvalidValuesError`;
    ``RuntimeError`` if that type cannot be built from a message); its
    message lists every failing rank's error message (which names the file,
    variable, sample and rank for validation errors). On a failing rank the
    raised exception is chained to the original.
    """
    groups = _groups(group)
    if not dist.is_initialized() or not groups:
        if error is not None:
            raise error
        return
    device = _device(groups[0])
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    for g in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
    if not flag.item():
        return
    failures = [None if error is None else (dist.get_rank(), type(error), f"{type(error).__name__}: {error}")]
    for g in groups:  # gather along each dim in turn: after the last, every rank holds everyone's
        gathered: list = [None] * dist.get_world_size(g)
        dist.all_gather_object(gathered, failures, group=g)
        failures = [f for part in gathered for f in part]
    failures = sorted((f for f in failures if f is not None), key=lambda f: f[0])
    ranks = ", ".join(str(f[0]) for f in failures)
    detail = "\n".join(f"  rank {r}: {text}" for r, _, text in failures)
    message = f"rank(s) {ranks} failed, so every rank stops here:\n{detail}"
    try:
        raised = failures[0][1](message)
    except Exception:  # a type whose constructor wants more than a message
        raised = RuntimeError(message)
    raise raised from error


def _groups(group) -> list:
    if isinstance(group, DeviceMesh):
        return [group.get_group(d) for d in range(group.ndim)]
    if not dist.is_initialized():
        return []
    return [group if group is not None else dist.group.WORLD]


def _device(group) -> torch.device:
    """Where the flag lives: NCCL reduces device tensors only, gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
