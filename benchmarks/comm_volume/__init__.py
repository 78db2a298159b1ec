"""Communication volume: bytes each operation moves over the minimum it needs (target <= 1.1).

Counted with ``physicsnemo_dp.count_collectives`` (what arrives at each rank
from others, self-copies excluded; an all-reduce counts the ring volume
``2 (P-1)/P n``, its lower bound), summed over ranks, divided by the summed
minimum. Four families, one module each:

* :mod:`.redistribute` — every redistribution transition and sum/mean, on
  uneven shards (with ``compare_dtensor``: also even shards, side by side with
  DTensor, whose bytes :mod:`._dtensor` counts the same way);
* :mod:`.windows` — halo exchange of a convolution on 1 and 2 sharded dims, and
  ring attention, forward and backward;
* :mod:`.spectral` — an ``rfft2`` + ``irfft2`` pair along a sharded dim (its
  transposes), and the all-to-alls of an FNO block.

On one rank nothing needs to move, so the suite reports nothing there.
"""

from __future__ import annotations

from .._record import Result
from . import redistribute, spectral, windows


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(rows=64, cols=8, image=24, channels=2, seq=24, heads=2, head_dim=4)
    s = max(scale, 1 / 16)
    return dict(rows=int(4096 * s), cols=256, image=int(256 * s), channels=8, seq=int(1024 * s), heads=4, head_dim=16)


def run(mesh, rows: int, cols: int, image: int, channels: int, seq: int, heads: int, head_dim: int,
        compare_dtensor: bool = False) -> list[Result]:  # fmt: skip
    if mesh.size() == 1:
        return []
    return (
        redistribute.run(mesh, rows, cols, compare_dtensor)
        + windows.halo(mesh, image, channels)
        + windows.ring(mesh, seq, heads, head_dim)
        + spectral.run(mesh, image, channels)
    )
