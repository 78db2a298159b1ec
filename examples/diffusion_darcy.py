"""A conditional diffusion model (EDM) on Darcy flow: pressure fields generated from permeability, domain-parallel.

    torchrun --standalone --nproc-per-node 4 examples/diffusion_darcy.py                 # (ddp 2, domain 2), DDP
    torchrun --standalone --nproc-per-node 4 examples/diffusion_darcy.py --domain-size 4 --strategy fsdp2
    python examples/diffusion_darcy.py --steps 40                                         # one process, same code

1. Data: the Darcy dataset of ``unet_darcy.py`` (written once to HDF5, read
   through ``datapipes``: each rank gets only its rows of each sample).
2. Model: the U-Net of ``unet_darcy.py`` as the raw network of an EDM
   denoiser; its input is [noisy pressure, permeability, noise level as a
   constant channel], so it is conditioned on permeability by channel
   concatenation. ``DiffusionPipeline.from_components`` parallelizes it with
   the run's one ``MeshContext``.
3. Training: the EDM loss (log-normal noise levels, noise drawn sharded and
   decomposition-invariant) through ``_common.fit`` (progress, log,
   checkpoints, ``--resume``).
4. Sampling: the Heun sampler with churn on a test sample's permeability,
   latents drawn sharded (``physicsnemo_dp.random.randn_like``); then the same
   sample in one process on rank 0 (plain tensors, world size 1) with the same
   seed. ``prediction.png``: permeability, truth, two samples, their mean's
   error; ``p_invariance.png``: the sample on this run's domain ranks, the
   one-process sample and their difference (float round-off only).

Training noise: the domain ranks of one ddp rank draw the same values (they
must); different ddp ranks also draw from the same generator state, so their
(different) samples get the same noise pattern — an unbiased but slightly
noisier loss estimate than independent draws.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.debug.viz import rank_boxes
from physicsnemo_dp.distributed import MeshContext
from physicsnemo_dp.pipelines import DiffusionPipeline, EDMPrecond, EDMSchedule, HeunSampler, edm_loss
from physicsnemo_dp.random import randn_like

import _common
import _flags
import unet_darcy
from unet_darcy import INPUT, TARGET, UNet, add_data_arguments, make_pipes, prepare_data


class DarcyDenoiser(nn.Module):
    """F(x_in, c_noise, permeability): the U-Net on [x_in, permeability, c_noise] channels."""

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/examples/test_diffusion_darcy.py
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.unet = UNet(c_in=3, c_out=1, width=width, depth=depth)

    def forward(self, x, c_noise, permeability):
        # ones_like keeps the noise-level channel sharded like x: no full-size plain tensor
        return self.unet(torch.cat([x, permeability, torch.ones_like(x) * c_noise], dim=1))


def parse_args(argv=None) -> argparse.Namespace:
    parser = _common.training_parser(__doc__, steps=150, batch_size=8, lr=2e-3, out="outputs/diffusion_darcy")
    model = add_data_arguments(parser)  # the Darcy data flags of unet_darcy.py
    parser.set_defaults(grid=32, test_samples=2)
    unet_darcy.add_unet_arguments(model)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--sample-steps", type=_flags.integer(1), default=18,
                          help="noise levels of the Heun sampler")
    sampling.add_argument("--churn", type=_flags.real(0), default=10.0,
                          help="S_churn: fresh noise per step (0: ODE sampler)")
    return unet_darcy.check_unet_arguments(parser, parser.parse_args(argv))


def build_pipeline(args, context: MeshContext) -> tuple[DiffusionPipeline, torch.optim.Optimizer, object]:
    """The pipeline (denoiser parallelized by the context), its Adam optimizer and LR schedule.

    Seeded before the weights are made, so every layout (and one process)
    starts from the same denoiser. ``sigma_data=1``: the pressure is normalized.
    """
    schedule = EDMSchedule(sigma_data=1.0)
    torch.manual_seed(args.seed)
    denoiser = EDMPrecond(DarcyDenoiser(args.width, args.depth), schedule).to(context.device)
    pipeline = DiffusionPipeline.from_components(
        {"denoiser": denoiser}, mesh_context=context, schedule=schedule,
        sampler=HeunSampler(num_steps=args.sample_steps, S_churn=args.churn, S_min=0.05, S_max=50.0),
    )  # fmt: skip
    optimizer = torch.optim.Adam(pipeline.trainable_parameters(), lr=args.lr)
    return pipeline, optimizer, _common.cosine_schedule(optimizer, args.steps)


def loss_fn(model, batch) -> torch.Tensor:
    """EDM loss of the normalized pressure given the permeability, over this ddp rank's samples."""
    return edm_loss(model, batch[TARGET].unsqueeze(1), batch[INPUT].unsqueeze(1))


@torch.no_grad()
def generate(pipeline: DiffusionPipeline, args, test_pipe, normalize, context: MeshContext) -> dict:
    """Two samples for the first test sample, gathered; and the one-process sample on rank 0 (P-invariance).

    Latents and churn noise come from generators seeded with ``--seed``, the
    same on every rank: they depend only on the seed and the element's global
    index, so the one-process run (plain tensors) must give the same sample.
    """
    batch = next(iter(test_pipe))
    condition = batch[INPUT][:1].unsqueeze(1)  # (1, 1, H, W): this rank's rows
    samples = []
    for k in range(2):
        seed = args.seed + 1000 + k
        latents = randn_like(condition, generator=torch.Generator(context.device).manual_seed(seed))
        samples.append(pipeline.sample(latents, condition, generator=torch.Generator(context.device).manual_seed(seed + 1)))
    first = samples[0]
    fields = {"sample": first.full_tensor()[0, 0].cpu(), "sample 2": samples[1].full_tensor()[0, 0].cpu()}
    plain_condition = condition.full_tensor()
    truth = batch[TARGET][:1].full_tensor()[0].cpu()
    reference = _common.plain_replica(pipeline["denoiser"], lambda: EDMPrecond(
        DarcyDenoiser(args.width, args.depth), pipeline.schedule).to(context.device))  # fmt: skip
    one_process = None
    if dist.get_rank() == 0:  # alone, plain tensors: no collective
        latents = randn_like(plain_condition, generator=torch.Generator(context.device).manual_seed(args.seed + 1000))
        one_process = pipeline.sampler.sample(reference, latents, plain_condition, schedule=pipeline.schedule,
                                              generator=torch.Generator(context.device).manual_seed(args.seed + 1001))
        one_process = one_process[0, 0].cpu()
    return {
        "sample_index": batch.samples[0],
        INPUT: normalize.inverse(INPUT, plain_condition[0, 0].cpu()),
        "truth": normalize.inverse(TARGET, truth),
        **{name: normalize.inverse(TARGET, f) for name, f in fields.items()},
        "normalized": fields,
        "normalized truth": truth,
        "one process": None if one_process is None else normalize.inverse(TARGET, one_process),
        "normalized one process": one_process,
        "rows": [box["start"][2] for box in rank_boxes(first)][1:] if isinstance(first, ShardTensor) else [],
    }


def _plot_invariance(path, result: dict, context: MeshContext):
    p = context.domain_size
    difference = result["normalized"]["sample"] - result["normalized one process"]
    return _common.plot_fields(
        path,
        {f"sample, P = {p} (domain ranks)": result["sample"], "sample, P = 1 (one process)": result["one process"],
         "difference (normalized)": difference},
        f"the same seed on two decompositions: max |difference| = {difference.abs().max():.2e} "
        f"(max |sample| = {result['normalized']['sample'].abs().max():.2g})",
        row_splits=result["rows"], same_scale=(f"sample, P = {p} (domain ranks)", "sample, P = 1 (one process)"),
    )  # fmt: skip


def run(argv=None, context: MeshContext | None = None) -> dict:
    """Train, sample and plot; returns the run's result (``_common.close_run``'s, plus the sampling figures)."""
    args = parse_args(argv)
    with _common.open_run(args, context, "diffusion-darcy", f"grid {args.grid}x{args.grid}") as (context, out, log):
        train, test = prepare_data(args, out)
        train_pipe, test_pipe, normalize = make_pipes(args, context, train, test)
        pipeline, optimizer, scheduler = build_pipeline(args, context)
        losses = _common.fit(context, pipeline["denoiser"], optimizer, scheduler, train_pipe, loss_fn, args, out, log,
                             may_change=("sample_steps", "churn"))  # sampling only: not part of the training state
        pipeline.save(out / "pipeline", step=len(losses))
        result = generate(pipeline, args, test_pipe, normalize, context)
        sample_error = float((result["normalized"]["sample"] - result["normalized truth"]).pow(2).mean())
        log.info(f"test sample {result['sample_index']}: mean squared error of a sample (normalized) "
                 f"{sample_error:.4g}")
        invariance = None
        if dist.get_rank() == 0:
            sample = result["normalized"]["sample"]
            invariance = float((sample - result["normalized one process"]).abs().max() / sample.abs().max())
            log.info(f"P-invariance: max |sample on {context.domain_size} domain ranks - one-process sample| / "
                     f"max |sample| = {invariance:.3g} (float round-off)")  # fmt: skip
            invariance_plot = _plot_invariance(out / "p_invariance.png", result, context)
            log.info(f"p_invariance plot: {invariance_plot}")
        outcome = _common.close_run(
            context, args, out, log, title="EDM diffusion on Darcy flow", losses=losses, test_loss=sample_error,
            plot_prediction=lambda path: _common.plot_fields(
                path,
                {INPUT: result[INPUT], "truth: pressure": result["truth"], "sample": result["sample"],
                 "sample 2": result["sample 2"], "|sample - truth|": (result["sample"] - result["truth"]).abs()},
                f"test sample {result['sample_index']}: two samples from the denoiser conditioned on permeability",
                row_splits=result["rows"], same_scale=("truth: pressure", "sample", "sample 2"),
            ),
            pipes=(train_pipe, test_pipe), model=pipeline["denoiser"], optimizer=optimizer,
        )  # fmt: skip
        if dist.get_rank() == 0:
            outcome["files"]["p_invariance"] = out / "p_invariance.png"
        return {**outcome, "pipeline": pipeline, "p_difference": invariance,  # relative, rank 0 only
                "sample": result["normalized"]["sample"], "sample_error": sample_error}


if __name__ == "__main__":
    raise SystemExit(_common.main(run))
