"""Sequence-sharded attention: ``F.scaled_dot_product_attention`` on ShardTensors.

Models call ``F.scaled_dot_product_attention`` unchanged; when its inputs are
ShardTensors the handler registered here (a dispatch-rules family: see
:mod:`physicsnemo_dp.catalog`) picks the layout from where the
sequence dim (-2) is sharded:

* sharded queries, replicated keys/values — local attention, no communication;
* replicated queries, sharded keys/values — partial results merged by
  log-sum-exp, output Partial (see :mod:`.local`);
* queries, keys and values sharded — ring attention (:mod:`.ring`).

Supported: ``is_causal`` with the global positions of uneven shards (and the
load-balanced zig-zag order of :mod:`.zigzag`), boolean and additive
``attn_mask``, ``scale``, ``enable_gqa``, shards of any size including empty,
float64/float32/bfloat16/float16, CPU (gloo) and CUDA (NCCL) with the same
code. ``dropout_p`` must be 0 (ValueError otherwise).

Library composites that call SDPA below autograd (``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``) reach the fused kernel op instead — CPU's,
or CUDA's flash, efficient or cuDNN kernel — and its backward; the rules of
:mod:`.fused` run the same schedules for each, so those modules work unmodified.

torch.compile: ring attention is a loop of point-to-point transfers with no
graph representation, so its entry (:func:`.function.ring_attention`) is wrapped
in ``torch.compiler.disable``: a compiled model containing it runs the
attention eagerly at a graph break and compiles the code around it. The
recommended *regional* pattern compiles the blocks between attentions
instead of the whole model, which avoids recompiling around the break::

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.compile(QKVProjection())     # compiled region
            self.mlp = torch.compile(MLP())               # compiled region

        def forward(self, x):
            q, k, v = self.qkv(x)
            x = x + F.scaled_dot_product_attention(q, k, v)  # eager ring attention
            return x + self.mlp(x)
"""

from __future__ import annotations

import torch.nn.functional as F

from . import fused
from .function import ring_attention
from .sdpa import propagate_entry, scaled_dot_product_attention, sdpa_handler
from .zigzag import from_zigzag, to_zigzag, zigzag_causal, zigzag_order, zigzag_sizes

__all__ = [
    "scaled_dot_product_attention",
    "ring_attention",
    "to_zigzag",
    "from_zigzag",
    "zigzag_causal",
    "zigzag_order",
    "zigzag_sizes",
]

RULES: dict = dict(fused.RULES)
FUNCTIONS: dict = {F.scaled_dot_product_attention: sdpa_handler}
#: ``propagation.plan`` entries (installed by the catalog through ``dispatch/table.py``): the function and the
#: fused kernels' forward and backward ops, planned by :mod:`._propagate`.
PROPAGATORS: dict = {F.scaled_dot_product_attention: propagate_entry, **fused.PROPAGATORS}
