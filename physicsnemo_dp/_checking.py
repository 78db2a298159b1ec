"""The checking mode: verify collectively that every rank agrees on ShardTensor metadata.

``from_local(sharding_shapes="chunk")``, ``from_local(sharding_shapes={...})``
and ``from_dtensor`` exist to build a ShardTensor without communicating, so by
default nothing compares what the ranks passed: a rank with another
``global_shape``, another dict or a local tensor that is not its shard goes on
with different metadata and the program later hangs in a collective or
computes garbage. In the checking mode every such construction and every
redistribution makes one small all-gather of a fixed-size fingerprint (the
layout's placements, global shape and digest, the local shape) and every rank
raises the same :class:`~physicsnemo_dp.PlacementError` naming the ranks that
disagree. ``from_local(sharding_shapes="infer")`` and ``scatter_tensor``
exchange their metadata anyway and are checked the same way always.

Turn it on for a block or a function::

    with physicsnemo_dp.debug.checks():
        ...

    @physicsnemo_dp.debug.checks()
    def step(batch): ...

or process-wide with ``PDP_CHECKS=1`` in the environment (read at every use,
so it can be set after import). ``checks(False)`` turns it off inside a block
even when the environment turns it on.

The state lives in a :class:`contextvars.ContextVar`: blocks nest and restore
the previous state on exit, threads and asyncio tasks do not see each other's
blocks, and nothing leaks from one test to the next. A thread started inside a
block does not inherit it (it starts with a fresh context): use the
environment variable to cover every thread, e.g. autograd's device threads on
GPUs. While ``torch.compile`` traces, the check is skipped (a no-op), since
the fingerprint is run-time data a graph cannot branch on; compiled code runs
unchecked, eager code around it is checked.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from typing import Iterator

__all__ = ["checks", "checks_enabled"]

_ENV = "PDP_CHECKS"
_OFF = ("", "0", "false", "no", "off")
_STATE: ContextVar[bool | None] = ContextVar("physicsnemo_dp_checks", default=None)


def checks_enabled() -> bool:
    """Whether the checking mode is on here: the innermost :func:`checks` block, else ``PDP_CHECKS``."""
    state = _STATE.get()
    if state is not None:
        return state
    value = os.environ.get(_ENV)
    return value is not None and value.strip().lower() not in _OFF


@contextlib.contextmanager
def checks(enabled: bool = True) -> Iterator[None]:
    """Turn the checking mode on (or off, with ``enabled=False``) inside the block.

    Re-entrant and usable as a decorator (``@checks()``); the previous state
    comes back on exit, also when the block raises.
    """
    token = _STATE.set(bool(enabled))
    try:
        yield
    finally:
        _STATE.reset(token)
