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

The diffusion case is one step of the EDM Heun sampler with churn
(``physicsnemo_dp.pipelines``) on a conditional conv net: the latents and the
churn noise are drawn sharded (O(local)), the condition is sharded, no grad;
ratio as for strong scaling (target <= 1.2).

With ``compare_dtensor``: an MLP on even token shards, ShardTensor's per-rank
peak over DTensor's.

The FNO (``examples/spectral_models.FNO2d``, the model of
``examples/fno_darcy.py``; issue 16's memory acceptance) runs strong scaling
only, on a square grid sharded along its rows: every spectral layer's
``rfft2`` transposes the rows to frequency columns (an all-to-all), the modes
are mixed there, ``irfft2`` transposes back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import _models
from ._memory import peak_bytes
from ._record import Result, over_ranks

SUITE = "memory_scaling"


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(rows=16, cols=8, width=4, seq=16, dim=16, tokens=8, fno_grid=16, ring_seq=32)
    return dict(rows=int(256 * scale), cols=int(256 * scale), width=16, seq=int(1024 * scale), dim=64,
                tokens=int(256 * scale), fno_grid=int(256 * scale), ring_seq=int(4096 * scale))  # fmt: skip


def _fno(mesh, grid: int, width: int) -> tuple:
    """FNO2d (4 Fourier layers, 12 modes, ``width`` channels) and its ``(1, 1, grid, grid)`` input, plain and sharded.

    The model is user code from ``examples/`` (one copy, shared with the
    example and ``tests/spectral``); its folder goes on ``sys.path`` here.
    """
    folder = str(Path(__file__).resolve().parents[1] / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from spectral_models import FNO2d

    device = _models.mesh_device(mesh)
    torch.manual_seed(0)
    net = FNO2d(width=width, modes=(12, 12), layers=4).to(device)
    x = _models.global_input((1, 1, grid, grid)).to(device)
    return net, x, _models.shard(x, mesh, 2)


def _ring_block(mesh, seq: int, dim: int) -> Result:
    """The transformer block at ``seq`` tokens (4,096 by default), strong scaling: issue 19's memory target."""
    P = mesh.size()
    case = _models.cases(16, 16, dim)["transformer block"]
    net = _models.model(case, mesh)
    plain, sharded = _models.scaling_inputs(case, mesh, seq, seq)["strong"]
    single = peak_bytes(lambda: _models.train_step(net, plain))
    per_rank = over_ranks(peak_bytes(lambda: _models.train_step(net, sharded)), "max")
    return Result(SUITE, f"transformer block, {seq} tokens, strong: per-rank peak / ideal", P, per_rank, single / P,
                  "bytes", ("<=", 1.2))  # fmt: skip


def run(mesh, rows: int, cols: int, width: int, seq: int, dim: int, tokens: int, fno_grid: int,
        compare_dtensor: bool = False, ring_seq: int = 4096) -> list[Result]:  # fmt: skip
    P = mesh.size()
    results = [_ring_block(mesh, ring_seq, dim)]
    for name, net, inputs in _models.scaling_runs(mesh, rows, cols, width, seq, dim):
        for kind, (plain, sharded) in inputs.items():
            single = peak_bytes(lambda: _models.train_step(net, plain))
            per_rank = over_ranks(peak_bytes(lambda: _models.train_step(net, sharded)), "max")
            baseline, target = (single / P, ("<=", 1.2)) if kind == "strong" else (single, None)
            results.append(Result(SUITE, f"{name}, {kind}: per-rank peak / ideal", P, per_rank, baseline, "bytes",
                                  target))  # fmt: skip
    denoiser, plain, sharded = _models.sampler_pair(mesh, rows, cols, width)
    single = peak_bytes(lambda: _models.sampler_step(denoiser, plain))
    per_rank = over_ranks(peak_bytes(lambda: _models.sampler_step(denoiser, sharded)), "max")
    results.append(Result(SUITE, "diffusion sampler step, strong: per-rank peak / ideal", P, per_rank, single / P,
                          "bytes", ("<=", 1.2)))  # fmt: skip
    net, plain, sharded = _fno(mesh, fno_grid, width)
    single = peak_bytes(lambda: _models.train_step(net, plain))
    per_rank = over_ranks(peak_bytes(lambda: _models.train_step(net, sharded)), "max")
    results.append(Result(SUITE, "fno, strong: per-rank peak / ideal", P, per_rank, single / P, "bytes",
                          ("<=", 1.2)))  # fmt: skip
    if compare_dtensor:
        peaks = {
            kind: over_ranks(peak_bytes(lambda: _models.train_step(net, x)), "max")
            for kind, (net, x) in _models.mlp_pair(mesh, tokens, dim).items()
        }
        results.append(Result(SUITE, "mlp, even shards: ShardTensor / DTensor", P, peaks["ShardTensor"],
                              peaks["DTensor"], "bytes", ("<=", 1.0)))  # fmt: skip
    return results
