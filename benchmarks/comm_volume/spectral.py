"""FFTs along a sharded dim: bytes of an ``rfft2`` + ``irfft2`` pair over the transposes they need.

``x`` (batch 1, ``channels``, ``image``, ``image``) is sharded along ``H``.
``rfft2`` transforms ``W`` locally and transposes the half spectrum to shard
``W // 2 + 1``; ``irfft2`` transposes it back. The minimum is what those two
transposes must deliver to each rank: the elements of its target shard held
by other ranks (complex64). Also: the FNO block's forward + backward makes
exactly one all-to-all per transform (four), whatever else it communicates.
"""

from __future__ import annotations

import torch

from physicsnemo_dp import count_collectives

from .. import _models
from .._record import Result, over_ranks
from .._spectral import FNOBlock

SUITE = "comm_volume"


def _arrivals(src_spec, dst_spec, d_src: int, d_dst: int, itemsize: int) -> int:
    """Bytes that must reach this rank to go from sharding ``d_src`` to sharding ``d_dst``."""
    mine = dst_spec.local_shape[d_dst]  # my part of the newly sharded dim
    others = src_spec.global_shape[d_src] - src_spec.local_shape[d_src]  # rows of d_src I did not hold
    rest = 1
    for d, n in enumerate(src_spec.global_shape):
        if d not in (d_src, d_dst):
            rest *= n
    return mine * others * rest * itemsize


def run(mesh, image: int, channels: int) -> list[Result]:
    P = mesh.size()
    x = _models.shard(_models.global_input((1, channels, image, image)), mesh, 2)
    with count_collectives() as counter:
        x_ft = torch.fft.rfft2(x)
        y = torch.fft.irfft2(x_ft, s=(image, image))
    itemsize = x_ft.dtype.itemsize
    minimum = _arrivals(x._spec, x_ft._spec, 2, 3, itemsize) + _arrivals(x_ft._spec, y._spec, 3, 2, itemsize)
    results = [
        Result(SUITE, "rfft2 + irfft2 (H sharded): bytes / the two transposes", P,
               over_ranks(counter.total_received), over_ranks(minimum), "bytes", ("<=", 1.1)),
    ]  # fmt: skip
    torch.manual_seed(0)
    block = FNOBlock(channels, max(1, image // 8)).to(x.device)
    xg = x.detach().requires_grad_(True)
    with count_collectives() as counter:
        _models.train_step(block, xg)
    results.append(Result(SUITE, "FNO block fwd+bwd: all-to-alls / one per transform (4)", P,
                          over_ranks(counter.calls["all_to_all"], "max"), 4, "calls", ("<=", 1.0)))  # fmt: skip
    return results
