"""Model-facing pipelines built on :mod:`physicsnemo_dp.distributed`: diffusion (EDM) on ShardTensor latents.

:class:`DiffusionPipeline` holds named networks (a ``"denoiser"``, an optional
``"regression"``) with the noise schedule and sampler settings, parallelizes
the selected ones for one :class:`~physicsnemo_dp.distributed.MeshContext`
and saves them through :mod:`physicsnemo_dp.checkpoint`. :mod:`.edm` is the
math (preconditioning, loss, Heun sampler), free of anything distributed.
Walkthrough: ``docs/diffusion.md``.
"""

from .diffusion import DENOISER, REGRESSION, DiffusionPipeline
from .edm import EDMPrecond, EDMSchedule, HeunSampler, edm_loss

__all__ = ["DiffusionPipeline", "DENOISER", "REGRESSION", "EDMSchedule", "EDMPrecond", "HeunSampler", "edm_loss"]
