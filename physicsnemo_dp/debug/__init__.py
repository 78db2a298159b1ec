"""Debugging aids, like ``torch.distributed.tensor.debug``: tools to look inside a run.

* :func:`checks` — the checking mode: collective verification that every rank
  agrees on the metadata of every ShardTensor it builds or redistributes
  (also on process-wide with the environment variable ``PDP_CHECKS=1``).
  Its state lives in the core (``physicsnemo_dp._checking``), because
  construction and redistribution consult it; this package only exposes it.
* :func:`count_collectives` — what every collective of physicsnemo_dp moved on
  this rank inside a block (calls and bytes per kind), as a :class:`CommCounter`.
* :mod:`physicsnemo_dp.debug.viz` — pictures of layouts, halos and partitions
  (matplotlib).
"""

from .._checking import checks, checks_enabled
from ..collectives import CommCounter, count_collectives

__all__ = ["checks", "checks_enabled", "count_collectives", "CommCounter"]
