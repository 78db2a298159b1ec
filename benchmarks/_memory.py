"""Peak live tensor bytes on CPU: :class:`physicsnemo_dp.debug.LiveBytes`, the one implementation.

The benchmarks, the attention memory tests and ``physicsnemo_dp.debug.explain``
/ ``simulate`` count memory the same way; how it counts (and what it cannot
see) is in ``physicsnemo_dp/debug/_memory.py``.
"""

from physicsnemo_dp.debug import LiveBytes, peak_bytes

__all__ = ["LiveBytes", "peak_bytes"]
