"""Per-edge rows of node features: ``x[g.src]`` (ghost gather) and ``x[g.dst]`` (local).

Sources: each rank sends every peer the rows that peer's edges read (the row
plan of :func:`~physicsnemo_dp.graph.build_graph`, :mod:`._requests`), in **one all-to-all moving
exactly the ghost rows**, then reads its edges' rows from ``[local | ghosts]``.
The backward mirrors it: edge gradients are summed into ``[local | ghosts]``
slots, the ghost slots go back to their owners in one all-to-all and are added
to the owners' rows. Destinations are local rows both ways.

Memory per rank: the local rows, the ghost rows and the edge rows, never a
tensor of the global node or edge count. The autograd Function keeps this in
the backward too (ATen's backward of ``index_select`` would start from a
zero tensor of the global shape).
"""

from __future__ import annotations

import torch

from .._torch_compat import SubclassFunction
from ..rule_kit import to_layout, wrap
from ._graph import GraphIndex
from ._requests import fetch_rows, return_grads, table

__all__ = ["GraphRows", "graph_rows", "rows_backward"]


def rows_local(gi: GraphIndex, x_local: torch.Tensor) -> torch.Tensor:
    """This rank's edge rows ``(E_r, ...)`` of node-layout local features ``x_local``."""
    if gi.role == "dst":
        return x_local.index_select(0, table(gi.graph.dst_local, x_local))
    if _alone(gi.graph):  # every source is a local row: no ghosts, no [local | ghosts] copy, no all-to-all
        return x_local.index_select(0, table(gi.graph.plan.slot, x_local))
    return fetch_rows(gi.graph.plan, x_local)


def _alone(graph) -> bool:
    """Whether one rank holds the whole graph (its mesh dim has size 1; kept on the graph)."""
    alone = graph.__dict__.get("_alone")
    if alone is None:
        alone = graph.__dict__["_alone"] = graph.mesh.size(graph.mesh_dim) == 1
    return alone


def graph_rows(gi: GraphIndex, x):
    """``x[index]`` for a node-layout ShardTensor ``x``: an edge-layout ShardTensor (no autograd)."""
    spec = x._spec
    out_spec = gi.graph.edge_spec((gi.graph.num_edges, *spec.global_shape[1:]), spec.tensor_meta.dtype)
    return wrap(rows_local(gi, x._local_tensor), out_spec)


def rows_backward(gi: GraphIndex, grad_local: torch.Tensor) -> torch.Tensor:
    """Node-layout local gradient of ``rows_local`` from the edge rows' gradient (one all-to-all for sources)."""
    g = gi.graph
    if gi.role == "dst" or _alone(g):
        # Local rows only: summed as torch's own backward of ``x[index]`` sums them (index_put_ with accumulate,
        # which also reads a strided gradient, a slice of a cat's, at the speed of a contiguous one).
        rows = table(g.dst_local if gi.role == "dst" else g.plan.slot, grad_local)
        rest = tuple(grad_local.shape[1:])
        return grad_local.new_zeros((g.num_local_nodes, *rest)).index_put_((rows,), grad_local, accumulate=True)
    return return_grads(g.plan, grad_local)


class GraphRows(SubclassFunction):
    """Differentiable :func:`graph_rows`: ``x[g.src]`` / ``x[g.dst]`` on node-layout ``x``."""

    @staticmethod
    def forward(x, gi):
        return graph_rows(gi, x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gi = inputs
        ctx.gi = gi
        ctx.x_spec = x._spec
        ctx.out_spec = output._spec

    @staticmethod
    def backward(ctx, grad):
        local = to_layout(grad, ctx.out_spec)
        return wrap(rows_backward(ctx.gi, local), ctx.x_spec), None
