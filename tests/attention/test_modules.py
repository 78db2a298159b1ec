"""Attention modules unmodified on sequence-sharded inputs: nn.MultiheadAttention, a hand-written block."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import check


def _g(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _on_mesh(mesh, placement):
    """Sequence placement on the last mesh dim, batch over "ddp" on a 2-D mesh."""
    return (placement,) if mesh.ndim == 1 else (Shard(0), placement)


class HandWritten(nn.Module):
    """The usual transformer attention: fused qkv projection, heads, SDPA, output projection."""

    def __init__(self, dim=8, heads=2, kv_heads=1):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, causal=False):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2, dim=-1)
        q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


@distributed(timeout=300)
def test_multihead_attention(ctx):
    mesh = ctx.mesh
    torch.manual_seed(0)
    x_bf, x_sf = _g((2, 7, 8), 1), _g((7, 2, 8), 1)
    memory = _g((2, 5, 8), 2)
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    padding = torch.rand((2, 5), generator=torch.Generator().manual_seed(3)) > 0.7
    for need_weights in (False, True):
        seq = _on_mesh(mesh, Shard(1))
        check(lambda m, x: m(x, x, x, need_weights=need_weights)[0], [(x_bf, seq)], mesh, module=_mha(), label="self")
        check(lambda m, x: m(x, x, x, need_weights=need_weights, attn_mask=causal, is_causal=True)[0],
              [(x_bf, seq)], mesh, module=_mha(), label="causal")  # fmt: skip
        check(lambda m, x, y: m(x, y, y, need_weights=need_weights, key_padding_mask=padding)[0],
              [(x_bf, seq), (memory, _on_mesh(mesh, Replicate()))], mesh, module=_mha(), label="cross")  # fmt: skip
        check(lambda m, x, y: m(x, y, y, need_weights=need_weights)[0],
              [(x_bf, _on_mesh(mesh, Replicate())), (memory, seq)], mesh, module=_mha(), label="cross, memory sharded")  # fmt: skip
        seq = (Shard(0),) if mesh.ndim == 1 else (Shard(1), Shard(0))
        check(lambda m, x: m(x, x, x, need_weights=need_weights)[0], [(x_sf, seq)], mesh, module=_mha(False),
              label="sequence first")  # fmt: skip


def _mha(batch_first=True):
    """A fresh module per check: check() accumulates gradients into the module it is given."""
    return nn.MultiheadAttention(8, 2, batch_first=batch_first).double()


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_multihead_attention_runs_the_ring(ctx):
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = shard_from_global(_g((2, 7, 8), 1), make_spec(ctx.mesh, (Shard(1),), (2, 7, 8)), requires_grad=True)
    with count_collectives() as c:
        y, _ = mha(x, x, x, need_weights=False)
    assert c.calls["send_recv"] == ctx.world_size - 1 and "all_gather" not in c.calls


@distributed(timeout=300)
def test_hand_written_attention_module(ctx):
    mesh = ctx.mesh
    for causal in (False, True):
        for kv_heads in (1, 2):
            module = HandWritten(kv_heads=kv_heads).double()  # fresh: check() accumulates into its gradients
            check(lambda m, x: m(x, causal), [(_g((2, 7, 8), 4), _on_mesh(mesh, Shard(1)))], mesh, module=module,
                  label=f"hand-written causal={causal} kv_heads={kv_heads}")  # fmt: skip


@distributed(world_sizes=(1, 2, 4), timeout=300)
def test_transformer_encoder_layer(ctx):
    mesh = ctx.mesh
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).double()
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    check(lambda m, x: m(x, src_mask=mask, is_causal=True), [(_g((2, 7, 8), 5), _on_mesh(mesh, Shard(1)))], mesh,
          module=layer, label="encoder layer")  # fmt: skip
