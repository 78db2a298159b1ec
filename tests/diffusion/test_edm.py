"""EDM's math in one process: preconditioning, sigmas, loss, and the Heun sampler against the exact ODE solution.

For Gaussian data N(0, s^2) the ideal denoiser is known in closed form,
``D(x; sigma) = x s^2 / (sigma^2 + s^2)``, and the probability-flow ODE from
``x(sigma_max) = sigma_max z`` ends at ``x(0) = z s sigma_max / sqrt(sigma_max^2 + s^2)``:
the sampler is checked against that, and its stochastic version against the
data's standard deviation.
"""

from __future__ import annotations

import math

import pytest
import torch

from physicsnemo_dp.pipelines import EDMPrecond, EDMSchedule, HeunSampler, edm_loss

from ._nets import CondNet, denoiser, global_tensor


class _GaussianDenoiser(torch.nn.Module):
    """The exact denoiser of N(0, s^2) data."""

    def __init__(self, schedule: EDMSchedule):
        super().__init__()
        self.schedule = schedule

    def forward(self, x, sigma, condition=None):
        s2 = self.schedule.sigma_data**2
        return x * (s2 / (torch.as_tensor(sigma, dtype=x.dtype) ** 2 + s2))


def test_preconditioning_constants():
    s = EDMSchedule(sigma_data=0.5)
    sigma = torch.tensor([0.002, 0.5, 3.0, 80.0], dtype=torch.float64)
    torch.testing.assert_close(s.c_skip(sigma), 0.25 / (sigma**2 + 0.25))
    torch.testing.assert_close(s.c_out(sigma), sigma * 0.5 / (sigma**2 + 0.25).sqrt())
    torch.testing.assert_close(s.c_in(sigma), 1 / (sigma**2 + 0.25).sqrt())
    torch.testing.assert_close(s.c_noise(sigma), sigma.log() / 4)
    torch.testing.assert_close(s.loss_weight(sigma), 1 / s.c_out(sigma) ** 2)
    assert s.c_skip(0.5) == pytest.approx(0.5) and s.c_noise(1.0) == 0.0  # Python floats stay floats
    # unit-variance training target: c_skip^2 s^2 + c_out^2 ... the effective target variance is 1
    target_var = (1 - s.c_skip(sigma)) ** 2 * 0.25 / s.c_out(sigma) ** 2 + s.c_skip(sigma) ** 2 * sigma**2 / s.c_out(sigma) ** 2
    torch.testing.assert_close(target_var, torch.ones_like(sigma))


def test_sample_sigmas():
    s = EDMSchedule(sigma_min=0.002, sigma_max=80.0, rho=7.0)
    sigmas = s.sample_sigmas(18)
    assert len(sigmas) == 19 and sigmas[-1] == 0.0 and all(isinstance(v, float) for v in sigmas)
    assert sigmas[0] == pytest.approx(80.0) and sigmas[-2] == pytest.approx(0.002)
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    mid = (80.0 ** (1 / 7) + 0.5 * (0.002 ** (1 / 7) - 80.0 ** (1 / 7))) ** 7  # eq. 5 at i = (N-1)/2
    assert s.sample_sigmas(3)[1] == pytest.approx(mid)
    assert s.sample_sigmas(1) == [80.0, 0.0]


@pytest.mark.parametrize("bad", [dict(sigma_min=0.0), dict(sigma_min=90.0), dict(rho=-1.0), dict(P_std=0.0),
                                 dict(sigma_data=float("nan")), dict(P_mean=float("inf"))])
def test_schedule_refuses_bad_values(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name if name != "sigma_min" or bad[name] == 0.0 else "sigma_min < sigma_max"):
        EDMSchedule(**bad)


@pytest.mark.parametrize("bad", [dict(num_steps=0), dict(num_steps=2.0), dict(S_churn=-1.0),
                                 dict(S_noise=float("nan")), dict(S_min=2.0, S_max=1.0)])
def test_sampler_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="HeunSampler"):
        HeunSampler(**bad)
    with pytest.raises(ValueError, match="num_steps"):
        EDMSchedule().sample_sigmas(0)


def test_heun_solves_the_probability_flow_ode():
    """Deterministic sampler, exact Gaussian denoiser: the ODE's closed-form end point, 2nd-order accurate."""
    schedule = EDMSchedule(sigma_data=0.7)
    z = global_tensor(1, shape=(4096,))
    exact = z * 0.7 * 80.0 / math.sqrt(80.0**2 + 0.49)
    errors = []
    for steps in (16, 32):
        out = HeunSampler(num_steps=steps).sample(_GaussianDenoiser(schedule), z, schedule=schedule)
        errors.append((out - exact).abs().max().item())
    assert errors[1] < 0.02 * exact.abs().max().item(), errors
    assert errors[1] < errors[0] / 3.5, errors  # second order: halving the step cuts the error by ~4 (4.6 here)


def test_churn_keeps_the_data_distribution():
    """Stochastic sampler (S_churn > 0) with the exact denoiser: samples keep the data's spread.

    With 32 steps the spread is 5 % too wide (0.736: the discretization error
    of the churned steps, which shrinks with more steps: 0.703 at 128 and 512).
    """
    schedule = EDMSchedule(sigma_data=0.7)
    sampler = HeunSampler(num_steps=128, S_churn=160.0, S_min=0.05, S_max=50.0)
    assert 0 < max(sampler.gammas(schedule.sample_sigmas(128))) == pytest.approx(math.sqrt(2) - 1)
    generator = torch.Generator().manual_seed(3)
    z = torch.randn(20000, generator=generator, dtype=torch.float64)
    out = sampler.sample(_GaussianDenoiser(schedule), z, schedule=schedule, generator=generator)
    assert out.std().item() == pytest.approx(0.7, rel=0.015)
    assert abs(out.mean().item()) < 0.02
    deterministic = HeunSampler(num_steps=128).sample(_GaussianDenoiser(schedule), z, schedule=schedule)
    assert not torch.allclose(out, deterministic)  # the churn did draw noise


def test_loss_is_the_weighted_denoising_error():
    d = denoiser()
    y, cond, noise = global_tensor(1), global_tensor(2), global_tensor(3)
    sigma = torch.tensor([0.3, 7.0], dtype=torch.float64).view(2, 1, 1, 1)
    loss = edm_loss(d, y, cond, sigma=sigma, noise=noise)
    expected = (d.schedule.loss_weight(sigma) * (d(y + sigma * noise, sigma, cond) - y) ** 2).mean()
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="noise has shape"):
        edm_loss(d, y, cond, noise=noise[:1])
    with pytest.raises(ValueError, match="non-empty batch"):
        edm_loss(d, y[:0], cond[:0])


def test_loss_draws_log_normal_sigmas():
    """Training sigmas: ln(sigma) ~ N(P_mean, P_std^2), one per sample, broadcastable against the batch."""
    s = EDMSchedule(P_mean=-1.2, P_std=1.2)
    sigma = s.training_sigma(50000, 4, dtype=torch.float64, device="cpu", generator=torch.Generator().manual_seed(0))
    assert sigma.shape == (50000, 1, 1, 1)
    assert sigma.log().mean().item() == pytest.approx(-1.2, abs=0.02)
    assert sigma.log().std().item() == pytest.approx(1.2, rel=0.02)


def test_precond_needs_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        EDMPrecond(lambda x: x)
    d = EDMPrecond(CondNet().double())
    x = global_tensor(0)
    assert torch.allclose(d(x, 1e-9, global_tensor(1)), x, atol=1e-6)  # sigma -> 0: D(x) = x
