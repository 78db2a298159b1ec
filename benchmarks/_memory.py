"""Peak live tensor bytes on CPU, where torch keeps no allocator statistics.

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

Alternatives tried and rejected here: ``tracemalloc`` does not see torch's
allocator; ``torch.profiler(profile_memory=True)`` recorded almost no CPU
allocation events with this torch build; the process RSS includes the
allocator's caches and other ranks' noise.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` then ``m.peak`` (bytes) and ``m.live`` (still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # the subclass runs it; its local ops come back here
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if type(t) in _PLAIN}
        for t in tree_leaves(out):
            if type(t) not in _PLAIN or t.is_meta:  # meta tensors (shape checks) hold no memory
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or (key in inputs and key not in self._refs):
                continue
            if key not in self._refs:
                self._refs[key] = 0
                self._bytes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self._refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def peak_bytes(step) -> int:
    """Peak bytes that ``step()`` adds while it runs (see :class:`LiveBytes`)."""
    with LiveBytes() as mode:
        step()
    return mode.peak
