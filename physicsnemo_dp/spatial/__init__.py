"""Spatial ops on domain-sharded grids: convolution, pooling, interpolation, padding, normalization.

Every op here runs on inputs sharded along spatial dims (1-D or 2-D meshes,
any shard sizes, empty shards included) and gives the single-device result.
Window ops (convolution, pooling, padding, interpolation) get the rows they
need from neighbours through one primitive, :func:`halo.halo_exchange`;
normalization reduces its statistics over the mesh dims that shard the
reduced dims. The module-level ``FUNCTIONS`` / ``RULES`` tables are picked up
by :mod:`physicsnemo_dp.catalog` like any op family.
"""

from __future__ import annotations

from . import conv, interpolate, norm, pad, pool
from .halo import halo_exchange

__all__ = ["halo_exchange"]

FUNCTIONS: dict = {}
for _module in (conv, pool, interpolate, pad, norm):
    FUNCTIONS.update(_module.FUNCTIONS)

#: Every op is handled above autograd (``FUNCTIONS``); the only ATen-level rules are norm.py's
#: clear errors for the native norm ops called through ``torch.ops.aten`` directly.
RULES: dict = dict(norm.RULES)
