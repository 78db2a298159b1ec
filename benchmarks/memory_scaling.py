"""Peak activation memory per rank of a conv net and a transformer block, strong and weak scaling.

For every model, one forward + backward step (unit upstream gradient) runs
under :class:`~benchmarks._memory.LiveBytes`, which counts the bytes of every
tensor the step creates — activations saved for backward, temporaries,
received halos and key/value blocks, gradients — and keeps the peak. The
baseline is the same model on plain tensors on one device, measured in the
same process, so the figures are exact byte counts, not timings:

* **strong** (global input fixed): ratio = the largest per-rank peak over
  ``1/P`` of the single-device peak. 1.0 is perfect scaling; target <= 1.2.
  At P = 1 the ratio is ShardTensor's overhead over plain torch.
* **weak** (local input fixed): ratio = the largest per-rank peak over the
  single-device peak on one rank's share (1.0 ideal; halos add a little).

With ``compare_dtensor``: an MLP on even token shards, ShardTensor's per-rank
peak over DTensor's.
"""

from __future__ import annotations

from . import _models
from ._memory import peak_bytes
from ._record import Result, over_ranks

SUITE = "memory_scaling"


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(rows=16, cols=8, width=4, seq=16, dim=16, tokens=8)
    return dict(rows=int(256 * scale), cols=int(256 * scale), width=16, seq=int(1024 * scale), dim=64,
                tokens=int(256 * scale))  # fmt: skip


def run(mesh, rows: int, cols: int, width: int, seq: int, dim: int, tokens: int,
        compare_dtensor: bool = False) -> list[Result]:  # fmt: skip
    P = mesh.size()
    results = []
    for name, net, inputs in _models.scaling_runs(mesh, rows, cols, width, seq, dim):
        for kind, (plain, sharded) in inputs.items():
            single = peak_bytes(lambda: _models.train_step(net, plain))
            per_rank = over_ranks(peak_bytes(lambda: _models.train_step(net, sharded)), "max")
            baseline, target = (single / P, ("<=", 1.2)) if kind == "strong" else (single, None)
            results.append(Result(SUITE, f"{name}, {kind}: per-rank peak / ideal", P, per_rank, baseline, "bytes",
                                  target))  # fmt: skip
    if compare_dtensor:
        peaks = {
            kind: over_ranks(peak_bytes(lambda: _models.train_step(net, x)), "max")
            for kind, (net, x) in _models.mlp_pair(mesh, tokens, dim).items()
        }
        results.append(Result(SUITE, "mlp, even shards: ShardTensor / DTensor", P, peaks["ShardTensor"],
                              peaks["DTensor"], "bytes", ("<=", 1.0)))  # fmt: skip
    return results
