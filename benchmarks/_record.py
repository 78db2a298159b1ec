"""One benchmark measurement, as stored in the JSON report, and the cross-rank reduction behind it."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Result:
    """A value, its same-run baseline and their ratio, with the target it should meet.

    ``target`` is ``("<=", x)`` or ``(">=", x)``; ``met`` says whether the ratio
    meets it (None: no target, the ratio is informative). ``local_size`` is
    the per-rank problem size of a point on a scaling curve (else None).

    Timings come as one value and baseline per repetition (sequences or numpy
    arrays, see :mod:`benchmarks._timing`; a plain number on one side stands
    for every repetition): ``ratios`` holds each repetition's ratio, ``ratio``
    (the figure reported and judged) is their median and ``spread`` their
    ``(min, max)``; ``value`` and ``baseline`` become the medians of their own
    repetitions (informative: the ratio is not their quotient). Exact counts
    (bytes, memory, messages) are single numbers: ``ratios`` is None and the
    ratio is ``value / baseline``.
    """

    suite: str
    case: str
    world_size: int
    value: float | Sequence[float]
    baseline: float | Sequence[float]
    unit: str
    target: tuple[str, float] | None = None
    local_size: int | None = None
    ratios: list[float] | None = field(default=None)

    def __post_init__(self) -> None:
        value, baseline = np.atleast_1d(np.asarray(self.value, float)), np.atleast_1d(np.asarray(self.baseline, float))
        if value.ndim != 1 or baseline.ndim != 1 or 1 < value.size != baseline.size > 1:
            raise ValueError(f"{self.case}: value and baseline need one entry per repetition, got shapes "
                             f"{value.shape} and {baseline.shape}")  # fmt: skip
        if self.ratios is None and max(value.size, baseline.size) > 1:
            value, baseline = np.broadcast_arrays(value, baseline)
            self.ratios = [_ratio(float(v), float(b)) for v, b in zip(value, baseline)]
        self.value, self.baseline = float(np.median(value)), float(np.median(baseline))

    @property
    def ratio(self) -> float:
        if self.ratios:
            return float(statistics.median(self.ratios))
        return _ratio(self.value, self.baseline)

    @property
    def spread(self) -> tuple[float, float] | None:
        """``(min, max)`` of the per-repetition ratios (None for an exact count)."""
        return (min(self.ratios), max(self.ratios)) if self.ratios else None

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        op, bound = self.target
        return self.ratio <= bound if op == "<=" else self.ratio >= bound

    def as_dict(self) -> dict:
        spread = self.spread
        return {
            **asdict(self),
            "ratio": self.ratio,
            "met": self.met,
            "spread": None if spread is None else list(spread),
            "repetitions": len(self.ratios) if self.ratios else None,
        }


def _ratio(value: float, baseline: float) -> float:
    if baseline == 0:
        return 1.0 if value == 0 else math.inf
    return value / baseline


def over_ranks(value, op: str = "sum"):
    """``value`` summed (``"sum"``) or maximised (``"max"``) over every rank of the world.

    Every rank calls it with its own figure and gets the same answer, so the
    Result rank 0 reports stands for the whole run. A numpy array (one entry
    per repetition, every rank the same length) is reduced entry by entry.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    array = isinstance(value, np.ndarray)
    t = torch.tensor(np.asarray(value, np.float64).reshape(-1), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().numpy() if array else t.item()
