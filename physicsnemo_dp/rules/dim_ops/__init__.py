"""Ops along one dim: softmax, scans, sort/topk, median/mode/kthvalue, flip/roll, and layer_norm over trailing dims.

Along an unsharded dim every one of them is local and keeps the input's
layout. Along a sharded dim each has either a dedicated sharded form that
moves only what it needs (softmax, scans, topk, flip, roll) or the whole-dim
fallback of ``_common.on_whole_dims`` (sort, layer_norm over a sharded
normalized dim, nested-sharded flip/roll). Each submodule's docstring says
what moves.

``FUNCTIONS`` (from :mod:`.grad`) take over cumprod, cummax, cummin, sort and
topk above autograd, because their ATen backward formulas scatter into plain
full-size tensors.

Propagation: softmax/log_softmax and their backward, and sort, plan apart
from execution (``softmax.propagate``, ``select.propagate_sort``, served by
``propagation.plan``). The scans, topk, flip/roll and layer_norm still plan
inline while they run: not for
a reason of principle (their layouts depend on metadata only), they have not
been split yet.
"""

from __future__ import annotations

from . import grad, norms, order_stats, reorder, scans, select, softmax

RULES: dict = {}
for _module in (softmax, scans, select, reorder, norms, order_stats):
    RULES.update(_module.RULES)
FUNCTIONS: dict = {**grad.FUNCTIONS, **order_stats.FUNCTIONS}
#: ``propagation.plan`` entries: softmax and sort plan apart from execution; the other dim ops plan inline.
PROPAGATORS: dict = {**softmax.PROPAGATORS, **select.PROPAGATORS}
