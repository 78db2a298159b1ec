"""Redistribution transitions and sum/mean, against the minimum bytes each needs.

The minimum counts, for every rank, the bytes it must receive because it does
not hold them: for a gather, the rows it lacks; for ``Shard(a) -> Shard(b)``,
its target block minus what it already has; for ``Partial -> Shard``, the
other ranks' contributions to its shard; for a resolved pending sum
(``Partial -> Replicate``, a sum or mean over the sharded dim), the
bandwidth-optimal ring all-reduce volume ``2 (P-1)/P n``.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensor, ShardTensorSpec, count_collectives
from physicsnemo_dp._conversion import Redistribute
from physicsnemo_dp.collectives import mesh_device
from physicsnemo_dp.split import chunk_sizes

from .._models import uneven_sizes
from .._record import Result, over_ranks
from ._dtensor import DTensorTraffic

SUITE = "comm_volume"
#: DTensor warns once per process that gloo has no all-to-all (the fallback is what we measure).
_GLOO_ALLTOALL_WARNING = "torch.distributed.tensor._collective_utils"


def _ring(numel: int, elem: int, P: int) -> int:
    return numel * elem * 2 * (P - 1) // P


def _ops(rows: int, cols: int, P: int, me: int, mine: int, elem: int):
    """``(name, input, fn, minimum bytes into this rank)`` for every measured operation.

    ``input`` names the operand: ``"shard"`` (sharded along dim 0, this rank
    holds ``mine`` rows), ``"partial"`` (a pending sum) or ``"replicate"``.
    """
    my_cols, my_rows = chunk_sizes(cols, P)[me], chunk_sizes(rows, P)[me]
    return [
        ("Shard(0)->Replicate (all-gather)", "shard", lambda x: x.redistribute(x.device_mesh, [Replicate()]),
         (rows - mine) * cols * elem),
        ("Shard(0)->Shard(1) (all-to-all)", "shard", lambda x: x.redistribute(x.device_mesh, [Shard(1)]),
         (rows - mine) * my_cols * elem),
        ("Replicate->Shard(0) (local slice)", "replicate", lambda x: x.redistribute(x.device_mesh, [Shard(0)]), 0),
        ("Partial->Shard(0) (reduce-scatter)", "partial", lambda x: x.redistribute(x.device_mesh, [Shard(0)]),
         (P - 1) * my_rows * cols * elem),
        ("Partial->Replicate (all-reduce)", "partial", lambda x: x.redistribute(x.device_mesh, [Replicate()]),
         _ring(rows * cols, elem, P)),
        ("sum over the sharded dim, resolved", "shard", lambda x: x.sum(0).full_tensor(), _ring(cols, elem, P)),
        ("mean over the sharded dim, resolved", "shard", lambda x: x.mean(0).full_tensor(), _ring(cols, elem, P)),
        ("sum of all, resolved", "shard", lambda x: x.sum().full_tensor(), _ring(1, elem, P)),
        ("sum over an unsharded dim", "shard", lambda x: x.sum(1), 0),
        ("mean over an unsharded dim", "shard", lambda x: x.mean(1), 0),
    ]  # fmt: skip


def _inputs(mesh, shape, rows_sizes) -> dict[str, ShardTensor]:
    return {
        "shard": _shard_tensor(mesh, [Shard(0)], shape, (rows_sizes, None)),
        "partial": _shard_tensor(mesh, [Partial()], shape, (None, None)),
        "replicate": _shard_tensor(mesh, [Replicate()], shape, (None, None)),
    }


def _shard_tensor(mesh, placements, shape, sizes, dtype=torch.float32) -> ShardTensor:
    spec = ShardTensorSpec.from_sizes(mesh, placements, shape, dtype, sizes)
    return ShardTensor.from_spec(torch.ones(spec.local_shape, dtype=dtype, device=mesh_device(mesh)), spec)


def run(mesh, rows: int, cols: int, compare_dtensor: bool = False) -> list[Result]:
    P, me, elem = mesh.size(), mesh.get_local_rank(), 4
    shape = (rows, cols)
    inputs = _inputs(mesh, shape, uneven_sizes(rows, P))
    x = inputs["shard"]
    mine = x.spec.local_shape[0]
    results = []
    for name, operand, fn, minimum in _ops(rows, cols, P, me, mine, elem):
        with count_collectives() as counter:
            fn(inputs[operand])
        results.append(Result(SUITE, f"{name}, uneven", P, over_ranks(counter.total_received), over_ranks(minimum),
                              "bytes", ("<=", 1.1)))  # fmt: skip
    balanced = ShardTensorSpec.chunked(mesh, [Shard(0)], shape, torch.float32)
    start, end = x.offsets(0), x.offsets(0) + mine
    lo, hi = balanced.offsets(0), balanced.offsets(0) + balanced.local_shape[0]
    lacking = (hi - lo) - max(0, min(end, hi) - max(start, lo))
    with count_collectives() as counter:
        Redistribute.apply(x, balanced)
    results.append(Result(SUITE, "rebalance uneven -> chunk sizes (all-to-all)", P, over_ranks(counter.total_received),
                          over_ranks(lacking * cols * elem), "bytes", ("<=", 1.1)))  # fmt: skip
    if compare_dtensor:
        results += _versus_dtensor(mesh, rows, cols)
    return results


def _versus_dtensor(mesh, rows: int, cols: int) -> list[Result]:
    """The same operations on even (chunk-rule) shards, ShardTensor's bytes over DTensor's."""
    P, me = mesh.size(), mesh.get_local_rank()
    shape = (rows, cols)
    ours = _inputs(mesh, shape, chunk_sizes(rows, P))
    theirs = {
        kind: DTensor.from_local(t.to_local(), mesh, t.placements, shape=shape, stride=(cols, 1))
        for kind, t in ours.items()
    }
    results = []
    for name, operand, fn, _ in _ops(rows, cols, P, me, ours["shard"].spec.local_shape[0], 4):
        with count_collectives() as counted:
            fn(ours[operand])
        with DTensorTraffic(mesh) as traffic, _quiet(_GLOO_ALLTOALL_WARNING):
            fn(theirs[operand])
        results.append(Result(SUITE, f"{name}, even: ShardTensor / DTensor", P, over_ranks(counted.total_received),
                              over_ranks(traffic.received), "bytes", ("<=", 1.0)))  # fmt: skip
    return results


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silence a logger's warnings inside the block."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
