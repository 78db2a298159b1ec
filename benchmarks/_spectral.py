"""A small FNO block (Li et al. 2021, ``fourier_2d.py``) for the spectral benchmarks.

``SpectralConv2d`` is the public FNO spectral convolution: ``rfft2``, the
lowest ``modes`` rows from both ends and the lowest ``modes`` columns
multiplied by complex weights, assembled into a zero spectrum, ``irfft2``.
The zero spectrum is ``x_ft.new_zeros(...)``, which on a ShardTensor is
sharded like ``x_ft`` (the public code's plain ``torch.zeros`` would be a
replicated global buffer). The same module runs on plain and sharded inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SpectralConv2d(nn.Module):
    def __init__(self, width: int, modes1: int, modes2: int, dtype=torch.cfloat):
        super().__init__()
        self.modes1, self.modes2 = modes1, modes2
        scale = 1 / (width * width)
        self.w1 = nn.Parameter(scale * torch.rand(width, width, modes1, modes2, dtype=dtype))
        self.w2 = nn.Parameter(scale * torch.rand(width, width, modes1, modes2, dtype=dtype))

    def forward(self, x):
        b, _, h, w = x.shape
        m1, m2 = self.modes1, self.modes2
        x_ft = torch.fft.rfft2(x)
        out_ft = x_ft.new_zeros(b, self.w1.shape[1], h, w // 2 + 1)
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self.w1)
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self.w2)
        return torch.fft.irfft2(out_ft, s=(h, w))


class FNOBlock(nn.Module):
    """``gelu(spectral(x) + W x)``: one Fourier layer of the FNO."""

    def __init__(self, width: int, modes: int):
        super().__init__()
        self.spectral = SpectralConv2d(width, modes, modes)
        self.skip = nn.Conv2d(width, width, 1)

    def forward(self, x):
        return F.gelu(self.spectral(x) + self.skip(x))


def fno_strong_scaling(mesh, grid: int, width: int, modes: int, rounds: int) -> list:
    """Forward + backward of :class:`FNOBlock` on a ``grid`` x ``grid`` field, sharded along H vs one device.

    Strong scaling, the work of all ranks over the single device's
    (``P * t(P) / t(1)`` by the CPU clock, summed over ranks; 1.0 = no
    overhead), and the same by the wall clock of the slowest rank.
    """
    import time

    from . import _models
    from ._record import Result, over_ranks
    from ._timing import fastest_by

    P = mesh.size()
    torch.manual_seed(0)
    device = _models.mesh_device(mesh)
    block = FNOBlock(width, modes).to(device)
    plain = _models.global_input((1, width, grid, grid), seed=1).to(device)
    sharded = _models.shard(plain, mesh, 2)
    runs = {"plain": lambda: _models.train_step(block, plain), "sharded": lambda: _models.train_step(block, sharded)}
    best = fastest_by(runs, rounds, [time.perf_counter, time.process_time])
    wall = {k: over_ranks(v[0], "max") for k, v in best.items()}
    cpu = {k: over_ranks(v[1]) for k, v in best.items()}
    case = f"FNO block {grid}x{grid}, strong"
    return [
        Result("throughput_scaling", f"{case}, CPU: work of all ranks / single device", P,
               cpu["sharded"], cpu["plain"] / P, "s"),
        Result("throughput_scaling", f"{case}, wall: P x step time / single device", P,
               P * wall["sharded"], wall["plain"], "s"),
    ]  # fmt: skip
