"""The single-process reference of a random op: the same generator state, the same counter-based values.

``reference(kind, shape, dtype, seed, **params)`` seeds torch like the sharded
run, takes the op's key the same way and evaluates the distribution over the
whole tensor (``physicsnemo_dp.random`` without a mesh). A sharded op equal
to it for every layout is decomposition-invariant.
"""

from __future__ import annotations

import torch

from physicsnemo_dp import _philox
from physicsnemo_dp.rules.random import distribution_values

from ..core._util import make_spec, shard_from_global


class Whole:
    """One box holding the whole tensor."""

    def __init__(self, shape):
        self.global_shape = self.local_shape = tuple(shape)

    def local_offsets(self):
        return (0,) * len(self.global_shape)


def reference(kind, shape, dtype, seed, device="cpu", **params):
    torch.manual_seed(seed)
    key = _philox.draw_key(device, None)
    return distribution_values(kind, key, Whole(shape), dtype, device, params)


def reference_words(shape, seed, device="cpu"):
    """Uniforms in [0, 1) from 32-bit words (bernoulli's and dropout's), float64."""
    torch.manual_seed(seed)
    key = _philox.draw_key(device, None)
    return _philox.sample_full("word32", key, shape, torch.int64, device).to(torch.float64) * 2.0**-32


def sharded(global_tensor, mesh, placements, kind="uneven", salt=0, requires_grad=False):
    spec = make_spec(mesh, placements, tuple(global_tensor.shape), kind, dtype=global_tensor.dtype, salt=salt)
    return shard_from_global(global_tensor, spec, requires_grad=requires_grad)
