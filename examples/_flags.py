"""Checked types for the examples' flags: a bad value is refused while the command line is parsed.

Every rank parses the same command line before it joins the process group,
so a value refused here stops every rank with the same message (argparse's
``error: argument --steps: ...``, exit status 2); checked any later, it would
fail on the rank that first uses it while the others wait in a collective.
:func:`check_layout` does the checks that need the mesh's shape (known once
the process group is joined, and the same on every rank): sample counts
against the batch and the ddp ranks, points against the domain ranks.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable

__all__ = ["integer", "real", "output_folder", "check_layout"]

SEED_MAX = 2**32 - 1  # numpy's seed range; torch accepts it too


def _bounds(low, high) -> str:
    if high is None:
        return f">= {low}"
    return f"in [{low}, {high}]"


def integer(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {_bounds(low, high)}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {_bounds(low, high)}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def real(low: float = 0.0, *, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number ``>= low`` (``> low`` unless ``inclusive``)."""
    bound = f"{'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = "real"
    return parse


def output_folder(text: str) -> Path:
    """An argparse type: a folder that exists and is writable, or can be created (its nearest existing
    parent is a writable folder). A file of that name, or a file on the way to it, is refused."""
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; pass a folder (created if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text} is not writable; pass a folder this user can write to")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text} cannot be created: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be created: {parent} is not writable")
    return path


def check_layout(args: argparse.Namespace, context) -> None:
    """Refuse flags that do not fit the mesh of ``context`` (every rank alike, before any data is made).

    The ``--batch-size`` samples of a step are split evenly over the ddp
    ranks; the pipes drop incomplete batches, so a training set smaller than
    one global batch, or a test set with fewer samples than ddp ranks, would
    leave a rank with nothing to read long after the data was generated.
    Each sample's points (or grid rows) are split over the domain ranks.
    """
    ddp, domain = context.ddp_size, context.domain_size
    problems = []
    if args.batch_size % ddp:
        problems.append(f"--batch-size {args.batch_size} must be a multiple of the ddp size {ddp}")
    if getattr(args, "samples", None) is not None and args.samples < args.batch_size:
        problems.append(f"--samples {args.samples} is less than one global batch (--batch-size {args.batch_size}): "
                        f"pass --samples >= {args.batch_size}")
    if getattr(args, "test_samples", None) is not None and args.test_samples < ddp:
        problems.append(f"--test-samples {args.test_samples}: each of the {ddp} ddp ranks evaluates at least one "
                        f"test sample; pass --test-samples >= {ddp}")
    for flag, rows in (("--grid", getattr(args, "grid", None)), ("--points", getattr(args, "points", None))):
        if rows is not None and rows < domain:
            problems.append(f"{flag} {rows} cannot be split over the {domain} domain ranks; pass {flag} >= {domain} "
                            "or a smaller --domain-size")
    if problems:
        raise SystemExit("invalid flags for the mesh (ddp={}, domain={}):\n  {}".format(ddp, domain,
                                                                                    "\n  ".join(problems)))
