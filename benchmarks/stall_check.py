"""What the stall check costs a redistribution that completes: the ratio to the same call with it off.

Every eager collective is waited for in slices (``PDP_STALL_SECONDS``, see
``physicsnemo_dp/_stall.py``) instead of in one blocking call; nothing else
changes on a collective that completes. The baseline, measured in the same
run, is the same redistribution with ``PDP_STALL_SECONDS=0`` (one plain
``wait``, which is what the backend's blocking call does inside). Small
tensors show the fixed cost per collective, large ones that the data path is
untouched. Wall time and CPU time (this process, all threads) per call,
median of repetitions of interleaved rounds (see ``benchmarks/_timing.py``), all ranks started together: on a shared
machine the CPU ratio is the steadier figure. The fixed cost itself is
timed apart, on one rank where the collective is trivial: CPU time of the
calling thread to post and wait for a 16-float all-reduce, plain ``wait``
against the stall check's ``wait``. ``python -m benchmarks.stall_check`` prints the table
(3 gloo ranks).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import launch, scatter_tensor

from ._timing import fastest_by, repeated

CASES = {  # name -> (global shape, target placements, calls per run)
    "Shard(0)->Replicate, 4 KB": ((32, 32), (Replicate(),), 200),
    "Shard(0)->Shard(1), 4 KB": ((32, 32), (Shard(1),), 200),
    "Shard(0)->Replicate, 12 MB": ((3072, 1024), (Replicate(),), 5),
    "Shard(0)->Shard(1), 12 MB": ((3072, 1024), (Shard(1),), 5),
}


def _with_stall_check(on: bool, fn):
    def run():
        os.environ["PDP_STALL_SECONDS"] = "10" if on else "0"  # read at every collective
        fn()

    return run


def _measure(mesh, rounds: int = 15) -> dict[str, tuple[float, float]]:
    """Per case, (wall, CPU) time with the check divided by time without it."""
    ratios = {}
    for name, (shape, target, calls) in CASES.items():
        x = scatter_tensor(torch.randn(shape), 0, mesh, (Shard(0),))
        move = repeated(lambda x=x, target=target: x.redistribute(placements=target), calls)
        runs = {"off": _with_stall_check(False, move), "on": _with_stall_check(True, move)}
        best = fastest_by(runs, rounds, (time.perf_counter, time.process_time))
        ratios[name] = tuple(float(np.median(on / off)) for on, off in zip(best["on"], best["off"]))  # fmt: skip
    os.environ.pop("PDP_STALL_SECONDS", None)
    return ratios


def _fixed_cost(mesh, calls: int = 3000, rounds: int = 7) -> dict[str, float]:
    """Microseconds of calling-thread CPU per posted all-reduce, waited for plainly or by the stall check."""
    import torch.distributed as dist

    from physicsnemo_dp import _stall

    group, t = dist.group.WORLD, torch.ones(16)
    waits = {
        "plain wait": lambda: dist.all_reduce(t, async_op=True).wait(),
        "stall-check wait": lambda: _stall.wait(dist.all_reduce(t, async_op=True), group, "all_reduce"),
    }
    best = fastest_by({name: repeated(fn, calls) for name, fn in waits.items()}, rounds, (time.thread_time,))
    return {name: float(np.median(b[0])) / calls * 1e6 for name, b in best.items()}


def main() -> None:
    fixed = launch(_fixed_cost, 1, echo=False)
    print("CPU per collective, posted and waited for on one rank: " + ", ".join(f"{k} {v:.1f} us" for k, v in fixed.items()))
    ratios = launch(_measure, 3, echo=False)
    print("redistribution time with the stall check / without it (3 gloo ranks, same run)")
    print(f"  {'':28s} {'wall':>6s} {'CPU':>6s}")
    for name, (wall, cpu) in ratios.items():
        print(f"  {name:28s} {wall:6.3f} {cpu:6.3f}")


if __name__ == "__main__":
    main()
