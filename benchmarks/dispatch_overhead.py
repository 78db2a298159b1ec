"""Time per op on a small tensor: plain torch, DTensor, ShardTensor (even, then uneven).

The ratio reported is ShardTensor / DTensor on the same even shards (target
<= 1.0); the uneven case is reported against DTensor's even time too, since
DTensor cannot hold it. Each time is the median of several repeats.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensor

from ._record import Result

OPS = {
    "add": lambda x: x + x,
    "mul_scalar": lambda x: x * 2.0,
    "tanh": torch.tanh,
    "chain(3 ops)": lambda x: torch.relu(x * 0.5 + 1.0),
}


def _time_per_call(fn, x, calls: int, repeats: int) -> float:
    for _ in range(10):
        fn(x)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def run(mesh, rows: int = 64, cols: int = 32, calls: int = 200, repeats: int = 5) -> list[Result]:
    P = mesh.size()
    g = torch.randn(rows * P, cols)
    d = distribute_tensor(g, mesh, [Shard(0)])
    even = ShardTensor.from_dtensor(d)
    sizes = [rows * P - (P - 1) * (rows // 2)] + [rows // 2] * (P - 1)
    start = sum(sizes[: mesh.get_local_rank()])
    uneven = ShardTensor.from_local(
        g[start : start + sizes[mesh.get_local_rank()]].clone(), mesh, [Shard(0)],
        sharding_shapes={0: [(s, cols) for s in sizes]},
    )
    local = d.to_local()
    results = []
    for name, fn in OPS.items():
        t_plain = _time_per_call(fn, local, calls, repeats)
        t_dtensor = _time_per_call(fn, d, calls, repeats)
        t_even = _time_per_call(fn, even, calls, repeats)
        t_uneven = _time_per_call(fn, uneven, calls, repeats)
        results += [
            Result("dispatch_overhead", f"{name}: ShardTensor even / DTensor", P, t_even, t_dtensor, "s", ("<=", 1.0)),
            Result("dispatch_overhead", f"{name}: ShardTensor uneven / DTensor even", P, t_uneven, t_dtensor, "s", ("<=", 1.0)),
            Result("dispatch_overhead", f"{name}: DTensor / plain torch", P, t_dtensor, t_plain, "s"),
        ]
    return results
