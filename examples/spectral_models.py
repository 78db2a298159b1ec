"""Spectral models written the way public implementations write them: an FNO and an AFNO (FourCastNet) net.

Nothing here knows about ranks. Both models use plain ``torch.fft`` calls,
slicing of the spectrum, ``x_ft.new_zeros`` / ``zeros_like`` filled by slice
assignment and complex weights: on a ShardTensor input sharded along a
spatial dim, the library's FFT rules transpose the data so each transformed
dim is whole, and the models give the single-process result. They live next
to the examples (not in ``physicsnemo_dp``) because they are *user* code the
library must run unchanged — the conformance tests (``tests/spectral/``), the
FNO example (``examples/fno_darcy.py``) and the memory benchmark
(``benchmarks/memory_scaling.py``) all import them from here, so there is one
copy of each model.

* :class:`FNO2d` — Li et al. 2021, "Fourier Neural Operator for Parametric
  PDEs": grid coordinates appended as channels, a pointwise lift, Fourier
  layers (:class:`SpectralConv2d`: ``rfft2``, an ``einsum`` over the lowest
  ``modes1 x modes2`` modes of both corners of the half spectrum, ``irfft2``
  with ``s=``)
  plus 1x1 convolutions, a pointwise projection.
* :class:`AFNONet` — Guibas et al. 2021, "Adaptive Fourier Neural Operators",
  as used by Pathak et al. 2022 (FourCastNet): patch embedding (a convolution
  with stride = patch), a learned position embedding, blocks of
  :class:`AFNO2D` token mixing (``rfft2`` over the token grid, a
  block-diagonal complex MLP with soft-shrinkage on the kept modes,
  ``irfft2``, residual) and a channel MLP, each after a LayerNorm, then a
  linear head that un-patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SpectralConv2d", "FNO2d", "AFNO2D", "AFNOBlock", "AFNONet", "complex_dtype"]


def complex_dtype(dtype: torch.dtype) -> torch.dtype:
    """The complex dtype of a real one's precision (float32 -> complex64, float64 -> complex128)."""
    return torch.promote_types(dtype, torch.complex64)


# --------------------------------------------------------------------------- #
# FNO
# --------------------------------------------------------------------------- #
class SpectralConv2d(nn.Module):
    """Fourier layer: multiply the lowest modes of the spectrum by learned complex weights.

    ``rfft2`` over the last two dims, then ``out[..., :m1, :m2]`` and
    ``out[..., -m1:, :m2]`` (the low positive and negative frequencies along
    the first transformed dim; the half spectrum's last dim has only
    non-negative ones) are each a channel contraction of the input's modes,
    the rest of ``out`` stays zero, and ``irfft2(out, s=(H, W))`` returns to
    the grid. The modes are capped at what the grid holds (``H // 2`` and
    ``W // 2 + 1``), so the layer accepts any grid size.

    The weights are complex parameters. Run eagerly, each corner is one
    complex ``einsum``. While ``torch.compile`` traces, the spectrum is worked
    on through its real view (``torch.view_as_real``) and the complex product
    is one real ``einsum`` (:meth:`_real_product`), the same math: with a
    complex spectrum its gradient (it feeds two corners) is a sum of complex
    tensors, which Inductor lowers by viewing them as real, and in the backward
    that fails ("self.stride(-1) must be 1 to view ComplexFloat as Float",
    torch 2.13, plain tensors alike). The real form costs what the complex one
    does at FNO sizes (batch 4, 32 channels, 12 x 12 modes) and up to 2.5x more
    for tiny ones run eagerly, hence the two forms.
    """

    def __init__(self, c_in: int, c_out: int, modes1: int, modes2: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.c_out, self.modes1, self.modes2 = c_out, modes1, modes2
        scale = 1 / (c_in * c_out)
        cdtype = complex_dtype(dtype)
        self.weights1 = nn.Parameter(scale * torch.rand(c_in, c_out, modes1, modes2, dtype=cdtype))
        self.weights2 = nn.Parameter(scale * torch.rand(c_in, c_out, modes1, modes2, dtype=cdtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, h, w = x.shape
        if h < 2:  # m1 = 0 would make x_ft[:, :, -0:] the whole spectrum
            raise ValueError(f"SpectralConv2d: the grid needs at least 2 rows, got shape {tuple(x.shape)}")
        m1, m2 = min(self.modes1, h // 2), min(self.modes2, w // 2 + 1)
        x_ft = torch.fft.rfft2(x)
        real = torch.compiler.is_compiling()
        if real:
            x_ft, multiply = torch.view_as_real(x_ft), self._real_product  # (batch, c_in, h, w // 2 + 1, 2)
        else:
            multiply = partial(torch.einsum, "bixy,ioxy->boxy")
        # x_ft.new_zeros, not torch.zeros(...): on a ShardTensor the buffer is then sharded like x_ft (O(local)
        # memory); a plain torch.zeros also gives the right result but holds the whole spectrum on every rank
        # (tests/spectral/test_neuralop.py runs that pattern, neuraloperator's)
        out_ft = x_ft.new_zeros(batch, self.c_out, h, w // 2 + 1, *x_ft.shape[4:])
        out_ft[:, :, :m1, :m2] = multiply(x_ft[:, :, :m1, :m2], self.weights1[:, :, :m1, :m2])
        out_ft[:, :, -m1:, :m2] = multiply(x_ft[:, :, -m1:, :m2], self.weights2[:, :, :m1, :m2])
        return torch.fft.irfft2(torch.view_as_complex(out_ft) if real else out_ft, s=(h, w))

    @staticmethod
    def _real_product(modes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``einsum("bixy,ioxy->boxy")`` of complex modes and weights, on the modes' real view ``(b, i, x, y, 2)``.

        ``(a + ib)(c + id)`` is ``[a, b] @ [[c, d], [-d, c]]``: the weights' real view becomes that block,
        laid out ``(x, y, i, 2, o, 2)`` as the batched matrix product over modes reads it (no copy inside
        ``einsum``). Returns the product's real view ``(b, o, x, y, 2)``.
        """
        w = torch.view_as_real(weights).permute(2, 3, 0, 1, 4)  # (x, y, i, o, 2)
        real, imag = w.unbind(-1)
        block = torch.stack([w, torch.stack([-imag, real], dim=-1)], dim=3)
        return torch.einsum("bixyj,xyijok->boxyk", modes, block)


class FNO2d(nn.Module):
    """Fourier neural operator on a 2-D grid: ``(batch, c_in, H, W) -> (batch, c_out, H, W)``.

    The grid coordinates in [0, 1) are appended to the input channels (as Li
    et al. do; built with ``torch.linspace`` as plain tensors and joined with
    ``torch.cat``), lifted to ``width`` channels by a 1x1 convolution, passed
    through ``layers`` Fourier layers (spectral conv + 1x1 conv, GELU between
    layers) and projected back by a two-layer pointwise MLP.
    """

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/spectral/test_models.py and tests/examples/test_fno_darcy.py
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, c_in: int = 1, c_out: int = 1, width: int = 32, modes: tuple[int, int] = (12, 12),
                 layers: int = 4, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lift = nn.Conv2d(c_in + 2, width, 1, dtype=dtype)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, *modes, dtype=dtype) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1, dtype=dtype) for _ in range(layers))
        self.project = nn.Sequential(nn.Conv2d(width, 4 * width, 1, dtype=dtype), nn.GELU(),
                                     nn.Conv2d(4 * width, c_out, 1, dtype=dtype))

    @staticmethod
    def grid(x: torch.Tensor) -> torch.Tensor:
        """Coordinates of the grid points, ``(batch, 2, H, W)``: a plain tensor of the input's global shape."""
        batch, _, h, w = x.shape
        ys = torch.linspace(0, 1, h + 1, dtype=x.dtype, device=x.device)[:-1].reshape(1, 1, h, 1)
        xs = torch.linspace(0, 1, w + 1, dtype=x.dtype, device=x.device)[:-1].reshape(1, 1, 1, w)
        return torch.cat([ys.expand(batch, 1, h, w), xs.expand(batch, 1, h, w)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(torch.cat([x, self.grid(x)], dim=1))
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise)):
            x = spectral(x) + pointwise(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        return self.project(x)


# --------------------------------------------------------------------------- #
# AFNO (FourCastNet)
# --------------------------------------------------------------------------- #
def _complex_relu(z: torch.Tensor) -> torch.Tensor:
    """ReLU of the real and imaginary parts separately (AFNO's activation in the spectral MLP)."""
    return torch.view_as_complex(F.relu(torch.view_as_real(z)))


class AFNO2D(nn.Module):
    """AFNO token mixing on channels-last tokens ``(batch, h, w, dim)``; returns the same shape.

    ``rfft2`` over the token grid (``norm="ortho"``), the channels split into
    ``num_blocks`` blocks, and on the kept modes a two-layer complex MLP
    whose weights are block-diagonal (one ``block x block*factor`` matrix per
    block): ReLU on real and imaginary parts after the first layer,
    soft-shrinkage (``F.softshrink`` on real and imaginary parts, threshold
    ``sparsity``) after the second. The weights are real tensors of shape
    ``(2, ...)`` combined into complex ones (``torch.complex(w[0], w[1])``),
    as the public implementation stores them. Modes beyond the kept fraction
    (``hard_thresholding_fraction`` of each transformed dim's modes: the lowest
    positive and negative frequencies along ``h``, the lowest along the half
    spectrum's ``w // 2 + 1``) are zero. ``irfft2`` back to the grid, plus the
    input (AFNO's residual inside the filter).
    """

    def __init__(self, dim: int, num_blocks: int = 8, sparsity: float = 0.01,
                 hard_thresholding_fraction: float = 1.0, hidden_size_factor: int = 1, scale: float = 0.02):
        super().__init__()
        if dim % num_blocks:
            raise ValueError(f"AFNO2D: dim={dim} must be a multiple of num_blocks={num_blocks}")
        if not 0 < hard_thresholding_fraction <= 1:
            raise ValueError(f"AFNO2D: hard_thresholding_fraction={hard_thresholding_fraction} must be in (0, 1]")
        self.num_blocks, self.block = num_blocks, dim // num_blocks
        self.sparsity, self.fraction = sparsity, hard_thresholding_fraction
        hidden = self.block * hidden_size_factor
        self.w1 = nn.Parameter(scale * torch.randn(2, num_blocks, self.block, hidden))
        self.b1 = nn.Parameter(scale * torch.randn(2, num_blocks, hidden))
        self.w2 = nn.Parameter(scale * torch.randn(2, num_blocks, hidden, self.block))
        self.b2 = nn.Parameter(scale * torch.randn(2, num_blocks, self.block))

    def _kept(self, h: int, w_half: int) -> tuple[int, int, int]:
        """Kept modes: the lowest ``low`` and the highest ``high`` (negative) rows, the first ``cols`` columns."""
        rows = max(1, min(h, round(h * self.fraction)))
        return (rows + 1) // 2, rows // 2, max(1, min(w_half, round(w_half * self.fraction)))

    def _mlp(self, z: torch.Tensor) -> torch.Tensor:
        """The block-diagonal complex MLP on modes ``z`` of shape ``(..., num_blocks, block)``."""
        w1, b1 = torch.complex(self.w1[0], self.w1[1]), torch.complex(self.b1[0], self.b1[1])
        w2, b2 = torch.complex(self.w2[0], self.w2[1]), torch.complex(self.b2[0], self.b2[1])
        z = _complex_relu(torch.einsum("...bi,bio->...bo", z, w1) + b1)
        z = torch.einsum("...bi,bio->...bo", z, w2) + b2
        return torch.view_as_complex(F.softshrink(torch.view_as_real(z), lambd=self.sparsity))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, h, w, dim = x.shape
        spectrum = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")
        spectrum = spectrum.reshape(batch, h, w // 2 + 1, self.num_blocks, self.block)
        low, high, cols = self._kept(h, w // 2 + 1)
        out = torch.zeros_like(spectrum)
        out[:, :low, :cols] = self._mlp(spectrum[:, :low, :cols])
        if high:
            out[:, h - high:, :cols] = self._mlp(spectrum[:, h - high:, :cols])
        out = out.reshape(batch, h, w // 2 + 1, dim)
        return torch.fft.irfft2(out, s=(h, w), dim=(1, 2), norm="ortho") + x


class AFNOBlock(nn.Module):
    """LayerNorm -> AFNO2D (+ skip) -> LayerNorm -> channel MLP (+ skip), FourCastNet's block (``double_skip``)."""

    def __init__(self, dim: int, num_blocks: int = 8, mlp_ratio: float = 4.0, sparsity: float = 0.01,
                 hard_thresholding_fraction: float = 1.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.filter = AFNO2D(dim, num_blocks, sparsity, hard_thresholding_fraction)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.filter(self.norm1(x)) + x
        return self.mlp(self.norm2(x)) + x


class AFNONet(nn.Module):
    """AFNO network on images ``(batch, c_in, H, W)`` with ``H, W`` multiples of ``patch``; same grid out.

    Patch embedding (``Conv2d`` with kernel = stride = ``patch``) to a
    ``(H/patch, W/patch)`` token grid, channels last, plus a learned position
    embedding of that grid (so ``img_size`` is fixed), ``depth``
    :class:`AFNOBlock` s, and a bias-free linear head to ``patch*patch*c_out``
    values per token, un-patched to ``(batch, c_out, H, W)``.
    """

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/spectral/test_models.py (no training example runs it)
        supports_domain: bool = True

    def __init__(self, img_size: tuple[int, int], patch: int = 2, c_in: int = 1, c_out: int = 1, dim: int = 32,
                 depth: int = 2, num_blocks: int = 4, mlp_ratio: float = 2.0, sparsity: float = 0.01,
                 hard_thresholding_fraction: float = 1.0):
        super().__init__()
        if img_size[0] % patch or img_size[1] % patch:
            raise ValueError(f"AFNONet: img_size={tuple(img_size)} must be multiples of patch={patch}")
        self.patch, self.c_out = patch, c_out
        self.tokens = (img_size[0] // patch, img_size[1] // patch)
        self.embed = nn.Conv2d(c_in, dim, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, *self.tokens, dim))
        self.blocks = nn.ModuleList(AFNOBlock(dim, num_blocks, mlp_ratio, sparsity, hard_thresholding_fraction)
                                    for _ in range(depth))
        self.head = nn.Linear(dim, patch * patch * c_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).permute(0, 2, 3, 1) + self.pos
        for block in self.blocks:
            x = block(x)
        batch, h, w, _ = x.shape
        p = self.patch
        x = self.head(x).reshape(batch, h, w, p, p, self.c_out).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(batch, self.c_out, h * p, w * p)
