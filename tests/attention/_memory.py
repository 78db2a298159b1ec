"""Peak live tensor memory on CPU, where torch keeps no allocator statistics.

``LiveBytes`` is a ``TorchDispatchMode``: every ATen op's plain-tensor outputs
whose storage is new (not an input's, not already tracked) add the storage's
bytes; a finalizer on each Python tensor that refers to a tracked storage
removes the bytes when the last such tensor dies. Tensors created before the
mode are not counted, so the peak is the extra memory of the code measured.
(``tracemalloc`` does not see torch's allocator; the profiler's memory events
are attributed to nested ops and need reconstructing.) Ops on tensor
subclasses are seen only as subclass ops, so measure code whose heavy work
runs on plain tensors — as the attention schedules do.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _plain(t) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


class LiveBytes(TorchDispatchMode):
    def __init__(self):
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
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _plain(t)}
        for t in tree_leaves(out):
            if not _plain(t):
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
