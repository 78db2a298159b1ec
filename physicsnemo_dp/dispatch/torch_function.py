"""The ``__torch_function__`` layer: function handlers and automatic promotion.

This layer runs *above* autograd, which is why promotion (:mod:`..promotion`)
is applied here: turning a plain weight into a Replicate ShardTensor through a
differentiable step is what lets its gradient be summed over the mesh and
handed back as a plain gradient (so DDP, FSDP2 and optimizers see ordinary
parameters). Autograd's own entry points are redirected to
:mod:`.autograd_entry`.

Order for every call that involves a ShardTensor:

0. a library handler's ``before_promotion`` hook, with the arguments as given
   (it declines with ``NotImplemented``): writes into a plain destination that
   the request path serves without gathering;
1. a function handler registered by the user for ``func`` (or its custom-op
   name), then the library's own (the op-family catalog, :mod:`.table`);
   under ``torch.autocast`` it gets the operands autocast would give the op
   and runs with autocast off (:mod:`.autocast`);
2. otherwise, if plain tensors (other than 0-dim ones without grad) or
   DTensors are mixed in, promote them and call ``func`` again with subclass
   torch-function disabled, which sends it to ``__torch_dispatch__``;
3. otherwise call ``func`` directly (same as 2 without promotion).
"""

from __future__ import annotations

import torch

from .._torch_compat import (
    OpOverload,
    any_autocast_enabled as _any_autocast_enabled,
    eval_frame_callback,
    torch_function_disabled,
    torch_function_enabled,
    torch_function_mode_active,
)
from ..promotion import promote_args
from . import registry, table
from .autocast import autocast_call
from .autograd_entry import AUTOGRAD_ENTRIES
from .registry import function_handlers, named_function_handlers

__all__ = ["handle_torch_function", "operator_call", "set_patches_enabled", "patches_enabled"]

_PATCHES = {"enabled": False}


def set_patches_enabled(enabled: bool) -> None:
    """Turn function-level handlers on or off (dispatch-level handlers are unaffected)."""
    _PATCHES["enabled"] = bool(enabled)


def patches_enabled() -> bool:
    """Whether function-level handlers are consulted (on once a ShardTensor exists)."""
    return _PATCHES["enabled"]


def _lookup(func):
    handler = function_handlers.get(func)
    if handler is None and len(named_function_handlers) and isinstance(func, OpOverload):
        handler = named_function_handlers.get(str(func))
    if handler is None:
        handler = table.lookup_function(func)
    return handler


class _Entry:
    """Route of an autograd entry point (``backward``, ``autograd.grad``)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


#: Metadata reads of a tensor (``x.shape``, ``x.size()``, ``x.stride()``, ``x.dim()``): their only tensor argument is
#: the tensor itself, so promotion (step 2) has nothing to do; without a handler they run directly (step 3). AOTAutograd
#: reads ``o.shape`` of every output of a compiled region that aliases another one.
_READS = frozenset((torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim))
_READ = object()  # the route of a read without a handler

#: func -> its route (an _Entry, a handler, _READ or None), valid for one registry generation
#: (registrations and catalog installs bump it): three dict lookups become one per call.
_ROUTES: dict = {}
_ROUTES_GENERATION = [-1]


def _route(func):
    if _ROUTES_GENERATION[0] != registry._GENERATION[0]:
        _ROUTES.clear()
        _ROUTES_GENERATION[0] = registry._GENERATION[0]
    try:
        return _ROUTES[func]
    except KeyError:
        entry = AUTOGRAD_ENTRIES.get(func)
        route = _Entry(entry) if entry is not None else _lookup(func)
        if route is None and func in _READS:
            route = _READ
        _ROUTES[func] = route
        return route
    except TypeError:  # an unhashable callable: look it up every time
        entry = AUTOGRAD_ENTRIES.get(func) if func.__hash__ is not None else None
        return _Entry(entry) if entry is not None else _lookup(func)


def handle_torch_function(func, types, args=(), kwargs=None):
    route = _route(func)
    if route is _READ:  # step 3 without promotion's pass over the arguments
        with torch_function_disabled():
            return func(*args, **kwargs) if kwargs else func(*args)
    kwargs = kwargs or {}
    if type(route) is _Entry:
        return route.fn(*args, **kwargs)
    handler = route if _PATCHES["enabled"] else None
    if handler is not None:
        early = getattr(handler, "before_promotion", None)
        if early is not None:  # a handler that serves some calls before promotion (a plain destination)
            out = early(func, types, args, kwargs)
            if out is not NotImplemented:
                return out
    args, kwargs = promote_args(func, args, kwargs)
    if handler is not None:
        if _any_autocast_enabled():  # the dispatcher's autocast key never sees a handled call: apply its policy here
            args, kwargs, context = autocast_call(func, args, kwargs)
            with context:
                return handler(func, types, args, kwargs)
        return handler(func, types, args, kwargs)
    with torch_function_disabled():
        return func(*args, **kwargs)


def operator_call(func, types, args):
    """``func(*args)`` for a Python operator of ShardTensor (``ShardTensor.__matmul__``), its fast path first.

    Torch's hook costs ~2 us before ``__torch_function__`` is entered (argument parsing, the overloaded
    arguments' types); an operator method defined on the class is entered directly. It offers the call to
    the route's ``before_promotion`` (step 0 above) exactly where torch's hook would have entered
    :func:`handle_torch_function` with it: subclass torch-function enabled, no TorchFunctionMode (it sees
    every call first), no Dynamo frame hook (the hook's compile-disabled entry serves those), handlers on.
    Everything else, and every call the fast path declines, goes to ``func`` itself: torch's hook, as
    without the method. torch.compile traces the method and finds ``torch.compiler.is_compiling()`` true,
    so its graphs hold ``func`` as before (the caller checks that first, see ``ShardTensor.__matmul__``).
    """
    if (
        torch_function_enabled()
        and eval_frame_callback() is None
        and _PATCHES["enabled"]
        and not torch_function_mode_active()
    ):
        early = getattr(_route(func), "before_promotion", None)
        if early is not None:
            out = early(func, types, args, None)
            if out is not NotImplemented:
                return out
    return func(*args)
