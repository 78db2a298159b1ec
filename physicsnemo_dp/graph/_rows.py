"""Per-edge rows of node features: ``x[g.src]`` (ghost gather) and ``x[g.dst]`` (local).

Sources: each rank sends every peer the rows that peer's edges read (the plan
of :func:`~physicsnemo_dp.graph.build_graph`), in **one all-to-all moving
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

from .. import collectives
from .._torch_compat import Function
from ..rule_kit import to_layout, wrap
from ._graph import GraphIndex

__all__ = ["GraphRows", "graph_rows", "rows_backward"]


def _ghost_rows(graph, x_local: torch.Tensor) -> torch.Tensor:
    send = x_local.index_select(0, graph._send_rows)
    return collectives.all_to_all_v(send, graph._send_counts, graph.ghost_counts, graph.mesh, graph.mesh_dim)


def rows_local(gi: GraphIndex, x_local: torch.Tensor) -> torch.Tensor:
    """This rank's edge rows ``(E_r, ...)`` of node-layout local features ``x_local``."""
    g = gi.graph
    if gi.role == "dst":
        return x_local.index_select(0, g.dst_local)
    extended = torch.cat([x_local, _ghost_rows(g, x_local)])
    return extended.index_select(0, g.src_slot)


def graph_rows(gi: GraphIndex, x):
    """``x[index]`` for a node-layout ShardTensor ``x``: an edge-layout ShardTensor (no autograd)."""
    spec = x._spec
    out_spec = gi.graph.edge_spec((gi.graph.num_edges, *spec.global_shape[1:]), spec.tensor_meta.dtype)
    return wrap(rows_local(gi, x._local_tensor), out_spec)


def rows_backward(gi: GraphIndex, grad_local: torch.Tensor) -> torch.Tensor:
    """Node-layout local gradient of ``rows_local`` from the edge rows' gradient (one all-to-all for sources)."""
    g = gi.graph
    n = g.num_local_nodes
    rest = tuple(grad_local.shape[1:])
    if gi.role == "dst":
        return grad_local.new_zeros((n, *rest)).index_add_(0, g.dst_local, grad_local)
    slots = grad_local.new_zeros((n + g.num_ghosts, *rest)).index_add_(0, g.src_slot, grad_local)
    back = collectives.all_to_all_v(slots[n:], g.ghost_counts, g._send_counts, g.mesh, g.mesh_dim)
    return slots[:n].index_add_(0, g._send_rows, back)


class GraphRows(Function):
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
