"""Timing that survives a shared machine: interleaved candidates, the median of repetitions counts.

Other processes steal the cores in bursts. Every figure is measured in
``REPETITIONS`` (>= 3) *repetitions*; a repetition runs every candidate (and
its baseline) once per round, for a few rounds, so that a burst hits them
alike, and keeps each candidate's fastest run of that repetition, the least
disturbed. The figure reported (and judged against its target) is the
**median over repetitions** of the per-repetition ratio, and the spread
(min-max of those ratios) goes with it (:class:`benchmarks._record.Result`).

Why both: the fastest of a few rounds inside a repetition filters out the
runs a burst of load hit (such a run says nothing about the code); the
median over repetitions is what a second run of the suite reproduces, where
the fastest of all runs of one invocation is an outlier by construction (a
target met only by the luckiest run was missed by the next run). The spread
says how far a second run may land.

The callers' ``rounds`` is the budget of timed runs per candidate: it is split
into the repetitions (``max(1, rounds // REPETITIONS)`` rounds each), so a
suite costs about what it cost when its fastest run counted, plus one
warm-up round. On several ranks a barrier starts each run on all ranks
together, as in training.

Results are numpy arrays with one entry per repetition: arithmetic on them
(``P * t``, sums over ranks with :func:`benchmarks._record.over_ranks`)
keeps the repetitions apart, and :class:`~benchmarks._record.Result` takes
them as ``value`` and ``baseline``.

Two clocks: wall time (``time.perf_counter``; waiting for other ranks is part
of the cost) and CPU time (``time.process_time``, every thread of the process,
or ``time.thread_time``): CPU time does not count the time a process waits
for a core, which on a loaded machine is most of the wall time, so it measures
the work done.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch.distributed as dist

#: Repetitions per figure (the median of them is reported). At least 3; odd, so the median is one repetition's.
REPETITIONS = 3


def split_rounds(rounds: int, repetitions: int | None = None) -> tuple[int, int]:
    """``(repetitions, rounds per repetition)`` for a budget of ``rounds`` timed runs per candidate."""
    reps = REPETITIONS if repetitions is None else repetitions
    if reps < 1:
        raise ValueError(f"repetitions must be >= 1, got {reps}")
    return reps, max(1, rounds // reps)


def fastest_by(
    runs: dict[str, Callable[[], object]],
    rounds: int,
    clocks: Sequence[Callable[[], float]],
    *,
    barrier: bool = True,
    repetitions: int | None = None,
) -> dict[str, list[np.ndarray]]:
    """Per callable and clock, an array of per-repetition times (each the fastest of that repetition's rounds).

    One warm-up round first; then ``repetitions`` (default :data:`REPETITIONS`) repetitions of
    ``max(1, rounds // repetitions)`` interleaved rounds (see the module docstring).
    """
    reps, per_rep = split_rounds(rounds, repetitions)
    best: dict[str, list[np.ndarray]] = {name: [np.full(reps, np.inf) for _ in clocks] for name in runs}
    for round_ in range(reps * per_rep + 1):
        rep = (round_ - 1) // per_rep
        for name, fn in runs.items():
            if barrier and dist.is_initialized():
                dist.barrier()
            start = [clock() for clock in clocks]
            fn()
            seconds = [clock() - s for clock, s in zip(clocks, start)]
            if round_:
                for times, s in zip(best[name], seconds):
                    times[rep] = min(times[rep], s)
    return best


def fastest(
    runs: dict[str, Callable[[], object]],
    rounds: int,
    *,
    barrier: bool = True,
    clock=time.perf_counter,
    repetitions: int | None = None,
) -> dict[str, np.ndarray]:
    """Per-repetition seconds of each callable by one ``clock`` (see :func:`fastest_by`)."""
    timed = fastest_by(runs, rounds, (clock,), barrier=barrier, repetitions=repetitions)
    return {name: b[0] for name, b in timed.items()}


def repeated(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """``fn`` called ``calls`` times in a row (to time calls shorter than the clock's noise)."""

    def loop() -> None:
        for _ in range(calls):
            fn()

    return loop
