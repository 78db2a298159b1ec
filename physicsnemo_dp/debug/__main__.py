"""Command line of the debug tools: ``python -m physicsnemo_dp.debug simulate ...``.

    python -m physicsnemo_dp.debug simulate examples.unet_darcy:UNet --input-shape 1 1 4096 4096 \\
        --shard-dims 2 --world-sizes 2 8 64 512 4096 --plot unet.png
    python -m physicsnemo_dp.debug simulate my_models:setup --setup --world-sizes 16 1024 --ops 20

``TARGET`` is ``module:attribute``. By default the attribute builds the model
(a class or function called with no arguments, under ``torch.device("meta")``)
and the step is ``model(x)`` on a global input of ``--input-shape`` sharded
along ``--shard-dims`` (one per mesh dim), then a mean-square loss and its
backward. With ``--setup`` the attribute is a ``setup(mesh) -> step`` function
(see :func:`physicsnemo_dp.debug.simulate`). The module's folder goes on
``sys.path``, so example scripts that import their siblings load.

Prints one row per world size (the rank played, its peak live bytes, bytes
sent per collective kind, planning time) and optionally writes a plot of
bytes and memory per rank against the world size.
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

from ._explain import format_bytes
from ._simulate import Simulation, sharded_input, simulate

__all__ = ["main", "load", "model_step", "sweep", "plot"]


def load(target: str):
    """The object named by ``module:attribute``, with the module's folder put on ``sys.path`` first."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"TARGET must be module:attribute (e.g. examples.unet_darcy:UNet), got {target!r}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    spec = importlib.util.find_spec(module_name)
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
               dtype: torch.dtype = torch.float32) -> Callable:  # fmt: skip
    """A ``setup(mesh)`` for :func:`simulate`: ``build()``'s model on a sharded input, mean-square loss, backward.

    ``shard_dims[m]`` is the tensor dim mesh dim ``m`` shards (``None``: replicated).
    """

    def setup(mesh):
        model = build()
        placements = [Replicate() if d is None else Shard(d) for d in shard_dims]
        x = sharded_input(mesh, input_shape, placements, dtype)

        def step():
            out = model(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().pow(2).mean().backward()

        return step

    return setup


def sweep(setup, world_sizes: Sequence[int], rank="largest", mesh_dims: int = 1, echo: bool = True) -> list[Simulation]:
    """:func:`simulate` at each world size (1-D meshes, or ``(2, P/2)`` ``("ddp", "domain")`` ones with ``mesh_dims=2``)."""
    out = []
    for p in world_sizes:
        if mesh_dims == 2:
            sim = simulate(setup, mesh_shape=(2, p // 2), mesh_dim_names=("ddp", "domain"), rank=rank)
        else:
            sim = simulate(setup, p, rank=rank)
        if echo:
            print(_row(sim), flush=True)
        out.append(sim)
    return out


def _row(sim: Simulation) -> str:
    kinds = ", ".join(f"{k} {format_bytes(v['sent'])}" for k, v in sim.collectives.items()) or "nothing"
    return (f"P={sim.world_size:<6} rank {sim.rank:<6} peak {format_bytes(sim.peak_bytes):>10}  "
            f"sent {format_bytes(sim.bytes_sent):>10} ({kinds})  step {sim.seconds:.2f} s")  # fmt: skip


def plot(sims: Sequence[Simulation], title: str, path: str | Path) -> None:
    """Two panels against P (log scales): bytes sent per rank per collective kind, and peak live bytes per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [s.world_size for s in sims]
    fig, (comm, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    kinds = sorted({k for s in sims for k in s.collectives})
    for kind in kinds:
        comm.plot(ps, [max(s.collectives.get(kind, {}).get("sent", 0), 1) for s in sims], "o-", label=kind)
    comm.plot(ps, [max(s.bytes_sent, 1) for s in sims], "k--", label="total")
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
    sim = commands.add_parser("simulate", help="bytes and memory per rank of one step at any world size")
    sim.add_argument("target", help="module:attribute, a model factory (or a setup(mesh) with --setup)")
    sim.add_argument("--setup", action="store_true", help="TARGET is setup(mesh) -> step")
    sim.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 16, 64, 256, 1024])
    sim.add_argument("--input-shape", type=int, nargs="+", help="global input shape (model factories)")
    sim.add_argument("--shard-dims", type=int, nargs="+", default=[2], help="tensor dim sharded by each mesh dim")
    sim.add_argument("--mesh-dims", type=int, choices=(1, 2), default=1,
                     help="2: a (2, P/2) ('ddp', 'domain') mesh; give two --shard-dims")  # fmt: skip
    sim.add_argument("--rank", default="largest", help="rank to play: an int or 'largest' (default)")
    sim.add_argument("--dtype", default="float32", help="input dtype (a torch dtype name)")
    sim.add_argument("--ops", type=int, default=0, help="also print the first N rows of the per-op table at the largest P")
    sim.add_argument("--plot", help="write a PNG of bytes and memory per rank vs P here")
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
        setup = model_step(target, args.input_shape, args.shard_dims, dtype)
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
