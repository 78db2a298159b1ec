"""A Swin-style window-attention block written as timm writes it (window_partition / window_reverse,
relative position bias, shifted windows with torch.roll and the attention mask), for the tests."""

from __future__ import annotations

import torch
from torch import nn


def window_partition(x, ws: int):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows, ws: int, h: int, w: int):
    c = windows.shape[-1]
    x = windows.view(-1, h // ws, w // ws, ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, h, w, c)


def relative_position_index(ws: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = torch.flatten(coords, 1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += ws - 1
    rel[:, :, 1] += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, ws: int, heads: int):
        super().__init__()
        self.ws, self.heads = ws, heads
        self.scale = (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads) * 0.02)
        self.register_buffer("relative_position_index", relative_position_index(ws), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)

    def _bias(self):
        n = self.ws * self.ws
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self._bias()
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(-1, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        attn = self.softmax(attn)
        x = (attn @ v).transpose(1, 2).reshape(b_, n, -1)
        return self.proj(x)


class SwinBlock(nn.Module):
    """timm's SwinTransformerBlock on (B, H, W, C) input (pre-norm, residuals, MLP)."""

    def __init__(self, dim: int, resolution: tuple, heads: int, ws: int, shift: int):
        super().__init__()
        self.resolution, self.ws, self.shift = resolution, ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if shift:
            h, w = resolution
            img_mask = torch.zeros((1, h, w, 1))
            cnt = 0
            for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                    img_mask[:, hs, wsl, :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, ws).view(-1, ws * ws)
            mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            mask = mask.masked_fill(mask != 0, float(-100.0)).masked_fill(mask == 0, float(0.0))
        else:
            mask = None
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x):
        b, h, w, c = x.shape
        shortcut = x
        x = self.norm1(x)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = window_partition(x, self.ws).view(-1, self.ws * self.ws, c)
        windows = self.attn(windows, mask=self.attn_mask)
        windows = windows.view(-1, self.ws, self.ws, c)
        x = window_reverse(windows, self.ws, h, w)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


def swin_pair(dim: int, resolution: tuple, heads: int, ws: int) -> nn.Sequential:
    """A regular and a shifted block, as Swin stacks them (float64)."""
    torch.manual_seed(3)
    return nn.Sequential(
        SwinBlock(dim, resolution, heads, ws, 0), SwinBlock(dim, resolution, heads, ws, ws // 2)
    ).double()
