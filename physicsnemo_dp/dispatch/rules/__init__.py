"""Sharding rules per op family, and the library's function-level handlers.

Each family module defines

* ``RULES``: ``{OpOverload or OpOverloadPacket: rule}`` used by ``__torch_dispatch__``;
  a rule is ``rule(func, args, kwargs) -> result`` and receives ShardTensors
  (plus scalars, and plain tensors that reached the dispatcher);
* ``FUNCTIONS``: ``{python callable: handler}`` used by ``__torch_function__``
  for composite functions whose ATen decomposition would lose the sharding
  (e.g. ``F.linear`` on a 3-D input) or whose default backward would
  materialise full-size gradients (``sum``/``mean``). A handler is called as
  ``handler(func, types, args, kwargs)`` after promotion and usually wraps a
  ``torch.autograd.Function``.

User registrations (``ShardTensor.register_*``) always win over these.
"""

from __future__ import annotations

import torch

from . import dim_ops, indexing, joins, matmul, pointwise, reductions, tensor_like, views
from ... import attention, spatial

_FAMILIES = (tensor_like, pointwise, reductions, views, joins, matmul, dim_ops, indexing, spatial, attention)

_TABLE: dict = {}
FUNCTIONS: dict = {}
for _module in _FAMILIES:
    _TABLE.update(_module.RULES)
    FUNCTIONS.update(getattr(_module, "FUNCTIONS", {}))


_CACHE: dict = {}


def lookup(func):
    """The library rule for an ATen op, or None (memoised: the table is fixed at import)."""
    try:
        return _CACHE[func]
    except KeyError:
        pass
    rule = _TABLE.get(func) or _TABLE.get(getattr(func, "overloadpacket", None))
    if rule is None and torch.Tag.pointwise in getattr(func, "tags", ()):
        rule = pointwise.pointwise_rule
    _CACHE[func] = rule
    return rule


def lookup_function(func):
    """The library's function-level handler for a Python callable, or None."""
    return FUNCTIONS.get(func)
