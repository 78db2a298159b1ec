"""Allocate like the input: plain factories inside chosen layers become ShardTensor allocations.

Public spectral layers build their spectrum with a plain factory of the
*global* shape (``torch.zeros(b, c_out, *fft_size, dtype=torch.cfloat)``) and
write sharded values into it. On a ShardTensor input that buffer is whole on
every rank: the written values are gathered (an implicit gather) and the
inverse transform runs on the whole spectrum everywhere. Written as
``x_ft.new_zeros(...)`` the same line keeps the buffer sharded like ``x_ft``
(``rules/tensor_like._new_factory``): this module makes that substitution for
code that cannot be edited.

:class:`AllocationMode` is a ``TorchFunctionMode`` that is active only while
the ``forward`` of an adapted module runs on a ShardTensor (global forward
pre/post hooks, the post hook with ``always_call`` so an exception cannot
leave it on). It remembers the last ShardTensors the forward received or
produced (weak references) and turns ``torch.zeros/empty/ones/full`` and a
plain tensor's ``new_zeros/new_empty/new_ones/new_full`` into a ShardTensor
allocated like the most recent such tensor ``like`` whose sharded dims have
the requested extents (same number of dims; a different extent along an
unsharded dim, e.g. other channels or the half spectrum's last dim, is fine:
``like.new_zeros(size)`` would give the same layout). Failing that, like the
most recent one with at least one such dim, ``Replicate`` on the mesh dims
whose dim has another extent (the transform parked a shard on the input
channels and the spectrum has other output channels): sharded over fewer
ranks, still never whole. Any other call runs unchanged: a
factory of another shape, with ``out=``, ``requires_grad=True``, a
non-strided layout or another device; ShardTensor methods (the rule already
lays those out like the tensor). Calls made by the library's own rules never
reach the mode (torch pops a mode while its handler runs).
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from torch.distributed.tensor.placement_types import Replicate

from ..shard_tensor import ShardTensor
from ..spec import ShardTensorSpec

__all__ = ["AllocationMode", "allocate_like_input", "Adapter"]

_RECENT = 8  # ShardTensors remembered per forward (the buffer's model is among the last few)

_TORCH_FACTORIES = {torch.zeros: "new_zeros", torch.empty: "new_empty", torch.ones: "new_ones", torch.full: "new_full"}
_TENSOR_FACTORIES = {
    torch.Tensor.new_zeros: "new_zeros",
    torch.Tensor.new_empty: "new_empty",
    torch.Tensor.new_ones: "new_ones",
    torch.Tensor.new_full: "new_full",
}
_FACTORY_KEYWORDS = {"dtype", "device", "layout", "requires_grad", "pin_memory", "memory_format", "out", "names"}


def _size(args) -> tuple[int, ...] | None:
    """The size of a factory call's positional arguments (``(2, 3)``, ``([2, 3],)``, ``(torch.Size(...),)``)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        return tuple(args)
    return None


def _layout_for(like: ShardTensor, size: tuple[int, ...]):
    """``(placements, dim_sizes)`` for a buffer of ``size`` laid out like ``like``, or None.

    A mesh dim keeps ``like``'s ``Shard(d)`` where ``size[d]`` is ``like``'s global extent (a ``Partial`` one
    becomes ``Replicate``); one whose dim has another extent is ``Replicate`` (a spectrum with other channels
    than the input's, where the transform parked a shard on the input channels: the buffer is then sharded
    over the other mesh dims only). None: another number of dims, or no mesh dim left sharding anything.
    """
    spec = like._spec
    if len(size) != len(spec.global_shape):
        return None
    placements, dim_sizes = [], list(spec.dim_sizes)
    for p in spec.placements:
        placements.append(p if p.is_shard() and size[p.dim] == spec.global_shape[p.dim] else Replicate())
    kept = {p.dim for p in placements if p.is_shard()}
    if not kept:
        return None
    for d, table in enumerate(dim_sizes):
        if table is not None and d not in kept:
            dim_sizes[d] = None
    return tuple(placements), tuple(dim_sizes)


def _same_device(requested, like: ShardTensor) -> bool:
    if requested is None:
        return True
    requested = torch.device(requested)
    actual = like.device
    return requested.type == actual.type and (requested.index is None or requested.index == actual.index)


class AllocationMode(TorchFunctionMode):
    """Plain factories of a live ShardTensor's global extents become allocations laid out like it.

    ``redirected`` counts the calls turned into ShardTensor allocations (for
    tests and ``repr``).
    """

    def __init__(self, inputs=()):
        super().__init__()
        self._recent: collections.deque = collections.deque(maxlen=_RECENT)
        self.redirected = 0
        for x in inputs:
            self._remember(x)

    def _remember(self, out) -> None:
        if isinstance(out, ShardTensor):
            self._recent.append(weakref.ref(out))
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, ShardTensor):
                    self._recent.append(weakref.ref(o))

    def _like(self, size):
        """The most recent remembered ShardTensor the buffer can be laid out like (every sharded dim kept first)."""
        partial = None
        for ref in reversed(self._recent):
            t = ref()
            layout = None if t is None else _layout_for(t, size)
            if layout is None:
                continue
            if layout[0] == tuple(Replicate() if p.is_partial() else p for p in t._spec.placements):
                return t, layout
            if partial is None:
                partial = (t, layout)
        return partial

    def _allocate(self, func, args, kwargs):
        name = _TORCH_FACTORIES.get(func)
        if name is not None:
            dtype_default, device_default = torch.get_default_dtype(), None
            if func is torch.full:
                if len(args) != 2:
                    return None
                size, extra = _size((args[0],)), (args[1],)
            else:
                size, extra = _size(args), ()
                if size is None and not args and "size" in kwargs:
                    size = _size((kwargs["size"],))
        else:
            name = _TENSOR_FACTORIES.get(func)
            if name is None or not args or isinstance(args[0], ShardTensor) or not isinstance(args[0], torch.Tensor):
                return None
            base, rest = args[0], args[1:]
            dtype_default, device_default = base.dtype, base.device
            if name == "new_full":
                if len(rest) != 2:
                    return None
                size, extra = _size((rest[0],)), (rest[1],)
            else:
                size, extra = _size(rest), ()
        if size is None:
            return None
        unknown = set(kwargs) - _FACTORY_KEYWORDS - {"size", "fill_value"}
        if (
            unknown
            or kwargs.get("out") is not None
            or kwargs.get("requires_grad")
            or kwargs.get("names") is not None
            or kwargs.get("layout", torch.strided) is not torch.strided
        ):
            return None
        found = self._like(size)
        device = kwargs.get("device", device_default)
        if found is None or not _same_device(device, found[0]):
            return None
        like, (placements, dim_sizes) = found
        dtype = kwargs.get("dtype") or dtype_default
        spec = ShardTensorSpec.from_sizes(like._spec.mesh, placements, size, dtype, dim_sizes)
        local = getattr(like._local_tensor, name)(tuple(spec.local_shape), *extra, dtype=dtype)
        out = ShardTensor.from_spec(local, spec)
        if kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
            out = out.contiguous(memory_format=kwargs["memory_format"])
        self.redirected += 1
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TORCH_FACTORIES or func in _TENSOR_FACTORIES:
            out = self._allocate(func, args, kwargs)
            if out is not None:
                self._remember(out)
                return out
        out = func(*args, **kwargs)
        self._remember(out)
        return out


class Adapter:
    """An active adaptation: while it is active, every forward of an instance of ``classes`` (subclasses too)
    called with a ShardTensor argument runs under its own :class:`AllocationMode`.

    A context manager (``with allocate_like_input(MyLayer): ...``) or, from
    :func:`physicsnemo_dp.integrations.enable`, a handle whose :meth:`remove`
    ends it. Removing twice is harmless. ``redirected`` counts the
    allocations made sharded so far (all forwards, all threads).
    """

    def __init__(self, classes: tuple[type, ...], name: str):
        self.classes = classes
        self.name = name
        self.redirected = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open = 0  # forwards entered and not yet left (all threads): the exit hook outlives remove() until 0
        self._removed = False
        self._pre = _module.register_module_forward_pre_hook(self._enter)
        self._post = _module.register_module_forward_hook(self._exit, always_call=True)

    # hooks: the stack is per thread (modules may run forward in several threads)
    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, module, args):
        if not isinstance(module, self.classes):
            return None
        inputs = [a for a in args if isinstance(a, ShardTensor)]
        if not inputs:
            return None
        mode = AllocationMode(inputs)
        mode.__enter__()
        self._stack().append((module, mode))
        with self._lock:
            self._open += 1
        return None

    def _exit(self, module, args, result):
        stack = self._stack()
        if stack and stack[-1][0] is module:
            _, mode = stack.pop()
            mode.__exit__(None, None, None)
            with self._lock:
                self.redirected += mode.redirected
                self._open -= 1
                last = self._removed and self._open == 0
            if last:
                self._post.remove()
        return None

    def remove(self) -> None:
        """End the adaptation (forwards already running keep their mode until they return). Idempotent."""
        with self._lock:
            if self._removed:
                return
            self._removed = True
            self._pre.remove()
            if self._open == 0:
                self._post.remove()

    @property
    def active(self) -> bool:
        return not self._removed

    def __enter__(self) -> "Adapter":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in self.classes)
        state = "active" if self.active else "removed"
        return f"Adapter({self.name}: {names}; {state}, {self.redirected} allocations sharded)"


def allocate_like_input(*classes: type, name: str | None = None) -> Adapter:
    """Adapt ``classes``: plain factories of a sharded tensor's global extents inside their forward are sharded.

    Generic form of :func:`physicsnemo_dp.integrations.neuraloperator` /
    :func:`~physicsnemo_dp.integrations.physicsnemo` for any layer that
    allocates a buffer with ``torch.zeros`` (``empty``, ``ones``, ``full``,
    a plain tensor's ``new_*``) of the global shape of a ShardTensor it
    received or computed, then writes sharded values into it. Use it as a
    context manager, or keep the returned :class:`Adapter` and call
    ``remove()``.
    """
    if not classes:
        raise TypeError("allocate_like_input: give at least one nn.Module class to adapt")
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, torch.nn.Module)):
            raise TypeError(f"allocate_like_input: classes must be nn.Module subclasses, got {c!r}")
    return Adapter(tuple(classes), name or ", ".join(c.__qualname__ for c in classes))
