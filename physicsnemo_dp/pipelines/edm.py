"""EDM diffusion (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models").

Three pieces, each usable on plain tensors and on ShardTensor latents alike:

* :class:`EDMSchedule` — the noise levels: the training distribution of sigma
  (log-normal, ``P_mean``/``P_std``), the preconditioning constants
  (``c_skip``, ``c_out``, ``c_in``, ``c_noise``, the loss weight) and the
  sampling sigmas ``sigma_max -> sigma_min`` spaced with ``rho`` (then 0).
* :class:`EDMPrecond` — wraps a raw network ``F(x_in, c_noise, condition)``
  into the denoiser ``D(x; sigma) = c_skip x + c_out F(c_in x, c_noise)``.
* :func:`edm_loss` and :class:`HeunSampler` — the training loss and the
  2nd-order Heun sampler with stochastic churn (Algorithm 2 of the paper).

Why this is domain-parallel without a line about ranks: every sigma is a
replicated Python float (sampling) or a small plain tensor per sample
(training), so the preconditioning is a pointwise op between a ShardTensor and
a plain tensor, which promotion handles without communication; the only
random draws on the latents are :func:`physicsnemo_dp.random.randn_like`, which
gives values that depend only on (generator state, global element index), in
O(local) memory on a ShardTensor and the same values over the whole plain
tensor. A sample therefore does not depend on how the domain is split, and a
plain one-process run gives it too (``tests/diffusion/test_sampler.py``); it
is not torch's own CPU stream (``docs/random.md``). Every decision of the
sampler (the churn ``gamma`` of a step, whether noise is drawn) is taken on
replicated floats, so every rank draws the same number of values and the
generators stay in step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..distributed import ModelCapabilities, query_capabilities
from ..random import randn_like

__all__ = ["EDMSchedule", "EDMPrecond", "HeunSampler", "edm_loss"]


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
            raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class EDMSchedule:
    """The noise levels of EDM: training distribution, preconditioning, sampling sigmas.

    Defaults are the paper's (Table 1, "EDM" column). ``sigma_data`` is the
    standard deviation of the (normalized) data: the preconditioning keeps the
    network's input and target at unit variance for data of that spread.
    """

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_data: float = 0.5
    rho: float = 7.0
    P_mean: float = -1.2
    P_std: float = 1.2

    def __post_init__(self) -> None:
        _positive("EDMSchedule", sigma_min=self.sigma_min, sigma_max=self.sigma_max, sigma_data=self.sigma_data,
                  rho=self.rho, P_std=self.P_std)  # fmt: skip
        if isinstance(self.P_mean, bool) or not isinstance(self.P_mean, (int, float)) or not math.isfinite(self.P_mean):
            raise ValueError(f"EDMSchedule.P_mean must be a finite number, got {self.P_mean!r}")
        if not self.sigma_min < self.sigma_max:
            raise ValueError(f"EDMSchedule needs sigma_min < sigma_max, got {self.sigma_min} and {self.sigma_max}")

    def to_dict(self) -> dict:
        """JSON-able fields (a checkpoint stores them without pickle)."""
        return asdict(self)

    # -------------------------------------------------------- preconditioning
    def c_skip(self, sigma):
        return self.sigma_data**2 / (sigma**2 + self.sigma_data**2)

    def c_out(self, sigma):
        return sigma * self.sigma_data / (sigma**2 + self.sigma_data**2) ** 0.5

    def c_in(self, sigma):
        return 1 / (sigma**2 + self.sigma_data**2) ** 0.5

    def c_noise(self, sigma):
        return torch.log(sigma) / 4 if isinstance(sigma, torch.Tensor) else math.log(sigma) / 4

    def loss_weight(self, sigma):
        """lambda(sigma) = 1 / c_out(sigma)^2: every noise level contributes a unit-variance target."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    # -------------------------------------------------------------- sigmas
    def sample_sigmas(self, num_steps: int) -> list[float]:
        """``num_steps`` sigmas from ``sigma_max`` down to ``sigma_min`` (eq. 5, ``rho``), then 0.

        Python floats in double precision, the same on every rank: they are
        replicated scalars, never tensors that would need to agree.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        if num_steps == 1:
            return [float(self.sigma_max), 0.0]
        lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
        return [(hi + i / (num_steps - 1) * (lo - hi)) ** self.rho for i in range(num_steps)] + [0.0]

    def training_sigma(self, batch: int, ndim: int, *, dtype, device, generator=None) -> torch.Tensor:
        """Per-sample training noise levels ``exp(P_mean + P_std * N(0, 1))``, shape ``(batch, 1, ..., 1)``.

        A small plain tensor (one value per sample) that broadcasts against the
        latents: replicated over the domain ranks, which draw it from the same
        generator state.
        """
        normal = torch.randn((batch,) + (1,) * (ndim - 1), generator=generator, dtype=dtype, device=device)
        return (normal * self.P_std + self.P_mean).exp()


class EDMPrecond(nn.Module):
    """``D(x; sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x, c_noise(sigma), condition)``.

    ``net`` is any module called as ``net(x_in, c_noise, condition)`` (or
    ``net(x_in, c_noise)`` when ``condition`` is None); ``c_noise`` is a plain
    tensor broadcastable against ``x`` (0-dim when sampling, one value per
    sample when training) — a network can feed it in as a constant channel,
    ``torch.ones_like(x[:, :1]) * c_noise``, which stays sharded.
    """

    def __init__(self, net: nn.Module, schedule: EDMSchedule | None = None):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise TypeError(f"EDMPrecond needs an nn.Module as net, got {type(net).__name__}")
        self.net = net
        self.schedule = schedule or EDMSchedule()

    @classmethod
    def get_capabilities(cls, config) -> ModelCapabilities:
        """The wrapped network's capabilities: the preconditioning adds only pointwise ops with plain scalars.

        ``config`` is the wrapped network (:attr:`config`), so
        ``parallelize_model(EDMPrecond(net), context)`` accepts exactly the
        contexts ``net`` declares it supports.
        """
        return query_capabilities(config)

    @property
    def config(self) -> nn.Module:
        """What :meth:`get_capabilities` is asked about: the wrapped network (a property, not a submodule)."""
        return self.net

    def forward(self, x: torch.Tensor, sigma, condition: torch.Tensor | None = None) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
        s = self.schedule
        args = (s.c_in(sigma) * x, s.c_noise(sigma)) + (() if condition is None else (condition,))
        return s.c_skip(sigma) * x + s.c_out(sigma) * self.net(*args)


def _schedule_of(denoiser, schedule: EDMSchedule | None) -> EDMSchedule:
    """The schedule given, else the denoiser's own (also through a DDP wrapper's ``.module``), else EDM's defaults."""
    if schedule is not None:
        return schedule
    for module in (denoiser, getattr(denoiser, "module", None)):
        found = getattr(module, "schedule", None)
        if isinstance(found, EDMSchedule):
            return found
    return EDMSchedule()


def edm_loss(denoiser, target: torch.Tensor, condition: torch.Tensor | None = None, *,
             schedule: EDMSchedule | None = None, generator: torch.Generator | None = None,
             sigma: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The EDM training loss: ``mean(lambda(sigma) (D(y + sigma n; sigma) - y)^2)``, sigma log-normal per sample.

    ``target`` is a batch ``(B, ...)`` (a ShardTensor or a plain tensor);
    ``n = physicsnemo_dp.random.randn_like(target)`` is the same for every
    decomposition (and for the plain tensor), and
    the per-sample ``sigma`` is drawn as a plain tensor from the same
    generator on every rank, so the loss and its gradients equal one process's.
    ``sigma`` (per sample, broadcastable against ``target``) and ``noise``
    (standard normal, ``target``'s shape) replace the draws when given: an
    evaluation at fixed noise levels, or common random numbers across runs.
    Returns the mean over every element (a replicated scalar).
    """
    schedule = _schedule_of(denoiser, schedule)
    if target.ndim < 1 or target.shape[0] == 0:
        raise ValueError(f"edm_loss needs a non-empty batch as target (dim 0 = samples), got shape {tuple(target.shape)}")
    if sigma is None:
        sigma = schedule.training_sigma(target.shape[0], target.ndim, dtype=target.dtype, device=target.device,
                                        generator=generator)  # fmt: skip
    if noise is None:
        noise = randn_like(target, generator=generator)
    elif tuple(noise.shape) != tuple(target.shape):
        raise ValueError(f"edm_loss: noise has shape {tuple(noise.shape)}, target {tuple(target.shape)}; give "
                         "standard-normal noise of the target's shape (and layout)")
    denoised = denoiser(target + noise * sigma, sigma, condition)
    return (schedule.loss_weight(sigma) * (denoised - target) ** 2).mean()


@dataclass(frozen=True)
class HeunSampler:
    """EDM's stochastic Heun sampler (Algorithm 2): ``num_steps`` noise levels, 2nd-order correction, churn.

    ``S_churn`` (0: the deterministic ODE sampler) adds fresh noise at every
    step whose sigma lies in ``[S_min, S_max]``, raising sigma by the factor
    ``1 + min(S_churn / num_steps, sqrt(2) - 1)``; ``S_noise`` scales that
    noise (slightly above 1 counters the loss of detail the paper observed).
    """

    num_steps: int = 18
    S_churn: float = 0.0
    S_min: float = 0.0
    S_max: float = float("inf")
    S_noise: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"HeunSampler.num_steps must be an int >= 1, got {self.num_steps!r}")
        for name in ("S_churn", "S_min", "S_max", "S_noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"HeunSampler.{name} must be a number >= 0, got {value!r}")
        if self.S_min > self.S_max:
            raise ValueError(f"HeunSampler needs S_min <= S_max, got {self.S_min} and {self.S_max}")

    def to_dict(self) -> dict:
        """JSON-able fields (``S_max`` = inf is stored as JSON's ``Infinity``, which Python reads back)."""
        return asdict(self)

    def gammas(self, sigmas: list[float]) -> list[float]:
        """The churn factor of each step (replicated floats: every rank takes the same branches)."""
        churn = min(self.S_churn / self.num_steps, math.sqrt(2) - 1)
        return [churn if self.S_min <= s <= self.S_max else 0.0 for s in sigmas[:-1]]

    @torch.no_grad()
    def sample(self, denoiser, latents: torch.Tensor, condition: torch.Tensor | None = None, *,
               schedule: EDMSchedule | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Integrate from ``sigma_max`` to 0 and return the sample (the shape and layout of ``latents``).

        ``latents`` are standard-normal initial values, drawn sharded where
        they live: ``physicsnemo_dp.random.randn_like(template, generator=g)``
        (a ShardTensor template: O(local); a plain one: the same values whole),
        or ``physicsnemo_dp.randn(global_shape, mesh, placements, generator=g)``
        — never gathered. The churn noise is drawn the same way. ``denoiser(x, sigma, condition)`` is
        D(x; sigma), e.g. an :class:`EDMPrecond` (whose ``schedule`` is used
        when ``schedule`` is not given).
        """
        schedule = _schedule_of(denoiser, schedule)
        sigmas = schedule.sample_sigmas(self.num_steps)
        x_next = latents * sigmas[0]
        for i, (t_cur, t_next, gamma) in enumerate(zip(sigmas[:-1], sigmas[1:], self.gammas(sigmas))):
            x_cur = x_next
            t_hat = t_cur + gamma * t_cur
            if gamma > 0:
                noise = randn_like(x_cur, generator=generator)
                x_hat = x_cur + math.sqrt(t_hat**2 - t_cur**2) * self.S_noise * noise
            else:
                x_hat = x_cur
            d_cur = (x_hat - denoiser(x_hat, t_hat, condition)) / t_hat
            x_next = x_hat + (t_next - t_hat) * d_cur
            if i < self.num_steps - 1:  # Heun's correction, except at the last step (to sigma = 0)
                d_prime = (x_next - denoiser(x_next, t_next, condition)) / t_next
                x_next = x_hat + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d_prime)
        return x_next
