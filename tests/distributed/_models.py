"""Small models and helpers shared by the parallelization tests.

``TokenNet`` maps ``(batch, tokens, features)`` to ``(batch, tokens, 2)``
with ``nn.Linear`` layers and pointwise activations, so every op is
token-wise: splitting the token dim over ``"domain"`` must give exactly the
single-process result. Its blocks live in an ``nn.ModuleList`` (the default
FSDP-unit and checkpointing granularity).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.distributed import AXES

from ..core._util import make_spec, shard_from_global

FEATURES, HIDDEN, TOKENS, BATCH = 3, 5, 7, 4


class Block(nn.Module):
    """Residual ``x + gelu(linear(x))``; counts forward calls (2 per step when checkpointed)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + nn.functional.gelu(self.lin(x))


class TokenNet(nn.Module):
    @dataclass(frozen=True)
    class ModelCapabilities:
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(depth))
        self.out = nn.Linear(HIDDEN, 2)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Gate(nn.Module):
    """A per-feature ``exp(log_scale)`` gain: the kind of parameter bf16 rounding hurts."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.linspace(-0.3, 0.3, width))

    def forward(self, x):
        return x * torch.exp(self.log_scale)


class PinnedNet(TokenNet):
    """TokenNet with a gate whose parameter is pinned to fp32."""

    _keep_in_fp32_modules_strict = ["gate.log_scale"]

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate(HIDDEN)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(self.gate(x))


def sample_batch(seed: int = 1, batch: int = BATCH, dtype=torch.float32) -> torch.Tensor:
    """The global batch, identical on every rank."""
    return torch.randn(batch, TOKENS, FEATURES, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def local_input(batch: torch.Tensor, mesh_context, salt: int = 1) -> ShardTensor:
    """This rank's input: its ``"ddp"`` share of the samples, tokens split unevenly over ``"domain"``.

    ``salt`` varies the shard sizes; on two domain ranks ``salt=0`` leaves rank 0 empty.
    """
    mine = batch.tensor_split(mesh_context.ddp_size)[mesh_context.ddp_rank]
    spec = make_spec(mesh_context.domain_mesh, [Shard(1)], tuple(mine.shape), "uneven", dtype=mine.dtype, salt=salt)
    return shard_from_global(mine, spec)


def loss_of(out) -> torch.Tensor:
    """Mean of squares, in fp32 whatever the compute dtype."""
    return out.float().pow(2).mean()


def train(model, batches, lr: float = 0.1):
    """A few SGD steps; returns the loss values (as Python floats)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for x in batches:
        loss = loss_of(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        losses.append(float(value))
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Parameters by name as plain full tensors (FSDP2 shards gathered), without wrapper prefixes."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = t.detach().float().clone()
    return out


def assert_same_on_all_ranks(tensors: dict[str, torch.Tensor]) -> None:
    """Every rank of the world holds bitwise the same values."""
    flat = torch.cat([t.reshape(-1) for _, t in sorted(tensors.items())])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for r, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"rank {r} differs from rank 0 by {(other - gathered[0]).abs().max():.3e}"


def assert_close_states(actual: dict, expected: dict, atol: float, rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        diff = (actual[name] - expected[name]).abs().max().item()
        assert torch.allclose(actual[name], expected[name], atol=atol, rtol=rtol), f"{name}: max abs diff {diff:.3e}"


@functools.cache
def device_mesh(device_type: str, ddp_size: int, domain_size: int):
    """A cached ``("ddp", "domain")`` mesh over the whole world (building one creates process groups)."""
    return init_device_mesh(device_type, (ddp_size, domain_size), mesh_dim_names=AXES)
