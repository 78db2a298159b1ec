"""``torch.autocast`` for the library's function-level handlers.

Autocast is a dispatcher key: for an op on its lists (``conv2d``, ``linear``,
``scaled_dot_product_attention`` compute in the low dtype; FFTs and some norms
and losses in float32; ``cat``-like ops in the widest dtype) it casts the
operands, then runs the op with autocast off. A function handler
(``FUNCTIONS`` of a family) takes the call *above* the dispatcher, so the
dispatcher never sees it: its local kernels (``aten.convolution``, the fused
attention kernels, ``mm``) are not on the lists, and autograd Functions whose
forward ran under autocast would meet their own backward without it.

:func:`autocast_call` does for a handler what autocast does for an op: it
asks torch's autocast what the call computes in (:func:`_compute_dtype`),
casts the floating operands that autocast would cast to that dtype (a
differentiable ``.to``, so a float32 leaf still gets a float32 gradient), and
the handler then runs with autocast off. The policy is torch's own, read from
the output dtype of the same call on storage-less probe tensors of the
operands' device and global shapes, with and without autocast; the two runs
are memoised per call signature, so a model pays them once per layer shape.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from .._torch_compat import disabled_torch_function, make_wrapper_subclass, pytree, real_tensors
from ..rule_kit import meta_output, shard_tensor_cls

__all__ = ["autocast_call"]

_NO_CHANGE = None


def autocast_call(func, args, kwargs):
    """``(args, kwargs, context)`` for running ``func``'s handler under the current autocast state.

    Called only while some autocast is enabled. ``context`` is the context
    manager to run the handler in: autocast off when the call's compute dtype
    differs from the one without autocast (the operands are then cast to it),
    else a null context (autocast changes nothing here; the handler runs as is).
    """
    leaves, tree = _flatten(args, kwargs)
    st_cls = shard_tensor_cls()
    device_type = next((a._local_tensor.device.type for a in leaves if isinstance(a, st_cls)), None)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return args, kwargs, contextlib.nullcontext()
    with real_tensors():  # while torch.compile traces too: the probes are metadata, never graph nodes
        target = _compute_dtype(func, tree, leaves, device_type)
    if target is _NO_CHANGE:
        return args, kwargs, contextlib.nullcontext()
    with torch.autocast(device_type, enabled=False):  # the casts themselves must not meet this hook again
        args, kwargs = _unflatten([_cast(a, target, device_type) for a in leaves], tree)
    return args, kwargs, torch.autocast(device_type, enabled=False)


def _flatten(args, kwargs):
    """Leaves and structure of a call; flat calls (the common case) skip pytree (~20 us a call)."""
    if any(type(a) in _CONTAINERS for a in args) or any(type(v) in _CONTAINERS for v in kwargs.values()):
        return pytree.tree_flatten((tuple(args), dict(kwargs)))
    return (*args, *kwargs.values()), (len(args), tuple(kwargs))


def _unflatten(leaves, tree):
    if type(tree) is tuple:
        n, names = tree
        return tuple(leaves[:n]), dict(zip(names, leaves[n:]))
    return pytree.tree_unflatten(list(leaves), tree)


_CONTAINERS = (list, tuple, dict)


def _cast(a, dtype, device_type):
    """``a`` in ``dtype`` where autocast would cast it: a floating tensor of the device, not float64."""
    if (
        isinstance(a, torch.Tensor)
        and a.is_floating_point()
        and a.dtype != dtype
        and a.dtype != torch.float64
        and a.device.type == device_type
    ):
        return a.to(dtype)
    return a


def _compute_dtype(func, tree, leaves, device_type):
    """The real dtype autocast runs this call in, or ``_NO_CHANGE`` if autocast leaves the call alone."""
    key = tuple(_leaf(a) for a in leaves)
    autocast_dtype = torch.get_autocast_dtype(device_type)
    try:
        return _policy(func, tree, key, device_type, autocast_dtype)
    except TypeError as unhashable:  # an argument without a hash: probe it uncached
        if "unhashable" not in str(unhashable):
            raise
        return _policy.__wrapped__(func, tree, key, device_type, autocast_dtype)


class _Arg:
    """A tensor argument of a probed call, by global shape, dtype and device type."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = shape, dtype, device

    def _key(self):
        return (self.shape, self.dtype, self.device)

    def __eq__(self, other):
        return type(other) is _Arg and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


class _Slice:
    """A ``slice`` argument, hashable (``x[1:3]``; slices hash only from Python 3.12 on)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is _Slice and (self.value.start, self.value.stop, self.value.step) == (
            other.value.start, other.value.stop, other.value.step)

    def __hash__(self):
        return hash((self.value.start, self.value.stop, self.value.step))


def _leaf(a):
    if type(a) is slice:
        return _Slice(a)
    if isinstance(a, shard_tensor_cls()):
        return _Arg(tuple(a._spec.global_shape), a._local_tensor.dtype, a._local_tensor.device.type)
    if isinstance(a, torch.Tensor):
        return _Arg(tuple(a.shape), a.dtype, a.device.type)
    return a


@functools.lru_cache(maxsize=1024)
def _policy(func, tree, key, device_type, autocast_dtype):
    """Memoised on the call's metadata: the output dtype under autocast, if it differs from the one without."""
    del autocast_dtype  # part of the key only: the probe reads the current autocast state
    with_autocast = _probe_dtype(func, tree, key, device_type)
    if with_autocast is None:  # torch's autocast path raises: leave the call alone, the handler will raise
        return _NO_CHANGE
    try:
        margs, mkwargs = _rebuild(tree, key, lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta"))
        with warnings.catch_warnings():  # e.g. "ComplexHalf support is experimental" for a float16 FFT
            warnings.simplefilter("ignore")
            without = _first_floating_dtype(meta_output(func, margs, mkwargs))
    except Exception:  # noqa: BLE001 - e.g. a kernel without a low-precision variant: autocast is what makes it run
        without = None
    if with_autocast == without:
        return _NO_CHANGE
    return with_autocast


def _rebuild(tree, key, make):
    """The call's arguments from its key, each tensor made by ``make``."""
    leaves = [make(a) if isinstance(a, _Arg) else a.value if type(a) is _Slice else a for a in key]
    return _unflatten(leaves, tree)


def _probe_dtype(func, tree, key, device_type):
    """Real dtype of ``func``'s first floating output on probes of ``key`` under the current autocast."""
    try:
        margs, mkwargs = _rebuild(
            tree, key, lambda a: _Probe.of(torch.empty(a.shape, dtype=a.dtype, device="meta"), a.device)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _first_floating_dtype(func(*margs, **mkwargs))
    except Exception:  # noqa: BLE001 - any failure means: no policy to apply
        return None


def _first_floating_dtype(out):
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return t.real.dtype if t.is_complex() else t.dtype
    return None


class _Probe(torch.Tensor):
    """A storage-less tensor of a real device type whose ops run on meta tensors.

    It carries the device's dispatch keys (so the device's autocast casts it)
    and computes nothing: every op runs on the meta tensor inside.
    """

    __torch_function__ = disabled_torch_function

    @staticmethod
    def of(meta: torch.Tensor, device_type: str):
        probe = make_wrapper_subclass(
            _Probe, meta.shape, dtype=meta.dtype, device=torch.device(device_type), requires_grad=False,
            stride=meta.stride(),
        )
        probe._meta = meta
        return probe

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        device = None

        def unwrap(a):
            nonlocal device
            if isinstance(a, _Probe):
                device = device or a.device.type
                return a._meta
            if isinstance(a, torch.Tensor):
                return a.to("meta")
            if isinstance(a, torch.device) and a.type != "meta":
                return torch.device("meta")
            return a

        margs, mkwargs = pytree.tree_map(unwrap, (args, kwargs or {}))
        out = func(*margs, **mkwargs)
        return pytree.tree_map(
            lambda t: _Probe.of(t, device) if isinstance(t, torch.Tensor) and t.device.type == "meta" else t, out
        )
