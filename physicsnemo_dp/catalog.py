"""The op-family catalog: every family of sharding rules, installed into the dispatch table.

This is the one module that knows all families. It sits above them, so the
dispatch hooks (which look ops up) and the families (which implement them)
never import each other. To add a family: write its module with ``RULES``
(and optionally ``FUNCTIONS``), list it here, and test it with
``tests/ops/_diff.check``.
"""

from __future__ import annotations

from . import attention, graph, spatial
from .dispatch import table
from .rules import (
    channel_ops, copies, dim_ops, fft, indexing, joins, linalg, losses, matmul, pointwise, random, reductions, scalars,
    shape_ops, tensor_like, views,
)

__all__ = ["FAMILIES"]

#: Later families win where two name the same op.
FAMILIES = (
    tensor_like, pointwise, reductions, views, joins, copies, shape_ops, matmul, linalg, dim_ops, indexing, graph, fft, spatial, attention,
    random, scalars, losses, channel_ops,
)

table.install(FAMILIES, pointwise_rule=pointwise.pointwise_rule)
