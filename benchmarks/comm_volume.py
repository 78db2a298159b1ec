"""Bytes each redistribution moves, against the minimum the transition needs.

The minimum counts, for every rank, the bytes it must receive because it
does not hold them: for a gather, the rows it lacks; for ``Shard(a) ->
Shard(b)``, its target block minus what it already has; for ``Partial ->
Shard``, the other ranks' contributions to its shard; for ``Partial ->
Replicate``, the bandwidth-optimal ring all-reduce volume. Values and minima
are summed over all ranks; ratio = moved / minimum (target <= 1.1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensor, ShardTensorSpec, count_collectives
from physicsnemo_dp.split import chunk_sizes

from ._record import Result


def _uneven(total: int, parts: int) -> tuple[int, ...]:
    """Strongly uneven sizes with an empty shard (when parts > 2)."""
    weights = [3, 0, 1, 5, 2, 7][:parts] if parts > 2 else [3, 1][:parts]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return tuple(sizes)


def _sum_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _shard(mesh, placements, shape, sizes, dtype=torch.float32):
    spec = ShardTensorSpec.from_sizes(mesh, placements, shape, dtype, sizes)
    return ShardTensor(torch.ones(spec.local_shape, dtype=dtype), spec, requires_grad=False)


def run(mesh, rows: int = 4096, cols: int = 256) -> list[Result]:
    P, me = mesh.size(), mesh.get_local_rank()
    elem = 4
    shape = (rows, cols)
    uneven = (_uneven(rows, P), None)
    cases = []

    x = _shard(mesh, [Shard(0)], shape, uneven)
    mine = x._spec.local_shape[0]
    cases.append(("Shard(0)->Replicate (uneven all-gather)", x, [Replicate()], (rows - mine) * cols * elem))
    target_cols = chunk_sizes(cols, P)[me]
    cases.append(("Shard(0)->Shard(1) (uneven all-to-all)", x, [Shard(1)], (rows - mine) * target_cols * elem))
    p = _shard(mesh, [Partial()], shape, (None, None))
    my_rows = chunk_sizes(rows, P)[me]
    cases.append(("Partial->Shard(0) (reduce-scatter)", p, [Shard(0)], (P - 1) * my_rows * cols * elem))
    ring = 2 * (P - 1) * rows * cols * elem // P
    cases.append(("Partial->Replicate (all-reduce)", p, [Replicate()], ring))
    balanced = _shard(mesh, [Shard(0)], shape, (chunk_sizes(rows, P), None))
    src_rows = set(range(x.offsets(0), x.offsets(0) + mine))
    dst_rows = set(range(balanced.offsets(0), balanced.offsets(0) + my_rows))
    from physicsnemo_dp._conversion import Redistribute

    results = []
    for name, src, dst, minimum in cases:
        with count_collectives() as counter:
            src.redistribute(placements=dst)
        results.append(Result("comm_volume", name, P, _sum_over_ranks(counter.total_received),
                              _sum_over_ranks(minimum), "bytes", ("<=", 1.1)))
    with count_collectives() as counter:
        Redistribute.apply(x, balanced._spec)
    results.append(Result("comm_volume", "rebalance uneven->chunk (all-to-all)", P,
                          _sum_over_ranks(counter.total_received),
                          _sum_over_ranks(len(dst_rows - src_rows) * cols * elem), "bytes", ("<=", 1.1)))
    # sum over the sharded dim: no forward traffic, one all-reduce of the result to resolve
    with count_collectives() as counter:
        x.sum(0).full_tensor()
    results.append(Result("comm_volume", "sum over sharded dim, resolved", P,
                          _sum_over_ranks(counter.total_received),
                          _sum_over_ranks(2 * (P - 1) * cols * elem // P), "bytes", ("<=", 1.1)))
    return results
