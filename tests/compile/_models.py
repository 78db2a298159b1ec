"""A pre-norm transformer block whose attention is ``F.scaled_dot_product_attention``.

With the token dim sharded, the attention call runs ring attention (queries,
keys and values all sharded), which is eager-only: the block is the test bed
for graph breaks and for the regional-compile pattern.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._cases import DTYPE, TokenMLP


class QKV(nn.Module):
    """LayerNorm and the query/key/value projection, split into heads: (B, N, C) -> 3 x (B, H, N, C/H)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim, dtype=DTYPE)
        self.proj = nn.Linear(dim, 3 * dim, dtype=DTYPE)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.proj(self.norm(x)).chunk(3, dim=-1)
        return tuple(t.reshape(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))


class Out(nn.Module):
    """Heads merged, output projection, residual, then the token-wise MLP."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim, dtype=DTYPE)
        self.mlp = TokenMLP(dim, 2 * dim)

    def forward(self, x, attn):
        b, h, n, d = attn.shape
        return self.mlp(x + self.proj(attn.transpose(1, 2).reshape(b, n, h * d)))


class Block(nn.Module):
    def __init__(self, dim=8, heads=2, causal=True):
        super().__init__()
        self.causal = causal
        self.qkv = QKV(dim, heads)
        self.out = Out(dim)

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(x, F.scaled_dot_product_attention(q, k, v, is_causal=self.causal))


class RegionalBlock(Block):
    """The recommended pattern: compile the token-wise regions, call the attention between them."""

    def __init__(self, backend, dim=8, heads=2, causal=True):
        super().__init__(dim, heads, causal)
        self.qkv = torch.compile(self.qkv, backend=backend, fullgraph=True)
        self.out = torch.compile(self.out, backend=backend, fullgraph=True)
