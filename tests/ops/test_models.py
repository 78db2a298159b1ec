"""Unmodified nn.Modules on sharded inputs: a small MLP and a pre-norm transformer block.

Outputs, input gradients and every parameter gradient must equal the
single-process run (``check(..., module=model)``), on uneven and empty shards.
"""

import torch
from torch import nn

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

B, N, C = 3, 7, 8


def _g(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C)).double()


class Block(nn.Module):
    """Pre-norm transformer block; attention written with matmul and softmax."""

    def __init__(self, dim=C, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def _block():
    torch.manual_seed(1)
    return Block().double()


@distributed(world_sizes=OP_WORLD_SIZES)
def test_mlp_any_dim_sharded(ctx):
    for placements in layouts(ctx.mesh, 3):
        check(lambda m, x: m(x), [(_g((B, N, C)), placements)], ctx.mesh, module=_mlp(), label="mlp")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_transformer_block_batch_sharded(ctx):
    """Attention mixes tokens, so the batch dim carries the sharding (attention on unsharded dims)."""
    for placements in layouts(ctx.mesh, 3, dims=(0,)):
        check(lambda m, x: m(x), [(_g((B, N, C), 2), placements)], ctx.mesh, module=_block(), label="block")


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_transformer_block_token_sharded(ctx):
    """Sharding the token dim is also exact: the attention products gather keys and values."""
    for placements in layouts(ctx.mesh, 3, dims=(1,)):
        check(lambda m, x: m(x), [(_g((B, N, C), 3), placements)], ctx.mesh, module=_block(), label="block tokens")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_mlp_forward_is_communication_free(ctx):
    """Linear layers on unsharded features: no forward collective; backward only reduces parameter gradients."""
    mesh = ctx.mesh
    for placements in layouts(mesh, 3, dims=(0, 1)):
        model = _mlp()
        x = shard_from_global(_g((B, N, C)), make_spec(mesh, placements, (B, N, C)), requires_grad=True)
        with count_collectives() as fwd:
            y = model(x)
        assert fwd.total_calls == 0, (placements, fwd.summary())
        with count_collectives() as bwd:
            y.backward(torch.ones_like(y))
        assert set(bwd.calls) <= {"all_reduce"}, (placements, bwd.summary())
        # One reduction per layer and sharded mesh dim: a layer's weight and bias are promoted together
        # (on one rank, where nothing is summed, one no-op call per parameter).
        layers = sum(1 for m in model.modules() if next(m.parameters(recurse=False), None) is not None)
        per_dim = layers if mesh.size() > 1 else len(list(model.parameters()))
        assert bwd.calls.get("all_reduce", 0) == per_dim * sum(p.is_shard() for p in placements), bwd.summary()
