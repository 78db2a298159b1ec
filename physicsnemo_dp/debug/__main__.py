"""Command line of the debug tools: python -m physicsnemo_dp.debug simulate ...

    python -m physicsnemo_dp.debug simulate examples.unet_darcy:UNet --input-shape 1 1 4096 4096 \\
        --shard-dims 2 --world-sizes 2 8 64 512 4096 --plot unet.png
    python -m physicsnemo_dp.debug simulate my_models:setup --setup --world-sizes 16 1024 --ops 20

TARGET is module:attribute, a module name as for "import" (examples.unet_darcy,
not a file path such as examples/unet_darcy.py), then a colon, then a name in
it. By default the attribute builds the model (a class or function called with
no arguments, under torch.device("meta")) and the step is model(x) on a global
input of --input-shape sharded along --shard-dims (one per mesh dim), then a
mean-square loss and its backward. The model's gradients are reduced in
buckets of 25 MiB, as under parallelize_model (MeshContext's default
gradient_bucket_mb=25): the same bytes as a bare module, fewer all-reduces;
--per-layer counts one all-reduce per layer call, as a bare module without
bucket_gradients does. With --setup the attribute is a setup(mesh) -> step
function (see physicsnemo_dp.debug.simulate) and the step is counted as it is
written. The module's folder goes on sys.path, so example scripts that import
their siblings load.

Prints one row per world size (the rank played, its peak live bytes, bytes
sent per collective kind with the number of calls, the step's planning time)
and optionally writes a plot of bytes and memory per rank against the world
size. A warm-up step at the first world size runs first and is not shown, so
the first row's time is not inflated by imports and first-call caches.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..promotion import bucket_gradients
from ._explain import format_bytes
from ._simulate import Simulation, sharded_input, simulate

__all__ = ["main", "load", "model_step", "sweep", "plot"]


def load(target: str):
    """The object named by ``module:attribute``, with the module's folder put on ``sys.path`` first."""
    module_name, _, attribute = target.partition(":")
    form = "module:attribute, a module name as for import, e.g. examples.unet_darcy:UNet"
    if any(c in module_name for c in "/\\") or module_name.endswith(".py"):
        dotted = module_name.removesuffix(".py").replace("\\", "/").strip("/").replace("/", ".")
        raise SystemExit(f"TARGET must be {form}, not a file path: got {target!r} "
                         f"(from its folder's parent, try {dotted}:{attribute or 'NAME'})")  # fmt: skip
    if not module_name or not attribute or not all(part.isidentifier() for part in module_name.split(".")):
        raise SystemExit(f"TARGET must be {form}; got {target!r}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        spec = importlib.util.find_spec(module_name)
    except ImportError:  # a parent package is missing
        spec = None
    if spec is None:
        raise SystemExit(f"no module named {module_name!r} (run from the folder that contains it)")
    if spec.origin:
        folder = str(Path(spec.origin).parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise SystemExit(f"module {module_name!r} has no attribute {attribute!r}") from None


def model_step(build: Callable[[], torch.nn.Module], input_shape: Sequence[int], shard_dims: Sequence[int | None],
               dtype: torch.dtype = torch.float32, bucket_mb: float | None = 25.0) -> Callable:  # fmt: skip
    """A ``setup(mesh)`` for :func:`simulate`: ``build()``'s model on a sharded input, mean-square loss, backward.

    ``shard_dims[m]`` is the tensor dim mesh dim ``m`` shards (``None``: replicated).
    ``bucket_mb``: the model's gradients are reduced in buckets of this many
    MiB (:func:`~physicsnemo_dp.bucket_gradients`), as ``parallelize_model``
    does by default; ``None``: one all-reduce per layer call, as a bare module.
    """

    def setup(mesh):
        model = build()
        if bucket_mb is not None and isinstance(model, torch.nn.Module):
            bucket_gradients(model, bucket_mb)
        placements = [Replicate() if d is None else Shard(d) for d in shard_dims]
        x = sharded_input(mesh, input_shape, placements, dtype)

        def step():
            out = model(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().pow(2).mean().backward()

        return step

    return setup


def sweep(setup, world_sizes: Sequence[int], rank="largest", mesh_dims: int = 1, echo: bool = True,
          warm_up: bool = True) -> list[Simulation]:  # fmt: skip
    """:func:`simulate` at each world size (1-D meshes, or ``(2, P/2)`` ``("ddp", "domain")`` ones with ``mesh_dims=2``).

    With ``warm_up`` a first simulation at the first world size runs and is
    dropped, so that size's step time excludes imports and first-call caches.
    """

    def one(p):
        if mesh_dims == 2:
            return simulate(setup, mesh_shape=(2, p // 2), mesh_dim_names=("ddp", "domain"), rank=rank)
        return simulate(setup, p, rank=rank)

    if warm_up and world_sizes:
        one(world_sizes[0])
    out = []
    for p in world_sizes:
        sim = one(p)
        if echo:
            print(_row(sim), flush=True)
        out.append(sim)
    return out


def _row(sim: Simulation) -> str:
    kinds = ", ".join(f"{k} {format_bytes(v['sent'])} in {v['calls']}" for k, v in sim.collectives.items()) or "nothing"
    return (f"P={sim.world_size:<6} rank {sim.rank:<6} peak {format_bytes(sim.peak_bytes):>10}  "
            f"sent {format_bytes(sim.bytes_sent):>10} ({kinds})  step {sim.seconds:.2f} s")  # fmt: skip


def plot(sims: Sequence[Simulation], title: str, path: str | Path) -> None:
    """Two panels against P (log scales): bytes sent per rank per collective kind, and peak live bytes per rank.

    A log axis has no zero: world sizes where a kind sends nothing are left
    out of its line (not drawn at 1 B), and its legend entry says so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [s.world_size for s in sims]
    fig, (comm, mem) = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    kinds = sorted({k for s in sims for k in s.collectives})

    def line(values, style, label, **kw):
        shown = [(p, v) for p, v in zip(ps, values) if v > 0]
        if len(shown) < len(values):
            label += f" (0 B at P = {', '.join(str(p) for p, v in zip(ps, values) if v <= 0)}: not drawn)"
        if shown:
            comm.plot(*zip(*shown), style, label=label, **kw)
        else:
            comm.plot([], [], style, label=label, **kw)

    for kind in kinds:
        line([s.collectives.get(kind, {}).get("sent", 0) for s in sims], "o-", kind)
    line([s.bytes_sent for s in sims], "k--", "total")
    mem.plot(ps, [s.peak_bytes for s in sims], "o-", color="tab:red")
    for ax, label in ((comm, "bytes sent per rank per step"), (mem, "peak live bytes per rank")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    comm.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m physicsnemo_dp.debug", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="bytes and memory per rank of one step at any world size",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sim.add_argument("target", help="module:attribute (e.g. examples.unet_darcy:UNet, not a file path): a model "
                     "factory, or a setup(mesh) with --setup")  # fmt: skip
    sim.add_argument("--setup", action="store_true", help="TARGET is setup(mesh) -> step")
    sim.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 16, 64, 256, 1024])
    sim.add_argument("--input-shape", type=int, nargs="+", help="global input shape (model factories)")
    sim.add_argument("--shard-dims", type=int, nargs="+", default=[2], help="tensor dim sharded by each mesh dim")
    sim.add_argument("--mesh-dims", type=int, choices=(1, 2), default=1,
                     help="2: a (2, P/2) ('ddp', 'domain') mesh; give two --shard-dims")  # fmt: skip
    sim.add_argument("--rank", default="largest", help="rank to play: an int or 'largest' (default)")
    sim.add_argument("--dtype", default="float32", help="input dtype (a torch dtype name)")
    sim.add_argument(
        "--ops", type=int, default=0, help="also print the first N rows of the per-op table at the largest P"
    )
    sim.add_argument(
        "--plot", help="write a PNG of bytes and memory per rank vs P here (log axes: zero bytes not drawn)"
    )
    sim.add_argument("--per-layer", action="store_true",
                     help="model factories: one all-reduce per layer call (a bare module) instead of 25 MiB "
                     "gradient buckets (parallelize_model's default); the bytes are the same")  # fmt: skip
    args = parser.parse_args(argv)

    target = load(args.target)
    if args.setup:
        setup = target
    else:
        if not args.input_shape:
            parser.error("--input-shape is needed unless --setup is given")
        if len(args.shard_dims) != args.mesh_dims:
            parser.error(f"--shard-dims needs one tensor dim per mesh dim ({args.mesh_dims})")
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            parser.error(f"--dtype {args.dtype!r} is not a torch dtype")
        setup = model_step(target, args.input_shape, args.shard_dims, dtype, None if args.per_layer else 25.0)
    if args.rank != "largest" and not args.rank.lstrip("-").isdigit():
        parser.error(f"--rank must be an int or 'largest', got {args.rank!r}")
    rank = args.rank if args.rank == "largest" else int(args.rank)
    sims = sweep(setup, args.world_sizes, rank=rank, mesh_dims=args.mesh_dims)
    if args.ops:
        print(sims[-1].explanation.table(max_rows=args.ops))
    if args.plot:
        plot(sims, f"{args.target} (input {args.input_shape or 'from setup'})", args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
