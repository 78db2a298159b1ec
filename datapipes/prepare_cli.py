"""Command line: sort meshes along a space-filling curve for domain-parallel reading.

    python -m datapipes.prepare_cli car.npz -o prepared/car.h5
    python -m datapipes.prepare_cli raw/*.npz -o prepared/ --curve morton

Inputs are ``.npz`` or HDF5 files with ``points``, optional ``cells`` and
per-point fields (see :func:`datapipes.mesh.load_mesh_input`); each is written
by :func:`datapipes.mesh.prepare_mesh` with a progress bar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from .errors import DataPipeError
from .mesh import load_mesh_input, prepare_mesh
from .sfc import CURVES, DEFAULT_BITS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m datapipes.prepare_cli",
        description="Reorder meshes along a space-filling curve so that each rank of a domain-parallel "
                    "job reads one contiguous, spatially compact range of points.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help=".npz or HDF5 files with points, cells, fields")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="output file (one input) or directory (any number of inputs)")
    parser.add_argument("--curve", choices=sorted(CURVES), default="hilbert", help="space-filling curve")
    parser.add_argument("--bits", type=int, default=DEFAULT_BITS, help="quantization bits per axis")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    to_dir = len(args.inputs) > 1 or args.output.is_dir() or args.output.suffix == ""
    try:
        for src in tqdm(args.inputs, desc="meshes", unit="file", disable=args.quiet or len(args.inputs) == 1):
            points, fields, cells = load_mesh_input(src)
            dst = args.output / f"{src.stem}.h5" if to_dir else args.output
            prepare_mesh(dst, points, fields, cells, curve=args.curve, bits=args.bits, progress=not args.quiet)
    except (DataPipeError, ValueError) as err:
        print(f"prepare_mesh: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
