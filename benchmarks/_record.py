"""One benchmark measurement, as stored in the JSON report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class Result:
    """A value, its same-run baseline and their ratio, with the target it should meet.

    ``target`` is ``("<=", x)`` or ``(">=", x)``; ``met`` says whether the ratio meets it.
    """

    suite: str
    case: str
    world_size: int
    value: float
    baseline: float
    unit: str
    target: tuple[str, float] | None = None

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
