"""Time per op on a small tensor: plain torch, DTensor, ShardTensor (even, then uneven shards).

The ratio reported is ShardTensor / DTensor on the same even shards (target
<= 1.0); the uneven case is reported against DTensor's even time too, since
DTensor cannot hold it. No op here communicates, so each figure is the *CPU
time of the calling thread* (one intra-op thread per rank): unlike wall time
it does not count the time a process waits for a core, which on a shared
machine is most of it. Each figure is the fastest of ``repeats`` interleaved
batches of ``calls`` calls, averaged over ranks.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.collectives import mesh_device

from ._models import uneven_sizes
from ._record import Result, over_ranks
from ._timing import fastest, repeated

SUITE = "dispatch_overhead"

OPS = {
    "add": lambda x: x + x,
    "mul_scalar": lambda x: x * 2.0,
    "tanh": torch.tanh,
    "chain(3 ops)": lambda x: torch.relu(x * 0.5 + 1.0),
}


def sizes(tiny: bool, scale: float) -> dict:
    return dict(rows=64, cols=32, calls=20, repeats=3) if tiny else dict(rows=64, cols=32, calls=200, repeats=15)


def _operands(mesh, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """The same global ``(rows * P, cols)`` tensor as plain local piece, DTensor and ShardTensors."""
    P, me = mesh.size(), mesh.get_local_rank()
    g = torch.randn(rows * P, cols, generator=torch.Generator().manual_seed(0)).to(mesh_device(mesh))
    local = g[me * rows : (me + 1) * rows].clone()
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], shape=tuple(g.shape), stride=tuple(g.stride()))
    uneven = uneven_sizes(rows * P, P)
    start = sum(uneven[:me])
    return {
        "plain": local,
        "DTensor": dtensor,
        "ShardTensor even": ShardTensor.from_dtensor(dtensor),
        "ShardTensor uneven": ShardTensor.from_local(
            g[start : start + uneven[me]].clone(), mesh, [Shard(0)], sharding_shapes={0: [(s, cols) for s in uneven]}
        ),
    }


def run(mesh, rows: int, cols: int, calls: int, repeats: int, compare_dtensor: bool = False) -> list[Result]:
    P = mesh.size()
    operands = _operands(mesh, rows, cols)
    results = []
    for name, fn in OPS.items():
        runs = {kind: repeated(lambda x=x: fn(x), calls) for kind, x in operands.items()}
        best = fastest(runs, repeats, barrier=False, clock=time.thread_time)
        t = {kind: over_ranks(seconds / calls) / P for kind, seconds in best.items()}
        results += [
            Result(SUITE, f"{name}: ShardTensor even / DTensor", P, t["ShardTensor even"], t["DTensor"], "s",
                   ("<=", 1.0)),
            Result(SUITE, f"{name}: ShardTensor uneven / DTensor even", P, t["ShardTensor uneven"], t["DTensor"], "s",
                   ("<=", 1.0)),
            Result(SUITE, f"{name}: DTensor / plain torch", P, t["DTensor"], t["plain"], "s"),
            Result(SUITE, f"{name}: ShardTensor even / plain torch", P, t["ShardTensor even"], t["plain"], "s"),
        ]  # fmt: skip
    return results
