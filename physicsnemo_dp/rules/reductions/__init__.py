"""Reductions over sharded and unsharded dims, on shards of any sizes.

Communication, per call, over the mesh dims that shard a reduced dim (none
when only unsharded dims are reduced; kept dims keep their shards). Only
reduced-size tensors ever move:

==================================  ==========================================  ===========================
op                                  forward                                     backward
==================================  ==========================================  ===========================
sum, mean, nansum                   nothing: the result is ``Partial("sum")``   nothing (local expand)
count_nonzero                       nothing: ``Partial("sum")``                 (not differentiable)
amax, amin, max(), min()            one all-gather of per-rank results          one all-reduce (tie count)
prod                                one all-gather                              one all-gather, one all-reduce
logsumexp                           one all-gather                              nothing
norm, vector_norm                   one all-gather                              nothing (inf norms: one)
any, all                            one all-gather                              (not differentiable)
max(dim), min(dim)                  two all-gathers (values, global indices)    nothing
argmax, argmin                      two all-gathers                             (not differentiable)
var, std, var_mean, std_mean        two all-reduces (sum, squared deviations)   one all-reduce (the mean)
==================================  ==========================================  ===========================

Backward: ``sum``/``mean``/``nansum``/``max(dim)``/``min(dim)``/``prod`` have
Functions whose gradients are built in the input's layout (``functions``);
the others use ATen's derivative formulas, which run on ShardTensors through
the elementwise, view and reduction rules (the table counts those).

``rules`` holds the dispatch rules, ``functions`` the function-level handlers,
``_layout`` the shape arithmetic and ``_combine`` the communication.

Planning is apart from execution (``_propagate``): a pure function of the
op, the input's spec and the other arguments, memoised, gives the output specs
and the forward collectives of the table above; the rules look it up and run
it, and ``propagation.plan`` answers with it. The function-level handlers
(autograd Functions) reach the same rules for their forward.
"""

from .functions import FUNCTIONS
from .rules import PROPAGATORS, RULES

__all__ = ["FUNCTIONS", "PROPAGATORS", "RULES"]
