"""Sharding rules per op family.

A rule is ``rule(func, args, kwargs) -> result`` and receives ShardTensors (and
plain scalars or tensors that reached the dispatcher). :func:`lookup` finds
the rule for an ``OpOverload``: an explicit entry first, then the family
implied by the op's tags (pointwise).
"""

from __future__ import annotations

import torch

from . import pointwise, tensor_like

_TABLE: dict = {}
for _module in (tensor_like, pointwise):
    _TABLE.update(_module.RULES)


def lookup(func):
    rule = _TABLE.get(func) or _TABLE.get(getattr(func, "overloadpacket", None))
    if rule is not None:
        return rule
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return pointwise.pointwise_rule
    return None
