"""PhysicsNeMo's spectral layers, copied: the forward code of ``SpectralConv1d/2d/3d`` and ``DPOT2DLayer``.

Source: nvidia-physicsnemo 2.2.2 (PyPI wheel), ``physicsnemo/nn/module/spectral_layers.py``,
Copyright (c) 2023 - 2026 NVIDIA CORPORATION & AFFILIATES, Apache License 2.0. PhysicsNeMo
itself needs ``warp`` and ``jaxtyping`` at import, which this environment does not have, so the
adapter tests run this copy. Kept line for line where it matters to the adapter: the plain
``torch.zeros(..., dtype=torch.cfloat)`` spectrum of the global shape, filled by slice assignment
(1-D) or by ``out_ft + F.pad(...)`` (2-D, 3-D), ``torch.view_as_complex`` weights of shape
``(in, out, *modes, 2)`` and ``torch.einsum``. Dropped: the jaxtyping annotations and the
docstrings. The classes are registered with the adapter by object (``allocate_like_input``), the
way ``integrations.physicsnemo()`` registers PhysicsNeMo's own by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SpectralConv1d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, modes1: int):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes1 = modes1
        self.scale = 1 / (in_channels * out_channels)
        self.weights1 = nn.Parameter(torch.empty(in_channels, out_channels, self.modes1, 2))
        self.reset_parameters()

    def compl_mul1d(self, input, weights):
        cweights = torch.view_as_complex(weights)
        return torch.einsum("bix,iox->box", input, cweights)

    def forward(self, x):
        bsize = x.shape[0]
        x_ft = torch.fft.rfft(x)
        out_ft = torch.zeros(
            bsize,
            self.out_channels,
            x.size(-1) // 2 + 1,
            device=x.device,
            dtype=torch.cfloat,
        )
        out_ft[:, :, : self.modes1] = self.compl_mul1d(
            x_ft[:, :, : self.modes1],
            self.weights1,
        )
        x = torch.fft.irfft(out_ft, n=x.size(-1))
        return x

    def reset_parameters(self):
        self.weights1.data = self.scale * torch.rand(self.weights1.data.shape)


class SpectralConv2d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, modes1: int, modes2: int):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes1 = modes1
        self.modes2 = modes2
        self.scale = 1 / (in_channels * out_channels)
        self.weights1 = nn.Parameter(torch.empty(in_channels, out_channels, self.modes1, self.modes2, 2))
        self.weights2 = nn.Parameter(torch.empty(in_channels, out_channels, self.modes1, self.modes2, 2))
        self.reset_parameters()

    def compl_mul2d(self, input, weights):
        cweights = torch.view_as_complex(weights)
        return torch.einsum("bixy,ioxy->boxy", input, cweights)

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        h, w = x_ft.size(-2), x_ft.size(-1)
        out_ft = torch.zeros(x.size(0), self.out_channels, h, w, dtype=torch.cfloat, device=x.device)
        out_ft = out_ft + F.pad(
            self.compl_mul2d(x_ft[:, :, : self.modes1, : self.modes2].contiguous(), self.weights1),
            (0, w - self.modes2, 0, h - self.modes1),
        )
        out_ft = out_ft + F.pad(
            self.compl_mul2d(x_ft[:, :, -self.modes1 :, : self.modes2].contiguous(), self.weights2),
            (0, w - self.modes2, h - self.modes1, 0),
        )
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))

    def reset_parameters(self):
        self.weights1.data = self.scale * torch.rand(self.weights1.data.shape)
        self.weights2.data = self.scale * torch.rand(self.weights2.data.shape)


class SpectralConv3d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, modes1: int, modes2: int, modes3: int):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes1 = modes1
        self.modes2 = modes2
        self.modes3 = modes3
        self.scale = 1 / (in_channels * out_channels)
        shape = (in_channels, out_channels, self.modes1, self.modes2, self.modes3, 2)
        self.weights1 = nn.Parameter(torch.empty(shape))
        self.weights2 = nn.Parameter(torch.empty(shape))
        self.weights3 = nn.Parameter(torch.empty(shape))
        self.weights4 = nn.Parameter(torch.empty(shape))
        self.reset_parameters()

    def compl_mul3d(self, input, weights):
        cweights = torch.view_as_complex(weights)
        return torch.einsum("bixyz,ioxyz->boxyz", input, cweights)

    def forward(self, x):
        x_ft = torch.fft.rfftn(x, dim=[-3, -2, -1])
        d1, d2, d3 = x_ft.size(-3), x_ft.size(-2), x_ft.size(-1)
        out_ft = torch.zeros(x.size(0), self.out_channels, d1, d2, d3, dtype=torch.cfloat, device=x.device)
        pad_d3 = d3 - self.modes3
        pad_d2 = d2 - self.modes2
        pad_d1 = d1 - self.modes1
        out_ft = out_ft + F.pad(
            self.compl_mul3d(x_ft[:, :, : self.modes1, : self.modes2, : self.modes3].contiguous(), self.weights1),
            (0, pad_d3, 0, pad_d2, 0, pad_d1),
        )
        out_ft = out_ft + F.pad(
            self.compl_mul3d(x_ft[:, :, -self.modes1 :, : self.modes2, : self.modes3].contiguous(), self.weights2),
            (0, pad_d3, 0, pad_d2, pad_d1, 0),
        )
        out_ft = out_ft + F.pad(
            self.compl_mul3d(x_ft[:, :, : self.modes1, -self.modes2 :, : self.modes3].contiguous(), self.weights3),
            (0, pad_d3, pad_d2, 0, 0, pad_d1),
        )
        out_ft = out_ft + F.pad(
            self.compl_mul3d(x_ft[:, :, -self.modes1 :, -self.modes2 :, : self.modes3].contiguous(), self.weights4),
            (0, pad_d3, pad_d2, 0, pad_d1, 0),
        )
        return torch.fft.irfftn(out_ft, s=(x.size(-3), x.size(-2), x.size(-1)))

    def reset_parameters(self):
        self.weights1.data = self.scale * torch.rand(self.weights1.data.shape)
        self.weights2.data = self.scale * torch.rand(self.weights2.data.shape)
        self.weights3.data = self.scale * torch.rand(self.weights3.data.shape)
        self.weights4.data = self.scale * torch.rand(self.weights4.data.shape)


class DPOT2DLayer(nn.Module):
    """``physicsnemo/models/dpot/dpot.py``'s spectral mixing layer (``channel_first=False``, GELU), same wheel."""

    def __init__(self, width=32, num_blocks=8, modes=32, hidden_size_factor=1):
        super().__init__()
        self.width = width
        self.num_blocks = num_blocks
        self.block_size = width // num_blocks
        self.modes = modes
        self.hidden_size_factor = hidden_size_factor
        self.act = nn.GELU()
        scale = 1.0 / (self.block_size * self.block_size * self.hidden_size_factor)
        self.w1 = nn.Parameter(scale * torch.rand(2, num_blocks, self.block_size, self.block_size * hidden_size_factor))
        self.b1 = nn.Parameter(scale * torch.rand(2, num_blocks, self.block_size * hidden_size_factor))
        self.w2 = nn.Parameter(scale * torch.rand(2, num_blocks, self.block_size * hidden_size_factor, self.block_size))
        self.b2 = nn.Parameter(scale * torch.rand(2, num_blocks, self.block_size))

    def forward(self, x):
        b, h, w, c = x.shape
        residual = x
        x_ft = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")  # (B,H,W//2+1,C)
        x_ft = x_ft.view(b, h, x_ft.shape[2], self.num_blocks, self.block_size)
        kept = min(self.modes, h, w // 2 + 1)
        o1_real = torch.zeros(
            b,
            h,
            x_ft.shape[2],
            self.num_blocks,
            self.block_size * self.hidden_size_factor,
            device=x.device,
        )
        o1_imag = torch.zeros_like(o1_real)
        o2_real = torch.zeros(b, h, x_ft.shape[2], self.num_blocks, self.block_size, device=x.device)
        o2_imag = torch.zeros_like(o2_real)
        o1_real[:, :kept, :kept] = self.act(
            torch.einsum("...bi,bio->...bo", x_ft[:, :kept, :kept].real, self.w1[0])
            - torch.einsum("...bi,bio->...bo", x_ft[:, :kept, :kept].imag, self.w1[1])
            + self.b1[0]
        )
        o1_imag[:, :kept, :kept] = self.act(
            torch.einsum("...bi,bio->...bo", x_ft[:, :kept, :kept].imag, self.w1[0])
            + torch.einsum("...bi,bio->...bo", x_ft[:, :kept, :kept].real, self.w1[1])
            + self.b1[1]
        )
        o2_real[:, :kept, :kept] = (
            torch.einsum("...bi,bio->...bo", o1_real[:, :kept, :kept], self.w2[0])
            - torch.einsum("...bi,bio->...bo", o1_imag[:, :kept, :kept], self.w2[1])
            + self.b2[0]
        )
        o2_imag[:, :kept, :kept] = (
            torch.einsum("...bi,bio->...bo", o1_imag[:, :kept, :kept], self.w2[0])
            + torch.einsum("...bi,bio->...bo", o1_real[:, :kept, :kept], self.w2[1])
            + self.b2[1]
        )
        x_mix = torch.view_as_complex(torch.stack([o2_real, o2_imag], dim=-1))
        x_mix = x_mix.view(b, h, x_mix.shape[2], c)
        x_out = torch.fft.irfft2(x_mix, s=(h, w), dim=(1, 2), norm="ortho")
        x_out = x_out + residual
        return x_out
