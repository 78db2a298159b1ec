"""Whether reading ahead pays, decided batch by batch from what the consumer does.

A read in flight hides behind the consumer's work between two batches (its
*gap*: the training step). It is not free: the batch goes through a hand-off
(a queue for a reader thread; a pickled task and reply for a reader process,
whose buffers are shared memory, which cannot use huge pages and so take
8-11 % longer to fill here) and the reads rotate through several buffers
instead of refilling the one the consumer just dropped. Measured on this
machine, 32 MiB batches at one rank: a thread reading ahead reached 0.86-0.94
of a bare ``read_direct`` loop, a process 0.82-0.86, reading in the caller
0.96-1.03. So when the consumer asks for the next batch straight away there
is nothing to hide the read behind, and reading ahead only adds its cost.
Reading in the caller opens the source's files in the training process; they
are closed before it forks again (:mod:`datapipes._fork_guard`), so a reader
forked later never inherits them.

:class:`ReadAhead` therefore keeps reads in flight while the consumer's gap is
at least :data:`START` of a read's time, and reads in the caller once it falls
below :data:`STOP` (the two thresholds keep it from flapping around one
value). Both times are exponential averages, so one slow step or read does
not flip it. The policy starts by reading ahead: a training loop's first
steps are long (warm-up, compilation), and a pipe that has not seen its
consumer yet behaves as before.
"""

from __future__ import annotations

__all__ = ["ReadAhead", "START", "STOP"]

#: Read ahead again once the consumer's gap reaches this share of a read.
START = 0.25
#: Read in the caller once the consumer's gap falls below this share of a read.
#: Reading ahead costs 4-16 % of a read here (see the module docstring).
STOP = 0.125
_WEIGHT = 0.5  # of the newest observation in the averages: a change of regime shows within a few batches


class ReadAhead:
    """Batch-by-batch choice between reads in flight (``ahead``) and reads in the caller.

    Args:
        enabled: False pins the choice to reading ahead (the caller asked for
            it whatever the consumer does).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.ahead = True
        self.switches = 0  # how often the choice changed (for tests and diagnostics)
        self._read: float | None = None  # average seconds per batch read
        self._gap: float | None = None  # average seconds the consumer keeps a batch before asking again

    def observe_read(self, seconds: float) -> None:
        """A batch took ``seconds`` to read (in whichever reader read it)."""
        self._read = _average(self._read, seconds)

    def observe_gap(self, seconds: float) -> None:
        """The consumer asked for the next batch ``seconds`` after receiving one; decide again."""
        self._gap = _average(self._gap, seconds)
        if not self.enabled or not self._read:
            return
        share = self._gap / self._read
        if self.ahead and share < STOP or not self.ahead and share >= START:
            self.ahead = not self.ahead
            self.switches += 1


def _average(old: float | None, new: float) -> float:
    return new if old is None else _WEIGHT * new + (1 - _WEIGHT) * old
