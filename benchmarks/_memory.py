"""How the benchmarks count memory: torch tensors with LiveBytes, numpy/Python with tracemalloc.

Tensors: :class:`physicsnemo_dp.debug.LiveBytes`, the one implementation. The
benchmarks, the attention memory tests and ``physicsnemo_dp.debug.explain`` /
``simulate`` count tensor memory the same way; how it counts (and what it
cannot see) is in ``physicsnemo_dp/debug/_memory.py``.

numpy arrays and Python objects (the mesh preparation): :func:`traced_peak`.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Callable

from physicsnemo_dp.debug import LiveBytes, peak_bytes

__all__ = ["LiveBytes", "peak_bytes", "traced_peak"]


def traced_peak(fn: Callable[[], object]) -> tuple[float, int]:
    """Seconds of ``fn()`` and the peak of ``tracemalloc``'s traced bytes above their level at the call.

    tracemalloc is started on first use and **never stopped**: on CPython
    before 3.12.9 / 3.13.2, ``tracemalloc.stop()`` races with threads that
    take the GIL for the first time and can crash the process (CPython
    gh-128679). gloo's worker threads do exactly that when they drop the last
    reference to a tensor that shares a numpy array's memory, as the mesh
    preparation's exchanges do; one benchmark run died of it with SIGSEGV.
    Tracing slows Python allocation about 3x for the rest of the process,
    so call this only in processes that end soon after (the benchmark ranks
    run the ``mesh_prepare`` suite last).
    """
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, tracemalloc.get_traced_memory()[1] - base
