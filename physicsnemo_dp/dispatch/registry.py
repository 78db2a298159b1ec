"""Handler registries: user- and library-supplied implementations of ops.

Three tables, looked up in this order by the dispatch layers:

* function handlers, keyed by a Python callable (``torch.nn.functional.conv2d``)
  — consulted in ``__torch_function__``, above autograd;
* named function handlers, keyed by a custom op's name (``"mylib.op.default"``)
  — for ops made with ``torch.library.custom_op``, at both levels;
* dispatch handlers, keyed by an ``OpOverload`` (``aten.mm.default``) —
  consulted in ``__torch_dispatch__``, below autograd.

A handler is called as ``handler(func, types, args, kwargs)``. Registries are
ordinary objects with ``register``/``unregister`` and an ``override`` context
manager, so tests can add or replace a handler and restore the previous one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["HandlerRegistry", "function_handlers", "named_function_handlers", "dispatch_handlers", "generation",
           "dispatch_handlers_registered"]

#: Bumped on every change of any registry, so the hooks can memoise lookups
#: per op and notice when a registration invalidates them.
_GENERATION = [0]


def dispatch_handlers_registered() -> bool:
    """Whether any dispatch-level handler (by op or by custom-op name) is registered."""
    return bool(dispatch_handlers._handlers or named_function_handlers._handlers)


def generation() -> int:
    """A number that changes whenever a handler is registered or removed anywhere."""
    return _GENERATION[0]


class HandlerRegistry:
    """A mapping from op (or op name) to handler that can be changed and restored."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._handlers: dict[Any, Callable] = {}

    def register(self, key: Any, handler: Callable) -> None:
        if not callable(handler):
            raise TypeError(f"handler for {key!r} must be callable, got {handler!r}")
        self._handlers[key] = handler
        _GENERATION[0] += 1

    def unregister(self, key: Any) -> None:
        self._handlers.pop(key, None)
        _GENERATION[0] += 1

    def get(self, key: Any) -> Callable | None:
        return self._handlers.get(key)

    def __contains__(self, key: Any) -> bool:
        return key in self._handlers

    def __len__(self) -> int:
        return len(self._handlers)

    @contextlib.contextmanager
    def override(self, key: Any, handler: Callable | None) -> Iterator[None]:
        """Use ``handler`` (or none, if ``None``) for ``key`` inside the block."""
        missing = object()
        previous = self._handlers.get(key, missing)
        if handler is None:
            self.unregister(key)
        else:
            self.register(key, handler)
        try:
            yield
        finally:
            if previous is missing:
                self.unregister(key)
            else:
                self.register(key, previous)


function_handlers = HandlerRegistry("function")
named_function_handlers = HandlerRegistry("named function")
dispatch_handlers = HandlerRegistry("dispatch")
