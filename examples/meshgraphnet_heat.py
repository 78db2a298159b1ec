"""Train a MeshGraphNet on steady heat in plates with a hole, each mesh's points split over ranks.

    torchrun --standalone --nproc-per-node 4 examples/meshgraphnet_heat.py                   # (ddp 2, domain 2)
    torchrun --standalone --nproc-per-node 4 examples/meshgraphnet_heat.py --domain-size 4 --around 128 --rings 32
    python examples/meshgraphnet_heat.py --steps 20                                          # one process
    torchrun --nproc-per-node 8 examples/meshgraphnet_heat.py --device cuda --around 1024 --rings 256 --domain-size 8

The task: each sample is a square plate with a circular hole (centre, radius,
hole temperature and heat sources drawn per sample), triangulated; the target
is the steady temperature (``-lap(u) = f``, ``u = 0`` outside, ``u = T`` on the
hole), solved with finite elements when the data is generated
(``datapipes.synthetic.plate_with_hole``). The model sees, per node, its
position, two boundary flags, the source and the prescribed boundary value,
and predicts the temperature everywhere.

1. Data: rank 0 generates the meshes, writes them as unprepared inputs
   (``write_mesh_input``) and prepares them (``prepare_mesh``): points sorted
   along a Hilbert curve, cells renumbered and grouped by owner.
2. Reading: ``MeshSource`` + ``DomainPipe``: each domain rank reads one
   contiguous range of points and the cells those points own.
3. Graph: ``datapipes.mesh_graph.MeshGraphCache`` turns each rank's cells
   into the mesh's edges (each once), builds the sharded graph
   (``physicsnemo_dp.graph.build_graph``) and the edge features, once per
   sample and partition.
4. Model: ``graph_models.MeshGraphNet``, plain torch: ``h[src]`` gathers the
   ghost nodes' rows from the ranks that own them, ``torch.index_add`` sums
   messages at their destinations locally.
5. Training, checkpoints, progress, log as in every example; plots:
   ``partition.png`` (the rank owning each cell, and the ghost nodes of one
   rank), ``prediction.png`` (truth, prediction, error on the mesh) and
   ``loss.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from datapipes import DomainPipe, MeshSource, prepare_mesh
from datapipes.mesh import load_mesh_input
from datapipes.mesh_graph import MeshGraphCache
from datapipes.synthetic import plate_with_hole, write_mesh_input
from physicsnemo_dp.distributed import MeshContext

import _common
import _flags
from graph_models import MeshGraphNet

FIELDS = ["temperature", "source", "dirichlet", "boundary"]


# --------------------------------------------------------------------------- #
# Features and loss
# --------------------------------------------------------------------------- #
def features(batch) -> torch.Tensor:
    """Per node of the batch's mesh: position, boundary flags (outer, hole), source / 10, boundary value."""
    return torch.cat([batch["points"][0], batch["boundary"][0], batch["source"][0].unsqueeze(-1) / 10,
                      batch["dirichlet"][0].unsqueeze(-1)], dim=-1)


def predict(model, batch, graphs: MeshGraphCache) -> torch.Tensor:
    """The model's temperature on every node of the batch's mesh (node-sharded like the points)."""
    mesh_graph = graphs(batch)
    g = mesh_graph.graph
    return model(features(batch), mesh_graph.edge_features, g.src, g.dst).squeeze(-1)


def make_loss(graphs: MeshGraphCache):
    """Mean squared error of the temperature over the nodes of this ddp rank's mesh."""

    def loss_fn(model, batch) -> torch.Tensor:
        return (predict(model, batch, graphs) - batch["temperature"][0]).pow(2).mean()

    return loss_fn


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
def prepare_data(args: argparse.Namespace, out: Path) -> tuple[list[Path], list[Path]]:
    """Rank 0 generates, writes and prepares (Hilbert-sorts) the meshes once; the others wait."""
    folder = out / "data" / f"plates_{args.around}x{args.rings}_seed{args.seed}"
    names = {"train": args.samples, "test": args.test_samples}
    paths = {split: [folder / f"{split}_{i:04d}.h5" for i in range(n)] for split, n in names.items()}
    if dist.get_rank() == 0:
        for split, targets in paths.items():
            if all(p.exists() for p in targets):
                continue
            print(f"generating {len(targets)} {split} plates of {args.around * (args.rings + 1)} nodes in {folder}",
                  flush=True)
            seed = args.seed * 100_000 + (50_000 if split == "test" else 0)
            progress = _common.DataProgress(len(targets), f"{split} plates")
            meshes = plate_with_hole(len(targets), args.around, args.rings, seed=seed)
            for k, (path, mesh) in enumerate(zip(targets, meshes), 1):
                raw = write_mesh_input(path.with_suffix(".npz"), mesh)  # what a mesher's export would be
                points, fields, cells = load_mesh_input(raw)
                prepare_mesh(path, points, fields, cells)
                raw.unlink()
                progress.done(k)
    dist.barrier()
    return paths["train"], paths["test"]


def make_pipes(args, context: MeshContext, train: list[Path], test: list[Path]):
    """Point ranges (and the cells they own) of each mesh over "domain", one mesh per ddp rank and step.

    Meshes of different geometry sort differently along the curve, so their
    cells split differently over the ranks: a batch holds one mesh.
    """
    if _common.check_batch(args, context) != 1:
        raise SystemExit(f"--batch-size {args.batch_size}: each ddp rank takes one mesh per step (their cells split "
                         f"differently over the domain ranks); pass --batch-size {context.ddp_size} (the ddp size)")
    options = dict(prefetch=args.prefetch, device=context.device, drop_last=True)
    train_source, test_source = MeshSource(train, FIELDS), MeshSource(test, FIELDS)
    train_pipe = DomainPipe(train_source, context.mesh, batch_size=1, shuffle=True, seed=args.seed, **options)
    test_pipe = DomainPipe(test_source, context.mesh, batch_size=1, shuffle=False, **options)
    return (train_pipe, MeshGraphCache(train_source)), (test_pipe, MeshGraphCache(test_source))


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #
def parse_args(argv=None) -> argparse.Namespace:
    parser = _common.training_parser(__doc__, steps=200, batch_size=1, lr=3e-3, out="outputs/meshgraphnet_heat")
    parser.set_defaults(batch_size=None)  # one mesh per ddp rank: the ddp size (see make_pipes)
    model = parser.add_argument_group("data and model")
    model.add_argument("--around", type=_flags.integer(3), default=40, help="mesh nodes around the hole (per ring)")
    model.add_argument("--rings", type=_flags.integer(1), default=8, help="rings of cells between the hole and the outer square")
    model.add_argument("--samples", type=_flags.integer(1), default=16, help="training meshes")
    model.add_argument("--test-samples", type=_flags.integer(1), default=2, help="test meshes (the first is plotted)")
    model.add_argument("--width", type=_flags.integer(1), default=32, help="latent width of nodes and edges")
    model.add_argument("--layers", type=_flags.integer(1), default=10, help="message-passing (processor) layers")
    return parser.parse_args(argv)


def build_training(args, context: MeshContext):
    """The MeshGraphNet, parallelized, its AdamW optimizer and LR schedule: everything a checkpoint restores."""
    return _common.build_training(
        args, context, lambda: MeshGraphNet(6, 3, 1, width=args.width, layers=args.layers), torch.optim.AdamW
    )


def _domain_gather(value, context: MeshContext) -> list:
    """``value`` of every domain rank of this ddp group, in domain order (pickled; for the plots only)."""
    gathered: list = [None] * context.domain_size
    dist.all_gather_object(gathered, value, group=context.domain_mesh.get_group())
    return gathered


@torch.no_grad()
def evaluate(model, pipe, graphs: MeshGraphCache, context: MeshContext):
    """Test loss, and the first test mesh (points, cells, truth, prediction, owners, ghosts) on every rank."""
    model.eval()
    total, shown = 0.0, None
    for batch in pipe:
        prediction = predict(model, batch, graphs)
        total += _common.global_mean((prediction - batch["temperature"][0]).pow(2).mean(), context)
        if shown is None:
            g = graphs(batch).graph
            sizes = g.node_sizes
            shown = {
                "points": batch["points"].full_tensor()[0].cpu().numpy(),
                "cells": batch["cells"].full_tensor()[0].cpu().numpy(),
                "truth": batch["temperature"].full_tensor()[0].cpu().numpy(),
                "prediction": prediction.full_tensor().cpu().numpy(),
                "owner": np.repeat(np.arange(len(sizes)), sizes),
                "ghosts": _domain_gather(g.ghost_ids.cpu().numpy(), context),
                "ghost_counts": _domain_gather(int(g.num_ghosts), context),
            }
    model.train()
    return total / max(len(pipe), 1), shown


def plot_partition(path: Path, mesh: dict, rank: int) -> Path:
    """Left: the rank owning each cell (its smallest node's rank). Right: rank ``rank``'s nodes and ghost nodes."""
    plt = _common._pyplot()
    x, y = mesh["points"][:, 0], mesh["points"][:, 1]
    cell_owner = mesh["owner"][mesh["cells"].min(axis=1)]
    parts = int(mesh["owner"].max()) + 1
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    image = axes[0].tripcolor(x, y, mesh["cells"], facecolors=cell_owner, cmap=plt.get_cmap("tab20", max(parts, 2)),
                              vmin=-0.5, vmax=max(parts, 2) - 0.5, edgecolors="w", linewidth=0.2)
    axes[0].set_title(f"owning rank of each cell ({parts} domain ranks, Hilbert ranges)", fontsize=9)
    fig.colorbar(image, ax=axes[0], fraction=0.046, pad=0.04, ticks=range(parts))
    axes[1].triplot(x, y, mesh["cells"], color="0.8", linewidth=0.3)
    own = mesh["owner"] == rank
    ghosts = mesh["ghosts"][rank]
    axes[1].plot(x[own], y[own], ".", color="C0", markersize=3, label=f"rank {rank}'s nodes ({own.sum()})")
    axes[1].plot(x[ghosts], y[ghosts], "o", color="C3", markersize=4,
                 label=f"its ghost nodes ({len(ghosts)}: sources of its edges on other ranks)")
    axes[1].legend(fontsize=7, loc="upper right")
    axes[1].set_title(f"rank {rank}: local nodes and the ghost nodes it receives per layer", fontsize=9)
    for ax in axes:
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    return _common.save_figure(fig, path)


def plot_prediction(path: Path, mesh: dict, title: str) -> Path:
    """Truth, prediction (one colour scale) and absolute error on the mesh (tripcolor, Gouraud shading)."""
    plt = _common._pyplot()
    x, y = mesh["points"][:, 0], mesh["points"][:, 1]
    panels = {"truth: temperature": mesh["truth"], "prediction": mesh["prediction"],
              "|error|": np.abs(mesh["prediction"] - mesh["truth"])}
    vmin, vmax = float(mesh["truth"].min()), float(mesh["truth"].max())
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (name, values) in zip(axes, panels.items()):
        scale = {} if name == "|error|" else {"vmin": vmin, "vmax": vmax}
        image = ax.tripcolor(x, y, mesh["cells"], values, shading="gouraud", cmap="viridis", **scale)
        ax.set_aspect("equal")
        _common.field_panel(fig, ax, image, name)
    return _common.save_figure(fig, path, title)


def run(argv=None, context: MeshContext | None = None) -> dict:
    """Train, test and plot; returns the run's result (see ``_common.close_run``), plus the partition plot."""
    args = parse_args(argv)
    nodes = args.around * (args.rings + 1)
    context = context or _common.build_context(args)
    if args.batch_size is None:
        args.batch_size = context.ddp_size
    with _common.open_run(args, context, "meshgraphnet-heat", f"{nodes} nodes per mesh") as (context, out, log):
        train, test = prepare_data(args, out)
        (train_pipe, train_graphs), (test_pipe, test_graphs) = make_pipes(args, context, train, test)
        model, optimizer, scheduler = build_training(args, context)
        losses = _common.fit(context, model, optimizer, scheduler, train_pipe, make_loss(train_graphs), args, out, log)
        test_loss, mesh = evaluate(model, test_pipe, test_graphs, context)
        log.info(f"test loss ({len(test_pipe) * context.ddp_size} meshes): {test_loss:.6g}; graphs built: "
                 f"{train_graphs.builds} for {len(train)} training meshes; ghost nodes per domain rank of the first "
                 f"test mesh: {mesh['ghost_counts']} of {nodes} nodes")
        partition = None
        if dist.get_rank() == 0:
            partition = plot_partition(out / "partition.png", mesh, min(1, context.domain_size - 1))
            log.info(f"partition plot: {partition}")
        result = _common.close_run(
            context, args, out, log, title="MeshGraphNet", losses=losses, test_loss=test_loss,
            plot_prediction=lambda path: plot_prediction(
                path, mesh, f"test plate 0, {nodes} nodes, {args.layers} message-passing layers"),
            pipes=(train_pipe, test_pipe), model=model, optimizer=optimizer,
        )
        if partition is not None:
            result["files"]["partition"] = partition
        result["graphs_built"] = train_graphs.builds
        result["ghost_counts"] = mesh["ghost_counts"]
        return result


if __name__ == "__main__":
    raise SystemExit(_common.main(run))
