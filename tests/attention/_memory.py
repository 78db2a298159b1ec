"""Peak live tensor memory on CPU for the attention tests: the benchmarks' ``LiveBytes``.

The tests and ``benchmarks/memory_scaling.py`` measure memory with one
tracker, so a peak asserted here and a peak the benchmark reports mean the
same thing; how it counts (and what it cannot see) is in ``benchmarks/_memory.py``.
"""

from benchmarks._memory import LiveBytes

__all__ = ["LiveBytes"]
