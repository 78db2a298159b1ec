"""Command line: sort meshes along a space-filling curve for domain-parallel reading.

    python -m datapipes.prepare_cli car.vtu -o prepared/car.h5
    python -m datapipes.prepare_cli raw/*.npz -o prepared/ --curve morton
    python -m datapipes.prepare_cli big.pvtu -o big.h5 --max-memory 4GB      # out of core, one process
    torchrun --nproc-per-node 4 -m datapipes.prepare_cli big.pvtu -o big.h5   # on 4 ranks

Inputs are any format of :mod:`datapipes.mesh_formats` (VTK ``.vtu``/``.vtk``/
``.pvtu``, XDMF, Gmsh, Exodus, ... through meshio; ``.npz``; HDF5 with
``points``, optional ``cells`` and fields); each is written by
:func:`datapipes.mesh.prepare_mesh` with a progress bar. Started by
``torchrun`` (``WORLD_SIZE`` > 1 in the environment), the ranks join a gloo
process group and prepare every input together; the files are the same as
from one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

from .errors import DataPipeError
from .mesh import prepare_mesh
from .sfc import CURVES, DEFAULT_BITS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m datapipes.prepare_cli",
        description="Reorder meshes along a space-filling curve so that each rank of a domain-parallel "
                    "job reads one contiguous, spatially compact range of points.",
    )
    parser.add_argument("inputs", nargs="+", type=Path,
                        help="mesh files: .vtu/.vtk/.pvtu, .xdmf, .msh, .exo, ... (meshio), .npz or HDF5")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="output file (one input) or directory (any number of inputs)")
    parser.add_argument("--curve", choices=sorted(CURVES), default="hilbert", help="space-filling curve")
    parser.add_argument("--bits", type=int, default=DEFAULT_BITS, help="quantization bits per axis")
    parser.add_argument("--max-memory", default=None,
                        help="prepare out of core in one process within this budget, e.g. 4GB or 512MiB")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


def _group():
    """``(group, joined)``: the default group when started by torchrun with more than one rank (joined
    here, gloo, unless the caller already did), else ``(None, False)``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, False
    import torch.distributed as dist

    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("gloo")
    return dist.group.WORLD, joined


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    to_dir = len(args.inputs) > 1 or args.output.is_dir() or args.output.suffix == ""
    group, joined = _group()
    quiet = args.quiet or int(os.environ.get("RANK", "0")) != 0
    try:
        for src in tqdm(args.inputs, desc="meshes", unit="file", disable=quiet or len(args.inputs) == 1):
            dst = args.output / f"{src.stem}.h5" if to_dir else args.output
            prepare_mesh(dst, src, curve=args.curve, bits=args.bits, progress=not quiet,
                         max_memory=args.max_memory, group=group)
    except (DataPipeError, ValueError) as err:
        print(f"prepare_mesh: error: {err}", file=sys.stderr)
        return 1
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
