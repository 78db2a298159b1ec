"""Debugging aids, like ``torch.distributed.tensor.debug``: tools to look inside a run.

* :func:`checks` — the checking mode: collective verification that every rank
  agrees on the metadata of every ShardTensor it builds or redistributes
  (also on process-wide with the environment variable ``PDP_CHECKS=1``).
  Its state lives in the core (``physicsnemo_dp._checking``), because
  construction and redistribution consult it; this package only exposes it.
* :func:`count_collectives` — what every collective of physicsnemo_dp moved on
  this rank inside a block (calls and bytes per kind), as a :class:`CommCounter`.
* :func:`explain` — one model step, op by op on this rank: layouts, local
  shapes, collectives and bytes, peak live bytes (:class:`Explanation`).
  ``count_collectives`` is its per-kind total: both read the same stream.
* :func:`simulate` — the same table for one rank of a job of any size
  (up to thousands of ranks) on one CPU: the real rules on meta tensors over
  torch's fake process group (:class:`Simulation`). Command line:
  ``python -m physicsnemo_dp.debug simulate --help``.
* :func:`implicit_gathers` — what an implicit gather does (``"warn"`` once per
  source line, ``"raise"``, ``"allow"``; also ``PDP_IMPLICIT_GATHERS``), the same
  function as ``physicsnemo_dp.implicit_gathers``; :func:`gather_policy` reads
  it; ``explain`` lists each :class:`ImplicitGather` of a step.
* :class:`LiveBytes` — peak live tensor bytes, on CPU and on meta tensors.
* :func:`compile_counts` — torch.compile's graph breaks and compiled graphs so
  far in this process (differences between two calls: a region's breaks and
  recompilations; ``benchmarks/compiled.py`` reports them per step).
* :mod:`physicsnemo_dp.debug.viz` — pictures of layouts, halos and partitions
  (matplotlib).
"""

from .._checking import checks, checks_enabled
from .._gathers import ImplicitGather, gather_policy, implicit_gathers
from .._torch_compat import compile_counts
from ..collectives import CommCounter, count_collectives
from ._explain import CollectiveCall, Explanation, OpRecord, explain
from ._memory import LiveBytes, peak_bytes
from ._simulate import DataDependentError, Simulation, sharded_input, simulate, simulating

__all__ = [
    "checks",
    "checks_enabled",
    "implicit_gathers",
    "gather_policy",
    "ImplicitGather",
    "count_collectives",
    "CommCounter",
    "explain",
    "Explanation",
    "OpRecord",
    "CollectiveCall",
    "simulate",
    "Simulation",
    "sharded_input",
    "simulating",
    "DataDependentError",
    "LiveBytes",
    "peak_bytes",
    "compile_counts",
]
