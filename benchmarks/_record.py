"""One benchmark measurement, as stored in the JSON report, and the cross-rank reduction behind it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass
class Result:
    """A value, its same-run baseline and their ratio, with the target it should meet.

    ``target`` is ``("<=", x)`` or ``(">=", x)``; ``met`` says whether the ratio
    meets it (None: no target, the ratio is informative). ``local_size`` is
    the per-rank problem size of a point on a scaling curve (else None).
    """

    suite: str
    case: str
    world_size: int
    value: float
    baseline: float
    unit: str
    target: tuple[str, float] | None = None
    local_size: int | None = None

    @property
    def ratio(self) -> float:
        if self.baseline == 0:
            return 1.0 if self.value == 0 else math.inf
        return self.value / self.baseline

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        op, bound = self.target
        return self.ratio <= bound if op == "<=" else self.ratio >= bound

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def over_ranks(value: float, op: str = "sum") -> float:
    """``value`` summed (``"sum"``) or maximised (``"max"``) over every rank of the world.

    Every rank calls it with its own figure and gets the same answer, so the
    Result rank 0 reports stands for the whole run.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.item()
