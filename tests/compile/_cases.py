"""The compile matrix: small functions and models per op family, with their sharded inputs.

Each family is a list of :class:`Case` built for a mesh: 1-D meshes shard one
dim, the 2x2 mesh shards two (both uneven, with empty shards where the
extent allows). Shapes are tiny on purpose: compile time, not data size,
dominates here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

DTYPE = torch.float64


@dataclass
class Case:
    label: str
    fn: Callable
    inputs: list  # (global tensor, placements or None)
    module: nn.Module | None = None


def _g(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _sharded(mesh, *dims):
    """Placements sharding ``dims[0]`` over mesh dim 0 and, on a 2-D mesh, ``dims[1]`` over mesh dim 1."""
    return tuple(Shard(d) for d in dims[: mesh.ndim])


def _replicated(mesh):
    return (Replicate(),) * mesh.ndim


# --------------------------------------------------------------------------- #
# Op families
# --------------------------------------------------------------------------- #
def _pointwise(mesh):
    x = (_g(7, 5, 3), _sharded(mesh, 0, 1))
    return [
        # a plain weight (promoted, gradient summed over the mesh) and a scalar
        Case("promoted weight", lambda x, w: torch.tanh(x * w + 1.5), [x, (_g(3, seed=1), None)]),
        # two sharded operands in different layouts (one is redistributed)
        Case("mixed layouts", lambda x, y: F.silu(x) * torch.sigmoid(y), [x, (_g(7, 5, 3, seed=2), _replicated(mesh))]),
    ]


def _views(mesh):
    def fn(x):
        y = x.reshape(7, 15) * 2  # merges unsharded dims (1-D) / a sharded and an unsharded dim (2x2)
        return y.unsqueeze(0).transpose(1, 2).flatten(0, 1), x.permute(2, 0, 1).contiguous()

    return [Case("reshape/transpose/permute", fn, [(_g(7, 5, 3), _sharded(mesh, 0, 2))])]


def _reductions(mesh):
    def fn(x):
        # a sum over a sharded dim stays a pending sum (Partial); mean/max are reduced across ranks
        return x.sum(0), x.mean((0, 1)), x.max(0).values, x.amax(1)

    return [Case("sum/mean/max/amax", fn, [(_g(7, 5, 3), _sharded(mesh, 0, 1))])]


def _matmul(mesh):
    return [
        Case("nn.Linear", lambda m, x: m(x), [(_g(7, 5, 3), _sharded(mesh, 0, 1))], nn.Linear(3, 4, dtype=DTYPE)),
        # contraction dim sharded: the product is a pending sum until used
        Case("matmul over sharded dim", lambda a, b: torch.tanh(a @ b), [(_g(7, 5), _sharded(mesh, 1, 0)), (_g(5, 3, seed=1), None)]),
    ]


def _layer_norm(mesh):
    return [
        Case("LayerNorm over local dim", lambda m, x: m(x), [(_g(7, 5, 3), _sharded(mesh, 0, 1))], nn.LayerNorm(3, dtype=DTYPE)),
        # statistics span a sharded dim: all-reduced
        Case("LayerNorm over sharded dim", lambda m, x: m(x), [(_g(7, 5, 3), _sharded(mesh, 1, 0))], nn.LayerNorm((5, 3), dtype=DTYPE)),
    ]


def _softmax(mesh):
    fn = lambda x: torch.softmax(x, -1) + torch.log_softmax(x, 0)  # noqa: E731 (dim 0 is sharded)
    return [Case("softmax/log_softmax", fn, [(_g(7, 5, 3), _sharded(mesh, 0, 1))])]


def _conv(mesh):
    x = (_g(2, 3, 9, 6), _sharded(mesh, 2, 3))
    return [
        Case("Conv2d 3x3 halo", lambda m, x: m(x), [x], nn.Conv2d(3, 4, 3, padding=1, dtype=DTYPE)),
        Case("Conv2d stride 2", lambda m, x: m(x), [x], nn.Conv2d(3, 2, 3, stride=2, padding=1, dtype=DTYPE)),
    ]


def _norms(mesh):
    x = (_g(2, 4, 9, 6), _sharded(mesh, 2, 3))
    return [
        Case("BatchNorm2d (train)", lambda m, x: m(x), [x], nn.BatchNorm2d(4, dtype=DTYPE)),
        Case("GroupNorm", lambda m, x: m(x), [x], nn.GroupNorm(2, 4, dtype=DTYPE)),
    ]


def _pool(mesh):
    x = (_g(2, 3, 9, 6), _sharded(mesh, 2, 3))
    return [
        Case("max_pool2d", lambda x: F.max_pool2d(x, 2), [x]),
        Case("avg_pool2d", lambda x: F.avg_pool2d(x, 3, stride=1, padding=1), [x]),
        Case("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (4, 2)), [x]),
        Case("interpolate bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), [x]),
        Case("pad reflect", lambda x: F.pad(x, (1, 1, 2, 2), mode="reflect"), [x]),
    ]


def _indexing(mesh):
    """Reads with tensor indices; the sharded dims are indexed (a pending-sum output) or carried along."""
    x = (_g(7, 5, 3), _sharded(mesh, 0, 1))
    rows = (torch.tensor([6, 0, 2, 2, 5]), None)  # a repeated row: gradients accumulate
    where = (torch.randint(0, 7, (7, 5, 3), generator=torch.Generator().manual_seed(3)), None)
    return [
        Case("index_select along sharded dims", lambda x, i: torch.index_select(x, 0, i) * 2, [x, rows]),
        Case("index_select along a local dim", lambda x, i: x.index_select(2, i % 3) + 1, [x, rows]),
        Case("getitem/index with tensor indices", lambda x, i: (x[i] * 2, x[:, i % 5] + 1), [x, rows]),
        # kept linear: gather(...).tanh() hangs in Inductor's backward on the rank with the empty shard
        # (an extra collective there; not the range check), an open compile-protocol issue
        Case("gather along sharded dims", lambda x, i: torch.gather(x, 0, i) * 2, [x, where]),
    ]


class SmallCNN(nn.Module):
    """Conv -> GroupNorm -> GELU -> strided Conv -> BatchNorm -> ReLU -> Conv, on a sharded grid."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU(),
            nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 2, 1),
        ).to(DTYPE)  # fmt: skip

    def forward(self, x):
        return self.body(x)


def _cnn(mesh):
    return [Case("SmallCNN", lambda m, x: m(x), [(_g(2, 3, 9, 6), _sharded(mesh, 2, 3))], SmallCNN())]


class TokenMLP(nn.Module):
    """The token-wise half of a transformer block: LayerNorm -> Linear -> GELU -> Linear, residual."""

    def __init__(self, dim=4, hidden=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=DTYPE)
        self.up = nn.Linear(dim, hidden, dtype=DTYPE)
        self.down = nn.Linear(hidden, dim, dtype=DTYPE)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _mlp(mesh):
    # tokens (batch, sequence, features) sharded along the sequence
    return [Case("transformer MLP half", lambda m, x: m(x), [(_g(2, 9, 4), _sharded(mesh, 1, 0))], TokenMLP())]


def _attention(mesh):
    """The attention layouts that need no point-to-point ring (those compile; the ring does not)."""

    def fn(q, k, v):
        return torch.tanh(F.scaled_dot_product_attention(q * 2, k, v, is_causal=False)) + 1

    q, kv = (1, 2, 9, 4), (1, 2, 7, 4)
    rows, whole = _sharded(mesh, 2, 0), _replicated(mesh)
    return [
        Case("sharded queries (local)", fn, [(_g(*q), rows), (_g(*kv, seed=1), whole), (_g(*kv, seed=2), whole)]),
        Case("sharded keys/values", fn, [(_g(*q), whole), (_g(*kv, seed=1), rows), (_g(*kv, seed=2), rows)]),
    ]


def _fft(mesh):
    """torch.fft along sharded dims: transposes (all-to-alls) between local transforms, then back."""

    def block(x):  # the FNO spectral block: rfft2, keep low modes in a zero spectrum, irfft2
        x_ft = torch.fft.rfft2(x, norm="ortho")
        out_ft = torch.zeros_like(x_ft)
        out_ft[..., :3, :2] = x_ft[..., :3, :2] * 2
        return torch.fft.irfft2(out_ft, s=x.shape[-2:], norm="ortho") + x

    def shifted(x):  # rfft along the sharded dim, fftshift (roll) along the dim it moved to, inverse
        return torch.fft.irfft(torch.fft.fftshift(torch.fft.rfft(x, dim=2), dim=3), n=9, dim=2) * 2

    x = (_g(2, 3, 9, 6), _sharded(mesh, 2, 0))
    return [Case("spectral block rfft2/irfft2", block, [x]), Case("rfft/fftshift/irfft", shifted, [x])]


def _losses(mesh):
    target = torch.randint(0, 4, (6, 5), generator=torch.Generator().manual_seed(3))
    target[1, 2] = -100  # ignored
    x = (_g(6, 4, 5), _sharded(mesh, 0, 2))
    t = (target, _sharded(mesh, 0, 1))
    def fn(x, t, y, w):
        # per-element losses on the shards, then global sums (a ratio of two for the weighted means); the
        # class-index check is a graph op. (Not l1_loss's weight: torch drops it before a compiled handler sees it.)
        return F.cross_entropy(x, t, label_smoothing=0.1) + F.mse_loss(x, y, weight=w) + F.l1_loss(x, y)

    return [Case("cross_entropy + weighted mse_loss + l1_loss", fn, [x, t, (_g(6, 4, 5, seed=1), None), (_g(6, 4, 5, seed=2).abs(), None)])]


def _channel_ops(mesh):
    x = (_g(2, 8, 5, 3), _sharded(mesh, 2, 0))
    return [
        Case("PReLU, pixel_shuffle, glu", lambda m, x: F.glu(F.pixel_shuffle(m(x), 2), 1), [x], nn.PReLU(8, dtype=DTYPE)),
    ]


#: op family -> cases for a mesh; the keys are the rows of the compile matrix.
FAMILIES: dict[str, Callable] = {
    "pointwise": _pointwise,
    "views": _views,
    "reductions": _reductions,
    "matmul": _matmul,
    "layer_norm": _layer_norm,
    "softmax": _softmax,
    "batch_group_norm": _norms,
    "conv": _conv,
    "pool_interp_pad": _pool,
    "indexing": _indexing,
    "attention": _attention,
    "mlp": _mlp,
    "cnn": _cnn,
    "fft": _fft,
    "losses": _losses,
    "channel_ops": _channel_ops,
}
