"""Peak live tensor bytes on CPU (where torch keeps no allocator statistics) and on meta tensors.

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every ATen op on
plain tensors, including the ones ShardTensor and DTensor run on their local
tensors: for an op with a tensor-subclass argument it returns
``NotImplemented``, which hands the op to the subclass *with the mode still
active*, so the subclass's own local ops come back through the mode.

Each plain output whose storage is new (not an input's and not already
tracked) adds its storage's bytes; a finalizer on every Python tensor that
refers to a tracked storage subtracts them when the last such tensor dies
(torch keeps a tensor's Python object alive while C++ — autograd's saved
tensors, say — still holds the tensor, so saved activations stay counted).
Tensors created before the mode are not counted: the peak is the memory the
measured code adds (activations, temporaries, gradients, communication
buffers). Not seen: memory that never becomes a tensor (a backend's internal
buffers, kernels' scratch space).

Storages are told apart by their identity (:func:`~physicsnemo_dp._torch_compat.storage_key`),
not their address, so the same accounting runs on meta tensors, which have
shapes and storages but no memory: that is how :func:`physicsnemo_dp.debug.simulate`
predicts the peak of a run it never performs (``meta=True``). Without it,
meta tensors count nothing. With it, the library's own shape checks must
still count nothing, as in a real run: rules run ops on meta tensors of
*global* shapes (``rule_kit.meta_output``, which also caches them). Tensors
that code makes from no tensor with ``device="meta"`` (what tells them from
data, see :func:`_explicitly_meta`), and everything computed only from such
tensors, are skipped.

Alternatives tried and rejected: ``tracemalloc`` does not see torch's
allocator; ``torch.profiler(profile_memory=True)`` recorded almost no CPU
allocation events with this torch build; the process RSS includes the
allocator's caches and other ranks' noise.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import weakref
from typing import Callable

import torch

from .._torch_compat import TorchDispatchMode, is_wrapper_subclass_type, pytree, storage_key

__all__ = ["LiveBytes", "peak_bytes"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` then ``m.peak`` (bytes) and ``m.live`` (still held).

    Args:
        meta: Count meta tensors as if they held memory (for simulation).
        on_grow: Called with the live total after every op that added bytes
            (explain uses it to attribute peaks to the op that reached them).
    """

    def __init__(self, meta: bool = False, on_grow: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._meta = meta
        self._on_grow = on_grow
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._checks: set[int] = set()
        self._paused = False

    @contextlib.contextmanager
    def _uncounted(self):
        """Ops inside count nothing: for a tool's own stand-ins, which the measured code never makes.

        :func:`~physicsnemo_dp.debug.simulate` asks torch which attention
        kernel a CPU run would pick by showing it one-element CPU tensors;
        they die at once, but counted they would add to the peak of the row.
        """
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def _shape_check(self, inputs: list, outputs: list) -> bool:
        """Whether meta ``outputs`` belong to a shape check (see the module docstring), marking them if so."""
        metas = [t for t in inputs if t.is_meta]
        if metas:
            checked = all(storage_key(t) in self._checks for t in metas)
        else:
            checked = _explicitly_meta()
        if checked:
            for t in outputs:
                if type(t) in _PLAIN and t.is_meta:
                    key = storage_key(t)
                    self._checks.add(key)
                    weakref.finalize(t, self._checks.discard, key)
        return checked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # the subclass runs it; its local ops come back here
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if type(t) in _PLAIN]
        inputs = {storage_key(t) for t in leaves}
        outputs = pytree.tree_leaves(out)
        skip_meta = not self._meta or (
            any(type(t) in _PLAIN and t.is_meta for t in outputs) and self._shape_check(leaves, outputs)
        )
        grew = False
        for t in outputs:
            if type(t) not in _PLAIN or (t.is_meta and skip_meta):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage_key(t), storage.nbytes()
            if nbytes == 0 or (key in inputs and key not in self._refs):
                continue
            if key not in self._refs:
                self._refs[key] = 0
                self._bytes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                grew = True
            self._refs[key] += 1
            weakref.finalize(t, self._release, key)
        if grew and self._on_grow is not None:
            self._on_grow(self.live)
        return out


_DEBUG = __name__.rsplit(".", 1)[0].replace(".", "/") + "/"  # "physicsnemo_dp/debug/"
_TORCH = "/torch/"


def _explicitly_meta() -> bool:
    """Whether the code that made a tensor from no tensor asked for the meta device in so many words.

    Such a tensor is a shape check in a real run too (it is meta there and
    counts nothing): rules write ``torch.empty(shape, device="meta")`` to
    read an op's output metadata. A factory whose device comes from an input
    (``torch.zeros(n, device=x.device)``) makes data in a real run and is
    counted. Reads the calling line (the first frame outside torch and this
    package); factories only, so it is rare.
    """
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if _TORCH not in filename and _DEBUG not in filename:
            line = linecache.getline(filename, frame.f_lineno)
            return 'device="meta"' in line or "device='meta'" in line
        frame = frame.f_back
    return False


def peak_bytes(step) -> int:
    """Peak bytes that ``step()`` adds while it runs (see :class:`LiveBytes`)."""
    with LiveBytes() as mode:
        step()
    return mode.peak
