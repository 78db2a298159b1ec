"""The models and inputs the scaling benchmarks run: a conv net, a transformer block, an MLP.

Every rank builds the same seeded global input and model; a sharded input is
this rank's box of that tensor wrapped without communication, so the plain
single-device run in the same process is the exact baseline.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor, ShardTensorSpec
from physicsnemo_dp.collectives import mesh_device


def conv_net(channels: int = 4, width: int = 16) -> nn.Module:
    """Three 3x3 convolutions with GELUs: halo exchanges on every layer, nothing else distributed."""
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.GELU(),
        nn.Conv2d(width, width, 3, padding=1), nn.GELU(),
        nn.Conv2d(width, channels, 3, padding=1),
    )  # fmt: skip


class UNet(nn.Module):
    """The U-Net of ``examples/unet_darcy.py``: conv blocks with GroupNorm, max-pool down, bilinear up, skips."""

    def __init__(self, c_in: int = 1, c_out: int = 1, width: int = 16, depth: int = 2):
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]

        def block(a: int, b: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(4, b), nn.GELU(),
                                 nn.Conv2d(b, b, 3, padding=1), nn.GroupNorm(4, b), nn.GELU())  # fmt: skip

        self.down = nn.ModuleList([block(c_in, widths[0])] + [block(widths[i], widths[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList(block(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, c_out, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for block in self.up:
            skip = skips.pop()
            x = nn.functional.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


def transformer_block(dim: int = 64, heads: int = 4) -> nn.Module:
    """``nn.TransformerEncoderLayer`` (no dropout): on a sequence-sharded input its SDPA is ring attention."""
    return nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)


def mlp(dim: int = 64) -> nn.Module:
    """Token-wise MLP: the model DTensor also runs on sharded tokens (for ``--compare-dtensor``)."""
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


@dataclass(frozen=True)
class Case:
    """A model, its global input shape for a local extent ``n`` along the sharded dim, and that dim."""

    name: str
    build: Callable[[], nn.Module]
    shape: Callable[[int], tuple[int, ...]]
    dim: int


def cases(conv_width: int, conv_cols: int, dim: int) -> dict[str, Case]:
    return {
        "conv net": Case("conv net", lambda: conv_net(4, conv_width), lambda n: (1, 4, n, conv_cols), 2),
        "transformer block": Case("transformer block", lambda: transformer_block(dim), lambda n: (1, n, dim), 1),
    }


def global_input(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def model(case: Case, mesh, seed: int = 0) -> nn.Module:
    """The case's model, with the same weights on every rank, on the mesh's device."""
    torch.manual_seed(seed)
    return case.build().to(mesh_device(mesh))


def shard(global_tensor: torch.Tensor, mesh, dim: int, sizes: tuple[int, ...] | None = None) -> ShardTensor:
    """This rank's box of ``global_tensor`` as a ShardTensor sharded along ``dim`` (chunk sizes by default)."""
    shape = tuple(global_tensor.shape)
    placements = [Shard(dim)]
    if sizes is None:
        spec = ShardTensorSpec.chunked(mesh, placements, shape, global_tensor.dtype)
    else:
        tables = tuple(tuple(sizes) if d == dim else None for d in range(len(shape)))
        spec = ShardTensorSpec.from_sizes(mesh, placements, shape, global_tensor.dtype, tables)
    box = tuple(slice(o, o + n) for o, n in zip(spec.local_offsets(), spec.local_shape))
    return ShardTensor.from_spec(global_tensor[box].clone(), spec)


def uneven_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Strongly uneven shard sizes adding up to ``total``, with an empty shard when ``parts > 2``."""
    weights = [3, 0, 1, 5, 2, 7, 4, 6][:parts] if parts > 2 else [3, 1][:parts]
    weights += [1] * (parts - len(weights))
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return tuple(sizes)


def scaling_inputs(case: Case, mesh, strong: int, weak: int) -> dict[str, tuple[torch.Tensor, ShardTensor]]:
    """``{"strong": (plain, sharded), "weak": (plain, sharded)}``: the single-device baseline input and the sharded one.

    Strong scaling keeps the global extent ``strong`` (the baseline holds all
    of it); weak scaling gives every rank ``weak`` (the baseline holds one
    rank's worth).
    """
    device, P = mesh_device(mesh), mesh.size()
    pairs = {}
    for kind, plain_extent, global_extent in (("strong", strong, strong), ("weak", weak, weak * P)):
        g = global_input(case.shape(global_extent)).to(device)
        pairs[kind] = (global_input(case.shape(plain_extent)).to(device), shard(g, mesh, case.dim))
    return pairs


def scaling_runs(mesh, rows: int, cols: int, width: int, seq: int, dim: int) -> Iterator[tuple[str, nn.Module, dict]]:
    """``(name, model, scaling_inputs(...))`` for every case, built one case at a time.

    The memory and the throughput suites measure these same runs, so that their
    byte and time ratios describe the same models on the same inputs. The conv
    net is sharded along its ``rows``, the transformer block along its ``seq``
    tokens; in weak scaling every rank holds a quarter of that extent (at least
    one), so at 4 ranks the weak run's global input is as large as the strong one's.
    """
    extents = {"conv net": rows, "transformer block": seq}
    for name, case in cases(width, cols, dim).items():
        n = extents[name]
        yield name, model(case, mesh), scaling_inputs(case, mesh, n, max(n // 4, 1))


def mlp_pair(mesh, tokens: int, dim: int) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """The MLP on the same even token shards as ShardTensor and as DTensor: ``{kind: (model, input)}``.

    DTensor gets its parameters replicated (``distribute_module``), ShardTensor
    plain parameters (promoted on use); after :func:`train_step` both hold
    weight gradients summed over the mesh.
    """
    from torch.distributed.tensor import DTensor, distribute_module

    device = mesh_device(mesh)
    torch.manual_seed(0)
    net = mlp(dim).to(device)
    x = shard(global_input((tokens * mesh.size(), dim)).to(device), mesh, 0)
    dx = DTensor.from_local(x.to_local(), mesh, [Shard(0)], shape=tuple(x.shape), stride=(dim, 1))
    return {"ShardTensor": (net, x), "DTensor": (distribute_module(copy.deepcopy(net), mesh), dx)}


class _ConditionalConvNet(nn.Module):
    """F(x_in, c_noise, condition) of the sampler case: the conv net on [x_in, condition, c_noise] channels."""

    def __init__(self, width: int):
        super().__init__()
        self.body = conv_net(3, width)

    def forward(self, x, c_noise, condition):
        return self.body(torch.cat([x, condition, torch.ones_like(x) * c_noise], dim=1))[:, :1]


def sampler_pair(mesh, rows: int, cols: int, width: int) -> tuple[nn.Module, torch.Tensor, ShardTensor]:
    """``(denoiser, plain condition, sharded condition)`` for one EDM sampler step on a ``(1, 1, rows, cols)`` field.

    The denoiser is an EDM-preconditioned conditional conv net, the same on
    every rank; the condition is sharded along its rows (chunk sizes).
    """
    from physicsnemo_dp.pipelines import EDMPrecond

    torch.manual_seed(0)
    denoiser = EDMPrecond(_ConditionalConvNet(width)).to(mesh_device(mesh))
    plain = global_input((1, 1, rows, cols), seed=1).to(mesh_device(mesh))
    return denoiser, plain, shard(plain, mesh, 2)


def sampler_step(denoiser: nn.Module, condition: torch.Tensor) -> None:
    """Latents drawn where they live, then one churned Heun step (two denoiser evaluations), no grad.

    A 2-level schedule: its first step draws churn noise and evaluates the
    denoiser twice (Euler + Heun correction), its last step once; sampling
    keeps no activations between steps, so the peak is one step's.
    """
    from physicsnemo_dp.pipelines import HeunSampler
    from physicsnemo_dp.random import randn_like

    generator = torch.Generator(condition.device).manual_seed(0)
    latents = randn_like(condition, generator=generator)
    HeunSampler(num_steps=2, S_churn=1.0).sample(denoiser, latents, condition, generator=generator)


def train_step(net: nn.Module, x: torch.Tensor) -> None:
    """Forward and backward with a unit upstream gradient (no loss reduction, so no extra collective).

    The step ends with gradients an optimizer can use: DTensor leaves a
    replicated parameter's gradient as a pending sum (``Partial``), so it is
    reduced here, as ShardTensor's promotion does during the backward.
    """
    from torch.distributed.tensor import DTensor

    net.zero_grad(set_to_none=True)
    y = net(x)
    y.backward(torch.ones_like(y))
    for p in net.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)
