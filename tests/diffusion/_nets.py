"""What the diffusion tests share: a small conditional denoiser, global data, and cutting it into shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.distributed import AXES, MeshContext
from physicsnemo_dp.pipelines import EDMPrecond, EDMSchedule

from ..core._util import make_spec, shard_from_global
from ..distributed._models import device_mesh

#: (batch, channels, H, W): 13 x 11 splits unevenly over every mesh, with empty shards on 4 ranks.
SHAPE = (2, 1, 13, 11)


class CondNet(nn.Module):
    """F(x_in, c_noise, condition): two 3x3 convs over [x, condition, c_noise as a constant channel]."""

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/diffusion/test_sampler.py and test_pipeline.py
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, width: int = 6):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.GELU(), nn.Conv2d(width, 1, 3, padding=1))

    def forward(self, x, c_noise, condition):
        return self.body(torch.cat([x, condition, torch.ones_like(x) * c_noise], dim=1))


def denoiser(dtype=torch.float64, seed: int = 0, schedule: EDMSchedule | None = None) -> EDMPrecond:
    """The same seeded weights in every process."""
    torch.manual_seed(seed)
    return EDMPrecond(CondNet(), schedule).to(dtype)


def global_tensor(seed: int, dtype=torch.float64, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def placements(mesh):
    """Rows over a 1-D mesh; rows and columns over a 2-D one (a 2-D decomposition)."""
    return [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]


def shard(tensor: torch.Tensor, mesh, salt: int = 0) -> ShardTensor:
    """``tensor`` cut into deliberately uneven shards (empty ones where the mesh allows)."""
    return shard_from_global(tensor, make_spec(mesh, placements(mesh), tuple(tensor.shape), dtype=tensor.dtype,
                                               salt=salt))  # fmt: skip


def context(ctx, **policies) -> MeshContext:
    """A (2, 2) MeshContext on the 2x2 layout, else (1, world size): every rank splits one sample."""
    if ctx.mesh.ndim == 2 and tuple(ctx.mesh.mesh_dim_names) == AXES:
        return MeshContext.from_mesh(ctx.mesh, **policies)
    return MeshContext.from_mesh(device_mesh(ctx.device.type, 1, ctx.world_size), **policies)
