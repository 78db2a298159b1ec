"""The ``__torch_dispatch__`` layer: registered handlers, then per-family rules.

Runs below autograd on ATen ops. Order:

1. a dispatch handler registered for the ``OpOverload`` (or its custom-op name);
2. the rule of the op's family (the table :mod:`.table`, filled by :mod:`physicsnemo_dp.catalog`);
3. otherwise, inside ``physicsnemo_dp.fallback("gather")``, the op on whole operands (:mod:`.fallback`);
4. otherwise a ``NotImplementedError`` that names the op and the ways out.

Rules compute the output layout (placements *and* every shard's size) from
the inputs' specs; where an op needs data from other ranks they redistribute
explicitly. No rule guesses sizes from chunking.
"""

from __future__ import annotations

from .._torch_compat import OpOverload
from . import table
from .fallback import NO_RULE_HINT, fallback_mode, run_gathered
from .registry import dispatch_handlers, named_function_handlers

__all__ = ["handle_torch_dispatch"]


def handle_torch_dispatch(func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if dispatch_handlers._handlers or named_function_handlers._handlers:  # skip both lookups when none is registered
        handler = dispatch_handlers.get(func)
        if handler is None and isinstance(func, OpOverload):
            handler = named_function_handlers.get(str(func))
        if handler is not None:
            return handler(func, types, args, kwargs)
    rule = table.lookup(func)
    if rule is None:
        if fallback_mode() == "gather":
            return run_gathered(func, args, kwargs)
        raise NotImplementedError(
            f"ShardTensor has no rule for {func}. Either gather first "
            "(x.full_tensor() or x.redistribute(placements=[Replicate()])) and run it on "
            "plain tensors, or register an implementation with "
            f"ShardTensor.register_dispatch_handler(op, handler), {NO_RULE_HINT}."
        )
    return rule(func, args, kwargs)
