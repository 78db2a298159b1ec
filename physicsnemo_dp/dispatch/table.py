"""The library's op table: which rule or function handler serves an op.

The table is empty until :mod:`physicsnemo_dp.catalog` installs the op
families into it (``import physicsnemo_dp`` does that). Keeping the table
here and its contents above lets the dispatch hooks stay below the families:
the hooks look ops up, the families depend only on the rule kit, and no module
imports a layer above it.

Each family module defines

* ``RULES``: ``{OpOverload or OpOverloadPacket: rule}`` used by ``__torch_dispatch__``;
  a rule is ``rule(func, args, kwargs) -> result`` and receives ShardTensors
  (plus scalars, and plain tensors that reached the dispatcher);
* ``PROPAGATORS`` (optional): ``{op: fn(op, args, kwargs) -> OpPlan}``, the
  family's pure propagation from specs, installed into
  :mod:`physicsnemo_dp.propagation` for ``propagation.plan``;
* ``FUNCTIONS`` (optional): ``{python callable: handler}`` used by
  ``__torch_function__`` for composite functions whose ATen decomposition would
  lose the sharding (e.g. ``F.linear`` on a 3-D input) or whose default backward
  would materialise full-size gradients (``sum``/``mean``). A handler is called
  as ``handler(func, types, args, kwargs)`` after promotion; one with a
  ``before_promotion`` attribute (same signature) is offered the call first,
  unpromoted, and serves it unless that returns ``NotImplemented`` (a write
  into a plain destination that need not be gathered: ``graph/_scatter.py``).

User registrations (``ShardTensor.register_*``) always win over these.
"""

from __future__ import annotations

from .. import propagation
from . import registry

__all__ = ["install", "lookup", "lookup_function"]

_RULES: dict = {}
_FUNCTIONS: dict = {}
_CACHE: dict = {}
_POINTWISE: list = []


def install(families, pointwise_rule) -> None:
    """Fill the table from ``families`` (modules with ``RULES``/``FUNCTIONS``).

    ``pointwise_rule`` serves every ATen op tagged pointwise (with tensor
    results only: :func:`propagation.is_elementwise`) that no family names. Installing again replaces the contents (idempotent for the same
    families), so the table never mixes two catalogs.
    """
    rules, functions, propagators = {}, {}, {}
    for module in families:
        rules.update(module.RULES)
        functions.update(getattr(module, "FUNCTIONS", {}))
        propagators.update(getattr(module, "PROPAGATORS", {}))
    propagation.register(propagators)
    _RULES.clear()
    _RULES.update(rules)
    _FUNCTIONS.clear()
    _FUNCTIONS.update(functions)
    _POINTWISE[:] = [pointwise_rule]
    _CACHE.clear()
    registry._GENERATION[0] += 1  # function routes memoised by the torch-function hook are stale


def lookup(func):
    """The library rule for an ATen op, or None (memoised: the table is fixed once installed).

    Memoised by the op's ``id`` (the entry keeps the op alive and is checked by identity): an ``OpOverload``'s
    ``__hash__`` is a Python call, and every dispatched op comes here.
    """
    hit = _CACHE.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    rule = _RULES.get(func) or _RULES.get(getattr(func, "overloadpacket", None))
    if rule is None and _POINTWISE and propagation.is_elementwise(func):
        rule = _POINTWISE[0]
    _CACHE[id(func)] = (func, rule)
    return rule


def lookup_function(func):
    """The library's function-level handler for a Python callable, or None."""
    return _FUNCTIONS.get(func)
