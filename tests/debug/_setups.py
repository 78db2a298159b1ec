"""Model steps that run the same way for real (harness ranks) and simulated (``debug.simulate``).

Uneven on purpose: 22 rows or tokens split over 3 ranks are 8, 7, 7; the U-Net
pools them to 4, 4, 3 and 2, 2, 1.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp.debug import sharded_input


def unet(mesh):
    from unet_darcy import UNet

    torch.manual_seed(0)
    model = UNet(width=8, depth=2)
    if mesh.ndim == 2:  # ("ddp", "domain"): samples over ddp, rows over domain
        x = sharded_input(mesh, (2, 1, 22, 12), [Shard(0), Shard(2)])
    else:
        x = sharded_input(mesh, (1, 1, 22, 12), [Shard(2)])
    return lambda: model(x).pow(2).mean().backward()


def transformer(mesh):
    from torch import nn

    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    x = sharded_input(mesh, (1, 22, 32), [Shard(1)])

    def step():
        y = model(x)
        y.backward(torch.ones_like(y))

    return step


def fno(mesh):
    from spectral_models import FNO2d

    torch.manual_seed(0)
    model = FNO2d(width=8, modes=(4, 4), layers=2)
    x = sharded_input(mesh, (1, 1, 22, 16), [Shard(2)])
    return lambda: model(x).pow(2).mean().backward()


def weak_unet(mesh):
    """The U-Net with 8 rows per rank (weak scaling), for simulations at thousands of ranks."""
    from unet_darcy import UNet

    model = UNet(width=8, depth=2)
    x = sharded_input(mesh, (1, 1, 8 * mesh.size(), 12), [Shard(2)])
    return lambda: model(x).pow(2).mean().backward()


SETUPS = {"unet": unet, "transformer": transformer, "fno": fno}
