"""Pure index arithmetic of window ops along one dim (no tensors, no communication).

Every spatial op of this package (convolution, transposed convolution,
pooling, padding, interpolation) computes output index ``o`` along a dim from
a contiguous *window* of input indices, and the windows move monotonically
with ``o``. A sharded implementation needs two answers per dim, both derived
here from shard sizes alone, so every rank knows every other rank's answer:

**Ownership: which rank computes output ``o``.** The rank that owns the input
index at the window's *anchor*: its centre, rounded down (for a transposed
convolution, the input whose centre tap lands on ``o``), clamped into
``[0, N)``. Consequences, which is why the centre and not the window start:

* stride 1 with symmetric ("same") padding anchors ``o`` at ``o`` itself: the
  output has exactly the input's shard sizes, so residual adds and skip
  concatenations after a conv need no redistribution;
* pooling with kernel == stride (and no padding) anchors at the window start;
  a stride-2 downsampling conv (k=3, p=1) anchors ``o`` at ``2o``, and the
  matching transposed conv / 2x upsampling anchors ``o`` at ``o // 2``: with
  even shard boundaries an encoder/decoder pair returns to the same layout;
* anchors never decrease, so each rank's outputs are one contiguous block:
  rank ``r`` holding inputs ``[start_r, end_r)`` computes outputs
  ``[B(start_r), B(end_r))``, where ``B(i)`` counts the outputs anchored before
  input ``i`` and ``B(0) = 0``, ``B(N) = O`` (outputs anchored in the padding
  go to the first / last non-empty shard). An empty input shard gets no
  outputs. Any layout is a valid input, so a following op runs without
  redistribution whatever sizes come out.

**Window: which input rows a block of outputs reads.** ``[lo(o0), hi(o1 - 1))``;
positions outside ``[0, N)`` are boundary padding, filled by the halo exchange
(:mod:`physicsnemo_dp.spatial.halo`) in the op's boundary mode.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from ..split import offsets_from_sizes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Strided:
    """Output ``o`` reads inputs ``o * stride - pad_left + j * dilation``, ``j < kernel``.

    Convolution, pooling (windows may run past the padded input with
    ``ceil_mode``) and padding (``kernel=1``, negative ``pad_left`` crops).
    """

    in_size: int
    out_size: int
    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    pad_left: int = 0

    def count_below(self, i: int) -> int:
        centre = (self.dilation * (self.kernel - 1)) // 2 - self.pad_left
        return _ceil_div(i - centre, self.stride)

    def window(self, o0: int, o1: int) -> tuple[int, int]:
        lo = o0 * self.stride - self.pad_left
        return lo, (o1 - 1) * self.stride - self.pad_left + self.dilation * (self.kernel - 1) + 1

    def symmetric(self) -> bool:
        """Whether torch's own symmetric ``padding=pad_left`` gives exactly these outputs.

        True unless the padding after differs in a way that changes the
        output count ("same" with an even kernel puts one more row after).
        """
        span = self.dilation * (self.kernel - 1) + 1
        return self.pad_left >= 0 and (self.in_size + 2 * self.pad_left - span) // self.stride + 1 == self.out_size


@dataclass(frozen=True)
class Transposed:
    """Input ``i`` adds into outputs ``i * stride - padding + j * dilation``, ``j < kernel``.

    The window of outputs ``[o0, o1)`` is every input that touches them,
    clipped to the input (outside it there is nothing to add).
    """

    in_size: int
    out_size: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0

    def count_below(self, i: int) -> int:
        return i * self.stride - (self.padding - (self.dilation * (self.kernel - 1)) // 2)

    def window(self, o0: int, o1: int) -> tuple[int, int]:
        reach = self.dilation * (self.kernel - 1)
        lo = min(max(0, _ceil_div(o0 + self.padding - reach, self.stride)), self.in_size)
        hi = min(self.in_size, (o1 - 1 + self.padding) // self.stride + 1)
        return lo, max(lo, hi)


@dataclass(frozen=True)
class Tabulated:
    """Explicit per-output windows and anchors (adaptive pooling, interpolation).

    ``lo``/``hi`` are each output's input range and ``anchors`` its anchor;
    all three are non-decreasing.
    """

    in_size: int
    anchors: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def out_size(self) -> int:
        return len(self.anchors)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        """The hash, computed once per map.

        The tables are as long as the global output dim, which grows with P,
        and every plan lookup keys on the map: hashing them per call would be
        O(P) work on every op.
        """
        return hash((self.in_size, self.anchors, self.lo, self.hi))

    def count_below(self, i: int) -> int:
        return bisect_left(self.anchors, i)

    def window(self, o0: int, o1: int) -> tuple[int, int]:
        return self.lo[o0], self.hi[o1 - 1]


def adaptive(in_size: int, out_size: int) -> Tabulated:
    """Adaptive pooling windows ``[floor(o N / O), ceil((o + 1) N / O))``, anchored at their centre."""
    lo = tuple((o * in_size) // out_size for o in range(out_size))
    hi = tuple(_ceil_div((o + 1) * in_size, out_size) for o in range(out_size))
    return Tabulated(in_size, tuple((a + b - 1) // 2 for a, b in zip(lo, hi)), lo, hi)


def _boundary(dim_map, i: int) -> int:
    if i <= 0:
        return 0
    if i >= dim_map.in_size:
        return dim_map.out_size
    return min(max(dim_map.count_below(i), 0), dim_map.out_size)


def out_ranges(dim_map, in_sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Output range ``[o0, o1)`` of every shard, given the input shard sizes.

    An empty input dim (every shard empty) can still have outputs (``F.pad`` of
    a size-0 dim): the first shard takes them all, so the size table adds up.
    """
    if not any(in_sizes):
        out = dim_map.out_size
        return ((0, out),) + ((out, out),) * (len(in_sizes) - 1)
    starts = offsets_from_sizes(tuple(in_sizes))
    return tuple((_boundary(dim_map, s), _boundary(dim_map, s + n)) for s, n in zip(starts, in_sizes))


def out_sizes(dim_map, in_sizes: Sequence[int]) -> tuple[int, ...]:
    """Output shard sizes along the dim (the output's size table)."""
    return tuple(o1 - o0 for o0, o1 in out_ranges(dim_map, in_sizes))


def windows(dim_map, in_sizes: Sequence[int], ranges=None) -> tuple[tuple[int, int], ...]:
    """Input window ``[lo, hi)`` of every shard; empty where the shard has no outputs.

    ``ranges``: :func:`out_ranges` of the same arguments, when the caller has them already.
    """
    starts = offsets_from_sizes(tuple(in_sizes))
    if ranges is None:
        ranges = out_ranges(dim_map, in_sizes)
    return tuple(dim_map.window(o0, o1) if o1 > o0 else (start, start) for start, (o0, o1) in zip(starts, ranges))
