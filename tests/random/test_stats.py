"""Statistical tests of the counter-based draws: moments, Kolmogorov-Smirnov, rates, and no structure across shards.

Fixed seeds make every run draw the same numbers, so these tests are
deterministic; the thresholds are 6 standard errors (moments, rates,
correlations) or a KS significance of about 1e-6, so a correct generator
passes with a wide margin and a broken one (a repeated block, a biased bit
recipe, correlated shards) fails by orders of magnitude.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

import physicsnemo_dp as pdp
from physicsnemo_dp import _philox
from tests._harness import distributed

from physicsnemo_dp.rules.random import distribution_values

from ._ref import Whole, sharded

N = 1 << 17
KS_CRITICAL = math.sqrt(-0.5 * math.log(1e-6 / 2))  # sqrt(n) * D at significance 1e-6: ~2.69


def _ks(sample: torch.Tensor, cdf) -> float:
    """sqrt(n) times the Kolmogorov-Smirnov distance between the sample and ``cdf``."""
    x, _ = sample.double().flatten().sort()
    n = x.numel()
    f = cdf(x)
    upper = (torch.arange(1, n + 1, dtype=torch.float64) / n - f).max()
    lower = (f - torch.arange(0, n, dtype=torch.float64) / n).max()
    return math.sqrt(n) * max(upper.item(), lower.item())


def _normal_cdf(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def _draw(kind, dtype, seed=0, shape=(N,)):
    key = _philox.draw_key("cpu", torch.Generator().manual_seed(seed))
    return _philox.sample_full(kind, key, shape, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_uniform_moments_range_and_ks(dtype):
    u = _draw("uniform", dtype).double()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / N)
    assert abs(u.var().item() - 1 / 12) < 6 * math.sqrt(1 / 180 / N)
    grid = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(dtype, 0.0)  # a discrete uniform on a grid
    assert _ks(u, lambda x: (x + grid).clamp(max=1)) < KS_CRITICAL + math.sqrt(N) * grid


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_moments_and_ks(dtype):
    z = _draw("normal", dtype).double()
    assert abs(z.mean().item()) < 6 / math.sqrt(N)
    assert abs(z.var().item() - 1) < 6 * math.sqrt(2 / N)
    assert abs((z**3).mean().item()) < 6 * math.sqrt(15 / N)  # skewness
    assert abs((z**4).mean().item() - 3) < 6 * math.sqrt(96 / N)  # kurtosis
    assert _ks(z, _normal_cdf) < KS_CRITICAL
    # the two Box-Muller partners (neighbouring elements) are uncorrelated too
    pairs = z.reshape(-1, 2)
    assert abs((pairs[:, 0] * pairs[:, 1]).mean().item()) < 6 / math.sqrt(N / 2)


def test_derived_distributions_on_shardless_tensors():
    """exponential, integers and bernoulli (one process; the sharded tests show the same values on shards)."""
    torch.manual_seed(0)
    key = _philox.draw_key("cpu")
    e = distribution_values("exponential", key, Whole((N,)), torch.float64, "cpu", {"lambd": 2.0})
    assert abs(e.mean().item() - 0.5) < 6 * 0.5 / math.sqrt(N)
    assert _ks(e, lambda v: 1 - torch.exp(-2.0 * v)) < KS_CRITICAL
    counts = torch.bincount(pdp.random.randint(0, 10, (N,)), minlength=10).double()
    assert ((counts - N / 10).abs() < 6 * math.sqrt(N * 0.1 * 0.9)).all(), counts
    b = distribution_values("bernoulli", key, Whole((N,)), torch.float64, "cpu", {"p": 0.3})
    assert abs(b.mean().item() - 0.3) < 6 * math.sqrt(0.21 / N)


@distributed(world_sizes=(2, 3, 4))
def test_no_repeated_blocks_and_independent_neighbouring_shards(ctx):
    """The old bug (every rank drawing the same block) and any correlation across shard boundaries."""
    rows, cols = 120 * ctx.world_size + 5, 64  # uneven: the last shard differs
    placements = (Shard(0),) * ctx.mesh.ndim
    torch.manual_seed(0)
    z = pdp.randn((rows, cols), ctx.mesh, placements, dtype=torch.float64).full_tensor()
    assert torch.unique(z).numel() == z.numel(), "repeated values: blocks repeat across shards"
    sizes = pdp.chunk_sizes(rows, ctx.world_size)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    m = min(sizes)
    for r in range(len(sizes) - 1):  # the same-shape block of neighbouring shards: uncorrelated
        a = z[starts[r]:starts[r] + m].flatten()
        b = z[starts[r + 1]:starts[r + 1] + m].flatten()
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 6 / math.sqrt(a.numel()), (r, corr)
    flat = z.flatten()  # lag-1 and lag-(row) correlation over the whole field, boundaries included
    for lag in (1, cols):
        corr = torch.corrcoef(torch.stack([flat[:-lag], flat[lag:]]))[0, 1].item()
        assert abs(corr) < 6 / math.sqrt(flat.numel()), (lag, corr)
    assert abs(z.mean().item()) < 6 / math.sqrt(z.numel()) and abs(z.var().item() - 1) < 6 * math.sqrt(2 / z.numel())


@distributed(world_sizes=(3,), mesh_2d=True)
def test_bernoulli_and_dropout_rates_on_shards(ctx):
    shape = (257, 96)
    x = sharded(torch.ones(shape, dtype=torch.float64), ctx.mesh, (Shard(0),) * ctx.mesh.ndim)
    n = x.numel()
    torch.manual_seed(1)
    for p in (0.1, 0.5, 0.9):
        kept = (F.dropout(x, p).full_tensor() != 0).double().mean().item()
        assert abs(kept - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n), (p, kept)
        rate = x.clone().bernoulli_(p).full_tensor().mean().item()
        assert abs(rate - p) < 6 * math.sqrt(p * (1 - p) / n), (p, rate)
    mask = F.dropout2d(torch.ones_like(sharded(torch.ones(64, 48, 2, 2), ctx.mesh, (Shard(1),) * ctx.mesh.ndim)), 0.4)
    per_channel = mask.full_tensor()[:, :, 0, 0]
    assert (mask.full_tensor() == per_channel[:, :, None, None]).all(), "dropout2d mask varies within a channel"
    kept = (per_channel != 0).double().mean().item()
    assert abs(kept - 0.6) < 6 * math.sqrt(0.24 / per_channel.numel())
