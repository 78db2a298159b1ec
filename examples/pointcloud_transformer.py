"""Train a transformer over point clouds (tokens = points) with ring attention, points split over ranks.

    torchrun --standalone --nproc-per-node 4 examples/pointcloud_transformer.py              # (ddp 2, domain 2)
    torchrun --standalone --nproc-per-node 4 examples/pointcloud_transformer.py --domain-size 4 --points 4096
    python examples/pointcloud_transformer.py --steps 10                                      # one process
    torchrun --nproc-per-node 8 examples/pointcloud_transformer.py --device cuda --points 200000 --domain-size 8

The task: each sample is a cloud of points in the unit cube with a
temperature made of a few hot spots, measured at every point with noise
(``--noise``, standard deviation). The model sees each point's position and
measurement and predicts the true temperature. Copying the measurement leaves
the noise variance; going below it means averaging over nearby points, which
attention does (and, with the points split over ranks, ring attention).

1. Data: rank 0 generates the clouds (``datapipes.synthetic.point_cloud``) and
   prepares them once with ``datapipes.prepare_mesh``: points sorted along a
   Hilbert curve, so any contiguous range of points is a compact region.
2. Reading: ``MeshSource`` + ``DomainPipe``: each domain rank reads one
   contiguous range of points of each cloud (near-equal counts, uneven).
3. Model: a plain pre-norm transformer. ``F.scaled_dot_product_attention`` on
   ShardTensors sharded along the points runs ring attention: key/value
   blocks travel around the domain ranks; nothing in the model knows it.
4. Training, checkpoints, progress, log and plots as in every example
   (``examples/_common.py``): ``loss.png`` and ``prediction.png``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from datapipes import DomainPipe, MeshSource, prepare_mesh
from datapipes.synthetic import point_cloud
from physicsnemo_dp.distributed import MeshContext
from physicsnemo_dp.debug.viz import rank_boxes

import _common
import _flags



# --------------------------------------------------------------------------- #
# The model: nothing in it knows about ranks
# --------------------------------------------------------------------------- #
class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return self.merge(F.scaled_dot_product_attention(*self.split(x)))  # y: (batch, heads, tokens, width / heads)

    def split(self, x):
        """Queries, keys and values, split into heads: (batch, heads, tokens, width / heads) each."""
        batch, tokens, _ = x.shape
        return tuple(t.reshape(batch, tokens, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))

    def merge(self, y):
        batch, heads, tokens, per_head = y.shape
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, heads * per_head))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        # the attention kernel between two token-wise parts (what --compile compiles, see compile_regions)
        return self.after(x, F.scaled_dot_product_attention(*self.before(x)))

    def before(self, x):
        return self.attention.split(self.norm1(x))

    def after(self, x, y):
        x = x + self.attention.merge(y)
        return x + self.mlp(self.norm2(x))


class PointTransformer(nn.Module):
    """Per-point features in, per-point value out; blocks in an ``nn.ModuleList`` (the FSDP units)."""

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/examples/test_pointcloud_transformer.py
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, c_in: int = 4, width: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(c_in, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def compile_regions(self, backend: str = "inductor") -> None:
        """``--compile``: each block's token-wise parts before and after its attention, the embedding and the
        head; the attention kernel (ring attention on sharded points) runs eagerly between them.

        The regions are this file's methods, compiled per instance (Dynamo compiles ``torch.nn`` layers
        through one shared wrapper, whose recompilation limit a model's many layers would exhaust);
        ``dynamic=False``: a ShardTensor's layout holds plain ints, not symbolic sizes.
        """
        for owner, names in [(self, ("embed_points", "predict")), *((block, ("before", "after")) for block in self.blocks)]:
            for name in names:
                setattr(owner, name, torch.compile(getattr(owner, name), backend=backend, fullgraph=True, dynamic=False))

    def embed_points(self, x):
        return self.embed(x)

    def predict(self, x):
        return self.head(self.norm(x)).squeeze(-1)

    def forward(self, x):
        x = self.embed_points(x)
        for block in self.blocks:
            x = block(x)
        return self.predict(x)


def features(batch) -> torch.Tensor:
    """Per point: position (centred) and the noisy measurement."""
    return torch.cat([batch["points"] - 0.5, batch["measured"].unsqueeze(-1)], dim=-1)


def loss_fn(model, batch) -> torch.Tensor:
    """Mean squared error of the temperature at every point, over this ddp rank's clouds."""
    return (model(features(batch)) - batch["temperature"]).pow(2).mean()


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
def prepare_data(args: argparse.Namespace, out: Path) -> tuple[list[Path], list[Path]]:
    """Rank 0 generates and prepares (Hilbert-sorts) the clouds once; the others wait."""
    folder = out / "data" / f"clouds_{args.points}_noise{args.noise}_seed{args.seed}"
    names = {"train": args.samples, "test": args.test_samples}
    paths = {split: [folder / f"{split}_{i:04d}.h5" for i in range(n)] for split, n in names.items()}
    if dist.get_rank() == 0:
        todo = [(split, i, p) for split, ps in paths.items() for i, p in enumerate(ps) if not p.exists()]
        if todo:
            print(f"preparing {len(todo)} point clouds of {args.points} points in {folder}", flush=True)
        progress = _common.DataProgress(len(todo), "point clouds")
        for k, (split, i, path) in enumerate(todo, 1):
            seed = args.seed * 100_000 + i + (50_000 if split == "test" else 0)
            cloud = point_cloud(args.points, kind="volume", seed=seed)
            truth = cloud.fields["temperature"]
            noise = args.noise * np.random.default_rng(seed).standard_normal(truth.shape).astype(np.float32)
            fields = {"temperature": truth, "measured": truth + noise}
            prepare_mesh(path, cloud.points, fields)
            progress.done(k)
    dist.barrier()
    return paths["train"], paths["test"]


def make_pipes(args, context: MeshContext, train: list[Path], test: list[Path]):
    """Point ranges of each cloud over "domain", clouds over "ddp"."""
    per_rank = _common.check_batch(args, context)
    options = dict(prefetch=args.prefetch, device=context.device, drop_last=True)
    fields = ["temperature", "measured"]
    train_pipe = DomainPipe(MeshSource(train, fields, cells=False), context.mesh, batch_size=per_rank,
                            shuffle=True, seed=args.seed, **options)
    test_pipe = DomainPipe(MeshSource(test, fields, cells=False), context.mesh, batch_size=1, shuffle=False, **options)
    return train_pipe, test_pipe


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #
def parse_args(argv=None) -> argparse.Namespace:
    parser = _common.training_parser(__doc__, steps=60, batch_size=4, lr=3e-3, out="outputs/pointcloud_transformer")
    model = parser.add_argument_group("data and model")
    model.add_argument("--points", type=_flags.integer(1), default=512, help="points per cloud (tokens per sample)")
    model.add_argument("--noise", type=_flags.real(0), default=0.2, help="standard deviation of the measurement noise")
    model.add_argument("--samples", type=_flags.integer(1), default=32, help="training clouds")
    model.add_argument("--test-samples", type=_flags.integer(1), default=2, help="test clouds (the first is plotted)")
    model.add_argument("--width", type=_flags.integer(1), default=32, help="transformer width")
    model.add_argument("--heads", type=_flags.integer(1), default=4, help="attention heads")
    model.add_argument("--depth", type=_flags.integer(1), default=2, help="transformer blocks")
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"argument --heads: the --width {args.width} must be a multiple of --heads {args.heads}")
    return args


def build_training(args, context: MeshContext):
    """The transformer, parallelized, its AdamW optimizer and LR schedule: everything a checkpoint restores."""
    return _common.build_training(
        args, context, lambda: PointTransformer(width=args.width, heads=args.heads, depth=args.depth), torch.optim.AdamW
    )


@torch.no_grad()
def evaluate(model, pipe, context: MeshContext):
    """Test loss, and the first test cloud (points, truth, prediction, owning rank) gathered on every rank."""
    model.eval()
    total, shown = 0.0, None
    for batch in pipe:
        prediction = model(features(batch))
        total += _common.global_mean((prediction - batch["temperature"]).pow(2).mean(), context)
        if shown is None:
            boxes = rank_boxes(batch["points"])  # every rank's range, known without communication
            shown = {
                "points": batch["points"].full_tensor()[0].cpu(),
                "truth": batch["temperature"].full_tensor()[0].cpu(),
                "prediction": prediction.full_tensor()[0].cpu(),
                "measured": batch["measured"].full_tensor()[0].cpu(),
                "owner": torch.tensor([b["rank"] for b in boxes for _ in range(b["shape"][1])]),
            }
    model.train()
    return total / max(len(pipe), 1), shown


def run(argv=None, context: MeshContext | None = None) -> dict:
    """Train, test and plot; returns the run's result (see ``_common.close_run``)."""
    args = parse_args(argv)
    with _common.open_run(args, context, "pointcloud-transformer",
                          f"{args.points} points per cloud") as (context, out, log):
        train, test = prepare_data(args, out)
        train_pipe, test_pipe = make_pipes(args, context, train, test)
        model, optimizer, scheduler = build_training(args, context)
        losses = _common.fit(context, model, optimizer, scheduler, train_pipe, loss_fn, args, out, log)
        test_loss, cloud = evaluate(model, test_pipe, context)
        log.info(f"test loss ({len(test_pipe) * context.ddp_size} clouds): {test_loss:.6g} "
                 f"(copying the measurement: {args.noise ** 2:.3g})")
        return _common.close_run(
            context, args, out, log, title="point transformer", losses=losses, test_loss=test_loss,
            plot_prediction=lambda path: _common.plot_points(
                path, cloud["points"],
                {"measured (noisy input)": cloud["measured"], "truth: temperature": cloud["truth"],
                 "prediction": cloud["prediction"], "|error|": (cloud["prediction"] - cloud["truth"]).abs()},
                owner=cloud["owner"], same_scale=("measured (noisy input)", "truth: temperature", "prediction"),
                title="test cloud 0, points with 0.35 < z < 0.65 (last panel: the rank that held each point)",
            ),
            pipes=(train_pipe, test_pipe), model=model, optimizer=optimizer,
        )


if __name__ == "__main__":
    raise SystemExit(_common.main(run))
