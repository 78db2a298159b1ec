"""The least a Python tensor subclass can cost for ``x @ w``, against DTensor's C++ path.

``dispatch_overhead`` measures ShardTensor's ``x @ w`` with a plain weight at
1.5-1.7x DTensor's time. This module asks whether *any* Python subclass can
do better: it times two bare wrapper subclasses that do nothing but the
unavoidable steps, no sharding logic at all (no route, promotion, plan or
size table), on the same local tensors:

* **Python autograd Function** (ShardTensor's design): ``__torch_function__``
  entry, a ``torch.autograd.Function`` whose ``forward`` runs the local ``mm``
  and wraps the result and whose ``setup_context`` saves both operands (the
  backward needs them), and the wrap;
* **C++ autograd on the wrappers** (DTensor's design, in Python):
  ``__torch_function__`` entry that passes the call on, autograd's own
  ``MmBackward0`` recorded on the wrappers, ``__torch_dispatch__`` entry,
  the local ``mm`` and the wrap.

DTensor's base class runs its dispatch in C++ (pytorch#167051) and defines no
``__torch_function__``; its weight is distributed once. A floor close to 1.0
of DTensor leaves no room for the sharding logic itself, which costs a few
microseconds in Python (ShardTensor: route, promotion of the plain weight,
plan lookup ~2.5 us). Thread CPU time per call, median of
repetitions of interleaved batches (see :mod:`._timing`), one intra-op thread. ``python -m benchmarks.dispatch_floor`` prints
the figures (simulated mesh of 2 ranks; nothing moves).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp._torch_compat import make_wrapper_subclass, torch_function_disabled
from physicsnemo_dp.collectives import mesh_device

from ._timing import fastest, repeated


class _Bare(torch.Tensor):
    """A wrapper subclass that only unwraps and wraps: the fixed cost of the Python subclass protocol."""

    @staticmethod
    def __new__(cls, local):
        out = make_wrapper_subclass(
            cls, local.shape, stride=local.stride(), dtype=local.dtype, device=local.device, requires_grad=False
        )
        out._local = local
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch_function_disabled():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _Bare(func(*[a._local if isinstance(a, _Bare) else a for a in args], **(kwargs or {})))


class _BareFunction(_Bare):
    """The same subclass whose ``@`` runs in a Python autograd Function above autograd (no dispatch)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__matmul__:
            return _Mm.apply(*args)
        return super().__torch_function__(func, types, args, kwargs)


class _Mm(torch.autograd.Function):
    @staticmethod
    def forward(a, b):
        return _BareFunction(torch.mm(a._local, b._local))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - timing only runs forward
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad


def _bare_pair(cls, local, weight):
    x = cls(local)
    w = cls(weight.detach())
    w.requires_grad_(True)
    return x, w


def floor(mesh, rows: int = 64, cols: int = 32, calls: int = 200, repeats: int = 15) -> dict[str, float]:
    """Seconds per ``x @ w`` call of: plain torch, DTensor, ShardTensor, and the two bare subclasses (per repetition)."""
    P, device = mesh.size(), mesh_device(mesh)
    gen = torch.Generator().manual_seed(0)
    local = torch.randn(rows, cols, generator=gen).to(device)
    weight = torch.nn.Parameter(torch.randn(cols, cols, generator=gen).to(device))
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], shape=(rows * P, cols), stride=(cols, 1))
    dweight = distribute_tensor(weight, mesh, [Replicate()])
    sharded = ShardTensor.from_dtensor(dtensor)
    operands = {
        "plain torch": (local, weight),
        "DTensor": (dtensor, dweight),
        "ShardTensor": (sharded, weight),
        "bare subclass, Python Function": _bare_pair(_BareFunction, local, weight),
        "bare subclass, C++ autograd + Python dispatch": _bare_pair(_Bare, local, weight),
    }
    runs = {name: repeated(lambda x=x, w=w: x @ w, calls) for name, (x, w) in operands.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = fastest(runs, repeats, barrier=False, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    return {name: seconds / calls for name, seconds in best.items()}


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from physicsnemo_dp._torch_compat import fake_process_group

    with fake_process_group(2, 0):
        times = floor(init_device_mesh("cpu", (2,)))
    for name, seconds in times.items():  # medians of the repetitions
        print(f"{name:48s} {np.median(seconds) * 1e6:7.2f} us  {np.median(seconds / times['DTensor']):5.2f}x DTensor")


if __name__ == "__main__":
    main()
