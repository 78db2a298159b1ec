"""Train a 2-D U-Net on Darcy flow with every sample split over ranks: the whole workflow in one script.

    torchrun --standalone --nproc-per-node 4 examples/unet_darcy.py                  # (ddp 2, domain 2) mesh, DDP
    torchrun --standalone --nproc-per-node 4 examples/unet_darcy.py --strategy fsdp2 --domain-size 4
    torchrun --standalone --nproc-per-node 4 examples/unet_darcy.py --resume         # continue the last run
    python examples/unet_darcy.py --steps 20                                          # one process, same code
    torchrun --nproc-per-node 8 examples/unet_darcy.py --device cuda --grid 1024 --domain-size 4

1. Data: rank 0 writes a synthetic Darcy dataset (permeability -> pressure,
   ``datapipes.synthetic.darcy_flow``) to HDF5 once; later runs reuse it.
2. Reading: ``DomainPipe`` gives each rank only its rows of each sample, as
   ShardTensors, normalized by statistics computed over all ranks.
3. Model: an unmodified U-Net. Its convolutions, pooling, interpolation and
   group norms see ShardTensors and exchange halos / reduce statistics
   themselves; its weights are plain tensors, wrapped by DDP or FSDP2 on the
   ddp axis (``parallelize_model``).
4. Training (``examples/_common.py``): progress bar on rank 0, ``train.log``,
   checkpoints with the datapipe's position (``--resume``, also on another
   layout with the same ``--batch-size``), then ``loss.png`` and
   ``prediction.png`` (one test sample gathered with ``full_tensor``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from datapipes import DomainPipe, HDF5Fields, Normalize, compute_statistics
from datapipes.synthetic import darcy_flow, write_hdf5
from physicsnemo_dp.distributed import MeshContext
from physicsnemo_dp.debug.viz import rank_boxes

import _common
import _flags

INPUT, TARGET = "permeability", "pressure"


# --------------------------------------------------------------------------- #
# The model: nothing in it knows about ranks
# --------------------------------------------------------------------------- #
def _block(c_in: int, c_out: int) -> nn.Sequential:
    # GroupNorm, not BatchNorm: per-sample statistics, so ddp ranks need not share them
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.GELU(),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.GELU(),
    )  # fmt: skip


class UNet(nn.Module):
    """U-Net: conv blocks, max-pool down, bilinear up to the skip's size (any grid size), skips concatenated."""

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/examples/test_unet_darcy.py
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, c_in: int = 1, c_out: int = 1, width: int = 16, depth: int = 2):
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_block(c_in, widths[0])] + [_block(widths[i], widths[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList(_block(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, c_out, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for block in self.up:
            skip = skips.pop()
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


def loss_fn(model, batch) -> torch.Tensor:
    """Mean squared error of the normalized pressure, over this ddp rank's samples."""
    return (model(batch[INPUT].unsqueeze(1)) - batch[TARGET].unsqueeze(1)).pow(2).mean()


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
def prepare_data(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """Rank 0 writes the train and test sets once (named by their parameters); the others wait."""
    folder = out / "data"
    sets = {
        folder / f"darcy_{args.grid}_train_n{args.samples}_seed{args.seed}.h5": (args.samples, args.seed),
        folder / f"darcy_{args.grid}_test_n{args.test_samples}_seed{args.seed + 1}.h5": (args.test_samples, args.seed + 1),
    }
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for path, (n, seed) in sets.items():
            if not path.exists():
                # One batched solve of all n samples (the draws depend on n), so no per-sample progress:
                # a line when it starts and one with its time when it ends.
                print(f"writing {n} Darcy samples on a {args.grid}x{args.grid} grid to {path} "
                      "(one batched solve)", flush=True)  # fmt: skip
                progress = _common.DataProgress(n, "Darcy samples")
                write_hdf5(path, darcy_flow(n, args.grid, seed=seed, tol=1e-5))
                progress.finish()
    dist.barrier()
    return tuple(sets)


def make_pipes(args, context: MeshContext, train: Path, test: Path):
    """Train and test pipes: rows of each sample over "domain", samples over "ddp", normalized."""
    per_rank = _common.check_batch(args, context)
    source = HDF5Fields(train, [INPUT, TARGET])
    normalize = Normalize(compute_statistics(source, context.mesh))
    options = dict(split_dims=(0,), transforms=[normalize], prefetch=args.prefetch, device=context.device, drop_last=True)
    train_pipe = DomainPipe(source, context.mesh, batch_size=per_rank, shuffle=True, seed=args.seed, **options)
    test_pipe = DomainPipe(HDF5Fields(test, [INPUT, TARGET]), context.mesh, batch_size=1, shuffle=False, **options)
    return train_pipe, test_pipe, normalize


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #
def add_data_arguments(parser: argparse.ArgumentParser):
    """The Darcy data flags (``prepare_data`` reads them); returns their group for the model's flags."""
    group = parser.add_argument_group("data and model")
    group.add_argument("--grid", type=_flags.integer(3), default=64, help="grid points per side of each sample")
    group.add_argument("--samples", type=_flags.integer(1), default=96, help="training samples")
    group.add_argument("--test-samples", type=_flags.integer(1), default=4, help="test samples (one is plotted)")
    return group


def parse_args(argv=None) -> argparse.Namespace:
    parser = _common.training_parser(__doc__, steps=60, batch_size=8, lr=3e-3, out="outputs/unet_darcy")
    model = add_data_arguments(parser)
    add_unet_arguments(model)
    return check_unet_arguments(parser, parser.parse_args(argv))


def add_unet_arguments(group) -> None:
    """The U-Net's flags (also the diffusion example's denoiser)."""
    group.add_argument("--width", type=_flags.integer(4), default=16,
                       help="channels of the first U-Net level (a multiple of 4: group norms of 4 groups)")
    group.add_argument("--depth", type=_flags.integer(0, 8), default=2, help="pooling levels of the U-Net")


def check_unet_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Flags that must fit each other: refused while parsing (every rank alike)."""
    if args.width % 4:
        parser.error(f"argument --width: must be a multiple of 4 (the U-Net's group norms have 4 groups), "
                     f"got {args.width}")
    if args.grid < 2**args.depth:
        parser.error(f"argument --grid: {args.grid} points per side cannot be pooled {args.depth} times "
                     f"(--depth); pass --grid >= {2**args.depth} or a smaller --depth")
    return args


def build_training(args, context: MeshContext):
    """The U-Net, parallelized, its Adam optimizer and LR schedule: everything a checkpoint restores."""
    return _common.build_training(args, context, lambda: UNet(width=args.width, depth=args.depth), torch.optim.Adam)


@torch.no_grad()
def evaluate(model, pipe, normalize, context: MeshContext):
    """Test loss over the test set, and the fields of the test sample to plot, gathered on every rank.

    The plotted sample is the one (of this ddp rank's) whose permeability
    varies most: a uniform one makes a dull picture.
    """
    model.eval()
    total, shown = 0.0, None
    for batch in pipe:
        prediction = model(batch[INPUT].unsqueeze(1)).squeeze(1)
        total += _common.global_mean((prediction - batch[TARGET]).pow(2).mean(), context)
        permeability = batch[INPUT].full_tensor()[0].cpu()  # gathered over the domain ranks
        if shown is None or permeability.std() > shown["spread"]:
            shown = {
                "spread": permeability.std(),
                INPUT: normalize.inverse(INPUT, permeability),
                "truth": normalize.inverse(TARGET, batch[TARGET].full_tensor()[0].cpu()),
                "prediction": normalize.inverse(TARGET, prediction.full_tensor()[0].cpu()),
                "sample": batch.samples[0],
                "rows": [box["start"][1] for box in rank_boxes(prediction)][1:],
            }
    model.train()
    return total / max(len(pipe), 1), shown


def plot_sample(path: Path, sample: dict) -> Path:
    """``prediction.png``: permeability, true and predicted pressure, error of the sample ``evaluate`` chose."""
    return _common.plot_fields(
        path,
        {INPUT: sample[INPUT], "truth: pressure": sample["truth"], "prediction": sample["prediction"],
         "|error|": (sample["prediction"] - sample["truth"]).abs()},
        f"test sample {sample['sample']}" + (" (dashed: where the domain ranks' rows meet)" if sample["rows"] else ""),
        row_splits=sample["rows"], same_scale=("truth: pressure", "prediction"),
    )


def run(argv=None, context: MeshContext | None = None) -> dict:
    """Train, test and plot; returns the run's result (see ``_common.close_run``)."""
    args = parse_args(argv)
    with _common.open_run(args, context, "unet-darcy", f"grid {args.grid}x{args.grid}") as (context, out, log):
        train, test = prepare_data(args, out)
        train_pipe, test_pipe, normalize = make_pipes(args, context, train, test)
        model, optimizer, scheduler = build_training(args, context)
        losses = _common.fit(context, model, optimizer, scheduler, train_pipe, loss_fn, args, out, log)
        test_loss, sample = evaluate(model, test_pipe, normalize, context)
        log.info(f"test loss (normalized pressure, {len(test_pipe) * context.ddp_size} samples): {test_loss:.6g}")
        return _common.close_run(
            context, args, out, log, title="U-Net on Darcy flow", losses=losses, test_loss=test_loss,
            plot_prediction=lambda path: plot_sample(path, sample),
            pipes=(train_pipe, test_pipe), model=model, optimizer=optimizer,
        )


if __name__ == "__main__":
    raise SystemExit(_common.main(run))
