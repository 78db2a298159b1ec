"""Unmodified networks on domain-sharded inputs: a 2-D U-Net and a 3-D conv stack."""

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensorSpec, count_collectives
from tests._harness import distributed

from ..ops._diff import OP_WORLD_SIZES

from ..core._util import shard_from_global
from ._cases import check_module, grid, spatial_layouts


def _block(c_in, c_out):
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(2, c_out), nn.ReLU(),
    )  # fmt: skip


class UNet(nn.Module):
    """Two levels: max-pool down; transposed-conv and bilinear upsampling up; skips joined with ``torch.cat``."""

    def __init__(self, c_in=3, c_out=2, width=4):
        super().__init__()
        self.enc1, self.enc2, self.mid = _block(c_in, width), _block(width, 2 * width), _block(2 * width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(2 * width, 2 * width, 2, stride=2)
        self.dec2 = _block(4 * width, width)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec1 = _block(2 * width, width)
        self.head = nn.Conv2d(width, c_out, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        m = self.mid(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


def _conv3d_stack():
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
        nn.Conv3d(4, 4, 3, stride=2, padding=1), nn.InstanceNorm3d(4, affine=True), nn.GELU(),
        nn.ConvTranspose3d(4, 4, 2, stride=2), nn.AvgPool3d(3, stride=1, padding=1),
        nn.Conv3d(4, 2, 3, padding=1, padding_mode="circular"),
    )  # fmt: skip


@distributed(world_sizes=OP_WORLD_SIZES, timeout=300)
def test_unet_2d(ctx):
    torch.manual_seed(0)
    model = UNet().double()
    x = grid((2, 3, 16, 12))
    for placements in spatial_layouts(ctx.mesh, 4, 2, batch=True):
        check_module(model, x, placements, ctx.mesh, label=f"unet {placements}")


@distributed(world_sizes=OP_WORLD_SIZES, timeout=300)
def test_conv3d_stack(ctx):
    torch.manual_seed(0)
    model = _conv3d_stack().double()
    x = grid((2, 2, 8, 6, 6))
    for placements in spatial_layouts(ctx.mesh, 5, 3, batch=True):
        check_module(model, x, placements, ctx.mesh, label=f"3d stack {placements}")


def unet_traffic(mesh, shape=(2, 3, 64, 64), placements=None):
    """Halo bytes vs interior bytes of one U-Net forward + backward (per rank, summed over ranks by the caller).

    Interior bytes: the local inputs the window ops read (what a rank holds
    anyway); halo bytes: what the halo exchanges send.
    """
    torch.manual_seed(0)
    model = UNet().double()
    placements = placements or ((Shard(2),) if mesh.ndim == 1 else (Shard(2), Shard(3)))
    spec = ShardTensorSpec.chunked(mesh, placements, shape, torch.float64)
    x = shard_from_global(grid(shape), spec, requires_grad=True)
    interior = []
    window_ops = (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.Upsample)
    hooks = [m.register_forward_pre_hook(lambda m, a: interior.append(a[0]._local_tensor.nbytes)) for m in model.modules() if isinstance(m, window_ops)]
    with count_collectives() as fwd:
        y = model(x)
    with count_collectives() as bwd:
        y.backward(torch.ones_like(y))
    for h in hooks:
        h.remove()
    return dict(interior=sum(interior), halo_fwd=fwd.bytes_sent["halo"], halo_bwd=bwd.bytes_sent["halo"],
                halo_calls=fwd.calls["halo"] + bwd.calls["halo"], fwd=fwd.summary(), bwd=bwd.summary())  # fmt: skip


@distributed(world_sizes=(4,), timeout=300)
def test_unet_halo_traffic_is_a_small_fraction_of_the_interior(ctx):
    t = unet_traffic(ctx.mesh)
    # 16 of 64 rows per rank at the top level: each 3x3 conv moves one row per neighbour and direction
    assert t["halo_fwd"] == t["halo_bwd"]
    assert t["halo_fwd"] < 0.2 * t["interior"], t
    return t
