"""Timing that survives a shared machine: interleaved candidates, fastest run counts.

Other processes steal the cores in bursts. Running every candidate once per
round (so a burst hits them alike) and keeping each one's fastest run, which
is the least disturbed, estimates what the code itself costs. On several ranks
a barrier starts each run on all ranks together, as in training.

Two clocks: wall time (``time.perf_counter``; waiting for other ranks is part
of the cost) and CPU time (``time.process_time``, every thread of the process,
or ``time.thread_time``): CPU time does not count the time a process waits
for a core, which on a loaded machine is most of the wall time, so it measures
the work done.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch.distributed as dist


def fastest_by(
    runs: dict[str, Callable[[], object]], rounds: int, clocks: Sequence[Callable[[], float]], *, barrier: bool = True
) -> dict[str, list[float]]:
    """Per callable, the fastest of ``rounds`` runs by each clock (one warm-up round first)."""
    best: dict[str, list[float]] = {}
    for round_ in range(rounds + 1):
        for name, fn in runs.items():
            if barrier and dist.is_initialized():
                dist.barrier()
            start = [clock() for clock in clocks]
            fn()
            seconds = [clock() - s for clock, s in zip(clocks, start)]
            if round_:
                best[name] = [min(b, s) for b, s in zip(best.get(name, seconds), seconds)]
    return best


def fastest(
    runs: dict[str, Callable[[], object]], rounds: int, *, barrier: bool = True, clock=time.perf_counter
) -> dict[str, float]:
    """Seconds of the fastest of ``rounds`` runs of each callable by one ``clock`` (see :func:`fastest_by`)."""
    return {name: b[0] for name, b in fastest_by(runs, rounds, (clock,), barrier=barrier).items()}


def repeated(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """``fn`` called ``calls`` times in a row (to time calls shorter than the clock's noise)."""

    def loop() -> None:
        for _ in range(calls):
            fn()

    return loop
