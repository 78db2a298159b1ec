"""Which samples a ddp rank reads in an epoch, computed alike on every rank without communication.

The epoch's order is a permutation drawn from ``numpy.random.default_rng((seed,
epoch))`` (PCG64, stable across platforms and numpy versions), so every rank
derives the same order from the shared seed; all domain ranks of a ddp group
therefore read the same samples. Ddp rank ``r`` takes every ``ddp_size``-th
sample of the order starting at ``r`` (as ``DistributedSampler`` does) and
groups them into batches of ``batch_size``.

* ``drop_last=False``: each sample is read exactly once per epoch across the
  ddp ranks (a partition of the dataset). Rank sample counts differ by at most
  one, so the last batch may be smaller and, when ``len(dataset)`` is not a
  multiple of ``ddp_size * batch_size``, some ranks may have one batch fewer.
* ``drop_last=True``: the tail of the shuffled order is dropped so that every
  rank gets the same number of full batches (what DDP needs to stay in step);
  the samples kept are still read once each.

Unlike ``DistributedSampler``, no sample is repeated to pad ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SampleOrder"]


@dataclass(frozen=True)
class SampleOrder:
    """Batches of sample indices of one ddp rank, per epoch."""

    num_samples: int
    batch_size: int = 1
    ddp_size: int = 1
    ddp_rank: int = 0
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.ddp_rank < self.ddp_size:
            raise ValueError(f"ddp_rank {self.ddp_rank} is outside a ddp axis of {self.ddp_size}")
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples")
        if self._kept() == 0:
            raise ValueError(
                f"drop_last=True with {self.num_samples} samples, {self.ddp_size} ddp ranks and "
                f"batch_size={self.batch_size} leaves no full batch"
            )

    def _kept(self) -> int:
        step = self.ddp_size * self.batch_size
        return self.num_samples // step * step if self.drop_last else self.num_samples

    def num_batches(self) -> int:
        """Batches this rank reads per epoch (the same in every epoch)."""
        mine = len(range(self.ddp_rank, self._kept(), self.ddp_size))
        return -(-mine // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The whole epoch's sample order (identical on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)

    def batches(self, epoch: int) -> list[tuple[int, ...]]:
        """This rank's batches of sample indices in ``epoch``."""
        mine = self.order(epoch)[: self._kept()][self.ddp_rank :: self.ddp_size].tolist()
        return [tuple(mine[i : i + self.batch_size]) for i in range(0, len(mine), self.batch_size)]
