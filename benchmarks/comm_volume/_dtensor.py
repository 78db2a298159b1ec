"""Bytes DTensor's collectives move, counted like ``physicsnemo_dp.collectives`` counts its own.

DTensor issues ``torch.distributed._functional_collectives`` ops; a dispatch
mode sees them (ops on DTensors are handed to DTensor with the mode still
active, see ``benchmarks/_memory.py``) and adds what each one makes this rank
receive from others, by the same convention as ``collectives.py``: exact for
gathers, reduce-scatters and all-to-alls, the bandwidth-optimal ring volume
``2 (P-1)/P n`` for an all-reduce.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class DTensorTraffic(TorchDispatchMode):
    """``with DTensorTraffic(mesh) as t: ...`` then ``t.received`` (bytes into this rank) and ``t.calls``."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.group, self.me = mesh.size(), mesh.get_local_rank()
        self.received = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor runs it; its collectives come back here
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            self._count(func.__name__.split(".")[0], args, out)
        return out

    def _count(self, name: str, args, out) -> None:
        P = self.group
        if name == "all_gather_into_tensor":
            received = (P - 1) * _nbytes(args[0])
        elif name == "reduce_scatter_tensor":
            received = (P - 1) * _nbytes(args[0]) // P
        elif name == "all_reduce":
            received = 2 * (P - 1) * _nbytes(args[0]) // P
        elif name == "all_to_all_single":
            splits = args[1]
            rows = out.shape[0] if out.ndim else 1
            row = _nbytes(out) // max(rows, 1)
            received = (rows - (splits[self.me] if splits else rows // P)) * row
        else:
            return  # wait_tensor and friends move nothing
        self.received += received
        self.calls += 1
