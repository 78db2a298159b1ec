"""Command line: sort meshes along a space-filling curve for domain-parallel reading.

    prepare-mesh car.vtu -o prepared/car.h5                  # or: python -m datapipes.prepare_cli ...
    prepare-mesh raw/*.npz -o prepared/ --curve morton
    prepare-mesh big.pvtu -o big.h5 --max-memory 4GB          # out of core, one process
    torchrun --nproc-per-node 4 -m datapipes.prepare_cli big.pvtu -o big.h5 --distributed   # on 4 ranks

Inputs are any format of :mod:`datapipes.mesh_formats` (VTK ``.vtu``/``.vtk``/
``.pvtu``, XDMF, Gmsh, Exodus, ... through meshio; ``.npz``; HDF5 with
``points``, optional ``cells`` and fields); each is written by
:func:`datapipes.mesh.prepare_mesh` with a progress bar, and the command ends
with one summary line (points, cells, pieces read, time, output).

The command runs in one process unless ``--distributed`` says it was started
on many ranks (``torchrun``): then the ranks join a gloo process group (within
``--join-timeout`` seconds) and prepare every input together; the files are
the same as from one process. Without the flag, torchrun's variables in the
environment (``RANK``, ``WORLD_SIZE``, ...) are ignored, with a note: a
training rank that runs this command as a subprocess passes them on, and the
command must not try to join that job's process group.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import h5py
from tqdm import tqdm

from .errors import DataPipeError
from .mesh import prepare_mesh
from .mesh_formats import count_pieces
from .sfc import CURVES, DEFAULT_BITS

#: what torchrun sets for its ranks; without --distributed they are ignored
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_JOIN_TIMEOUT = 60.0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare-mesh",
        description="Reorder meshes along a space-filling curve so that each rank of a domain-parallel "
                    "job reads one contiguous, spatially compact range of points. Also run as "
                    "`python -m datapipes.prepare_cli`.",
    )
    parser.add_argument("inputs", nargs="+", type=Path,
                        help="mesh files: .vtu/.vtk/.pvtu, .xdmf, .msh, .exo, ... (meshio), .npz or HDF5")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="output file (one input) or directory (any number of inputs)")
    parser.add_argument("--curve", choices=sorted(CURVES), default="hilbert", help="space-filling curve")
    parser.add_argument("--bits", type=int, default=DEFAULT_BITS, help="quantization bits per axis")
    parser.add_argument("--max-memory", default=None,
                        help="prepare out of core in one process within this budget, e.g. 4GB or 512MiB")
    parser.add_argument("--allow-duplicate-points", action="store_true",
                        help="keep points with equal coordinates (refused by default: the cells on either side of "
                             "them share no node, e.g. .pvtu pieces that repeat their shared nodes)")
    parser.add_argument("--distributed", action="store_true",
                        help="this command was started on many ranks by torchrun: join their gloo process group "
                             "(from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and prepare together. Without it "
                             "the command runs in one process and ignores those variables")
    parser.add_argument("--join-timeout", type=_positive_seconds, default=DEFAULT_JOIN_TIMEOUT, metavar="SECONDS",
                        help=f"with --distributed: give up joining the process group after this long "
                             f"(default {DEFAULT_JOIN_TIMEOUT:g})")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


def _join(timeout: float):
    """``(group, joined)`` for ``--distributed``: the default group (joined here unless the caller did)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD, False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DataPipeError(f"--distributed: {', '.join(missing)} not set; start the ranks with torchrun "
                            "(torchrun --nproc-per-node N -m datapipes.prepare_cli ... --distributed), or drop "
                            "--distributed to prepare in one process")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # the store's timeout bounds every wait of the rendezvous (connecting, the other ranks' addresses)
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout)))
        store.set_timeout(timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    except Exception as err:  # DistStoreError, RuntimeError, TimeoutError: the message is what matters
        raise DataPipeError(
            f"--distributed: rank {rank} of {world} could not join the process group at {where} within "
            f"--join-timeout {timeout:g} s ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            "Are all ranks started (torchrun --nproc-per-node N ... --distributed)? A command run by one rank of "
            "another job must not pass --distributed; raise --join-timeout if the ranks start slowly"
        ) from None
    return dist.group.WORLD, True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    to_dir = len(args.inputs) > 1 or args.output.is_dir() or args.output.suffix == ""
    seen = [k for k in TORCHRUN_VARIABLES if k in os.environ]
    if not args.distributed and seen:
        print(f"prepare-mesh: ignoring {', '.join(seen)} in the environment (torchrun's): preparing in one process; "
              "pass --distributed to prepare on the ranks of a torchrun job", file=sys.stderr, flush=True)
    group, joined, rank, world = None, False, 0, 1
    start = time.perf_counter()
    try:
        if args.distributed:
            group, joined = _join(args.join_timeout)
            import torch.distributed as dist

            rank, world = dist.get_rank(group), dist.get_world_size(group)
        quiet = args.quiet or rank != 0
        totals = [0, 0, 0]  # points, cells, pieces read
        for src in tqdm(args.inputs, desc="meshes", unit="file", disable=quiet or len(args.inputs) == 1):
            dst = args.output / f"{src.stem}.h5" if to_dir else args.output
            prepare_mesh(dst, src, curve=args.curve, bits=args.bits, progress=not quiet, max_memory=args.max_memory,
                         group=group, allow_duplicate_points=args.allow_duplicate_points)
            if rank == 0:
                with h5py.File(dst, "r") as f:
                    totals[0] += int(f.attrs["num_points"])
                    totals[1] += int(f.attrs["num_cells"])
                totals[2] += count_pieces(src)
    except (DataPipeError, ValueError) as err:
        print(f"prepare-mesh: error: {err}", file=sys.stderr)
        return 1
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0:
        files = f"{len(args.inputs)} files, " if len(args.inputs) > 1 else ""
        ranks = f" on {world} ranks" if group is not None else ""
        print(f"prepare-mesh: {files}{totals[0]} points, {totals[1]} cells, {totals[2]} piece(s) read, "
              f"{time.perf_counter() - start:.1f} s{ranks} -> {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
