"""Self loops and edge masks on a sharded graph: PyG's ``add_self_loops`` / ``remove_self_loops`` keep the ghost plan.

torch_geometric (2.8) writes its self-loop utilities with three tensor ops,
and this module makes each of them return a graph again, so a layer that
adds self loops (``GATConv``, ``PointNetConv``, ``GCNConv``: the default) keeps
the O(local) path of the graph it was given:

* ``edge_index[:, mask]`` (``remove_self_loops``, ``add_remaining_self_loops``)
  with ``edge_index`` a graph's and ``mask`` a boolean tensor in its edge
  layout: the generic rule's result (every rank keeps its own edges; one
  all-gather of the per-rank counts), as the ``edge_index`` of a **derived
  graph** whose ghost plan is the original's (a ghost no edge reads any more
  is still fetched: never more than before). Any other tensor masked that way
  (``edge_attr[mask]``) is tagged as edge rows of the masked layout (known from
  the mask when ``edge_index[:, mask]`` ran first, as in ``remove_self_loops``;
  else from the mask's layout matched against the graphs alive in the process,
  as in ``add_remaining_self_loops``, which masks its weights first).
* ``torch.cat([edge_index, loop_index], dim=1)`` with ``edge_index`` a graph's
  and ``loop_index`` every rank's same ``(2, N)`` tensor of rows
  ``arange(N)``: the edge list of the graph **with one loop per node, each
  kept by its node's owner**. Loops are local rows (source and destination a
  node of this rank): no new ghost, no communication, the ghost plan is the
  original's.
* ``torch.cat([edge_rows, loop_rows], dim=0)`` with ``edge_rows`` in a graph's
  edge layout (``g.edge_attr``, or a tensor masked as above) and ``loop_rows``
  ``N`` rows, replicated or in the graph's node layout (PyG's ``loop_attr``):
  the same interleaving, so edge attributes stay aligned with the edges.

**Edge order.** Concatenating at the end (``torch.cat``'s order) would put
all ``N`` loops in the last rank's slab: that rank would hold, gather and
scatter the whole node set. The loops are therefore kept at their owners and
the joined edge list is ordered **rank by rank, each rank's edges then its
nodes' loops** (the order ``build_graph`` gives when every rank lists its
edges and then its own nodes' loops). It is the same set of edges as
``torch.cat``'s, in another order: every per-node result (message passing,
softmax over a node's edges, aggregation) equals one process's, while the
joined edge list itself (``full_tensor()``, ``out[:, E:]``) is a permutation of
``torch.cat``'s. Both of PyG's joins (edge list and edge attributes) use the
same order, so they stay aligned; an edge tensor joined any other way (a
plain ``(E,)`` tensor concatenated outside the library) would not be.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from .. import _mesh_order
from .._torch_compat import Function
from ..rule_kit import normalize_dim, shard_tensor_cls, to_layout, wrap
from ..errors import PlacementError
from ._graph import _ATTR, ShardedGraph, live_graphs, tagged_graph

__all__ = [
    "EdgeRows",
    "edge_index_graph",
    "edge_mask_of",
    "masked_graph",
    "looped_graph",
    "tag_masked",
    "mark_mask",
    "join",
    "Interleave",
]

_ROWS = "_pdp_edge_rows"  # storage attribute: the EdgeRows of a masked edge tensor
_MASK = "_pdp_mask_rows"  # storage attribute of a mask: the EdgeRows of the edge list it masked
_SOURCE = "_pdp_mask_graph"  # storage attribute of a comparison of a graph's src/dst rows: (a weakref to) the graph


@dataclass(frozen=True)
class EdgeRows:
    """An edge layout (per-rank edge counts) and the node layout its loops join."""

    mesh: object
    mesh_dim: int
    edge_sizes: tuple
    node_sizes: tuple

    @property
    def num_nodes(self) -> int:
        return sum(self.node_sizes)

    @staticmethod
    def of(graph: ShardedGraph) -> "EdgeRows":
        return EdgeRows(graph.mesh, graph.mesh_dim, graph.edge_sizes, graph.node_sizes)


def _only_sharded(spec, mesh_dim: int, dim: int) -> bool:
    """``spec`` is ``Shard(dim)`` over ``mesh_dim`` and Replicate over every other mesh dim."""
    return all((p == Shard(dim)) if m == mesh_dim else p.is_replicate() for m, p in enumerate(spec.placements))


def _replicated(spec) -> bool:
    return all(p.is_replicate() for p in spec.placements)


# --------------------------------------------------------------------------- #
# recognising a graph's edge list and edge rows
# --------------------------------------------------------------------------- #
def edge_index_graph(t) -> ShardedGraph | None:
    """The graph whose ``edge_index`` ``t`` is (the whole ``(2, E)`` view), else None."""
    graph = tagged_graph(t)
    if graph is None or t._local_tensor.ndim != 2:
        return None
    local = t._local_tensor
    n = graph.num_local_edges
    if local.storage_offset() != 0 or tuple(local.shape) != (2, n) or (n and local.stride() != (n + 1, 1)):
        return None
    ref_spec = graph.edge_index._spec
    if (
        t._spec.placements != ref_spec.placements
        or t._spec.dim_sizes != ref_spec.dim_sizes
        or t._spec.mesh != graph.mesh
    ):
        return None
    if graph._index_versions() != graph._versions:
        raise PlacementError(
            "the edge_index of a ShardedGraph was modified in place; the graph's plan no longer matches its "
            "values. Build a new graph (build_graph) instead of editing g.edge_index"
        )
    return graph


def edge_mask_of(mask, graph: ShardedGraph):
    """``graph`` if ``mask`` is a 1-D boolean ShardTensor in its edge layout, else None."""
    if not isinstance(mask, shard_tensor_cls()) or mask.dtype != torch.bool or mask.ndim != 1:
        return None
    spec = mask._spec
    if spec.mesh != graph.mesh or not _only_sharded(spec, graph.mesh_dim, 0) or spec.dim_sizes[0] != graph.edge_sizes:
        return None
    return graph


def _edge_mask_graphs(mask) -> list:
    """Live graphs whose edge layout ``mask`` (a 1-D boolean ShardTensor) has."""
    return [g for g in live_graphs() if edge_mask_of(mask, g) is not None]


def _unambiguous(rows: EdgeRows) -> bool:
    """A layout-only match counts when every live graph of that edge layout has the same nodes, and the edge
    layout is not also the node layout (then a node tensor could not be told from an edge tensor)."""
    if rows.edge_sizes == rows.node_sizes:
        return False

    def node_layouts() -> set:
        return {
            g.node_sizes
            for g in live_graphs()
            if g.mesh == rows.mesh and g.mesh_dim == rows.mesh_dim and g.edge_sizes == rows.edge_sizes
        }

    same = node_layouts()
    if len(same) > 1:
        # graphs sit in reference cycles (their index tensors point back at them), so dropped ones linger until
        # the cycle collector runs: collect once before calling the match ambiguous
        gc.collect()
        same = node_layouts()
    return len(same) == 1


def edge_rows(t, dim: int) -> EdgeRows | None:
    """The edge layout ``t`` has along ``dim`` (a graph's edge tensor, or one masked from it), else None.

    Known from ``t`` itself (``g.edge_attr`` carries its graph; a masked tensor carries its layout), else from
    the layout alone, matched against the graphs alive in the process (:func:`._graph.live_graphs`).
    """
    spec = t._spec
    tag = getattr(t._local_tensor.untyped_storage(), _ROWS, None)
    graph = getattr(t, _ATTR, None)  # g.src / g.dst / g.edge_attr carry their graph
    strong = ([tag] if tag is not None else []) + ([EdgeRows.of(graph)] if isinstance(graph, ShardedGraph) else [])
    weak = [EdgeRows.of(g) for g in live_graphs()]
    for rows, known in [(r, True) for r in strong] + [(r, False) for r in weak]:
        if (
            rows.mesh == spec.mesh
            and _only_sharded(spec, rows.mesh_dim, dim)
            and spec.dim_sizes[dim] == rows.edge_sizes
        ):
            return rows if known or _unambiguous(rows) else None
    return None


def tag_masked(out, mask) -> None:
    """Mark ``out`` (``t[mask]``) as edge rows of the masked layout when ``mask`` is in a graph's edge layout.

    Known from the mask (``edge_index[:, mask]`` ran first and marked it), else from its layout alone.
    """
    if not isinstance(out, shard_tensor_cls()):
        return
    known = getattr(mask._local_tensor.untyped_storage(), _MASK, None)
    spec = out._spec
    if known is not None and _only_sharded(spec, known.mesh_dim, 0) and spec.dim_sizes[0] == known.edge_sizes:
        setattr(out._local_tensor.untyped_storage(), _ROWS, known)
        return
    source = getattr(mask._local_tensor.untyped_storage(), _SOURCE, None)
    g = source() if source is not None else None
    if g is None or edge_mask_of(mask, g) is None:
        graphs = _edge_mask_graphs(mask)
        if not graphs or not _unambiguous(EdgeRows.of(graphs[0])):
            return
        g = graphs[0]
    if spec.mesh == g.mesh and _only_sharded(spec, g.mesh_dim, 0):
        rows = EdgeRows(g.mesh, g.mesh_dim, tuple(spec.dim_sizes[0]), g.node_sizes)
        setattr(out._local_tensor.untyped_storage(), _ROWS, rows)


def mark_comparison(out, graph: ShardedGraph) -> None:
    """Remember on ``out`` (a comparison of ``graph``'s ``src`` / ``dst`` rows, e.g. PyG's
    ``edge_index[0] != edge_index[1]``) the graph whose edge layout it has, so a tensor masked with it is known
    as that graph's edge rows without matching layouts against every live graph."""
    if isinstance(out, shard_tensor_cls()) and out.dtype == torch.bool and edge_mask_of(out, graph) is not None:
        setattr(out._local_tensor.untyped_storage(), _SOURCE, weakref.ref(graph))


def mark_mask(mask, derived: ShardedGraph) -> None:
    """Remember on ``mask`` the edge layout it made (``edge_index[:, mask]``) for later ``t[mask]``."""
    setattr(mask._local_tensor.untyped_storage(), _MASK, EdgeRows.of(derived))


# --------------------------------------------------------------------------- #
# derived graphs
# --------------------------------------------------------------------------- #
def _derived(graph: ShardedGraph, edge_sizes, src, dst, slot, dst_local) -> ShardedGraph:
    """A graph of the same nodes and ghost plan with this rank's edges ``(src, dst)`` (slots given)."""
    n = src.shape[0]
    buffer = torch.empty(2 * n + 1, dtype=torch.int64, device=src.device)
    buffer[:n] = src
    buffer[n] = -1
    buffer[n + 1 :] = dst
    plan = dataclasses.replace(graph.plan, slot=slot)
    return ShardedGraph(
        nodes_spec=graph.nodes_spec,
        mesh_dim=graph.mesh_dim,
        edge_sizes=edge_sizes,
        buffer=buffer,
        edge_attr=None,
        plan=plan,
        dst_local=dst_local,
    )


def masked_graph(graph: ShardedGraph, keep: torch.Tensor, edge_sizes) -> ShardedGraph:
    """``graph`` keeping the local edges where ``keep`` (this rank's boolean mask) is True."""
    n = graph.num_local_edges
    buf = graph._buffer
    return _derived(
        graph, tuple(edge_sizes), buf[:n][keep], buf[n + 1 :][keep], graph.src_slot[keep], graph.dst_local[keep]
    )


def looped_graph(graph: ShardedGraph) -> ShardedGraph:
    """``graph`` plus one self loop per node, kept by its owner after its edges (cached on ``graph``)."""
    cached = getattr(graph, "_looped", None)
    looped = cached() if cached is not None else None
    if looped is not None:
        return looped
    n = graph.num_local_edges
    buf = graph._buffer
    local = torch.arange(graph.num_local_nodes, dtype=torch.int64, device=buf.device)
    ids = local + graph.node_offset
    sizes = tuple(e + k for e, k in zip(graph.edge_sizes, graph.node_sizes))
    looped = _derived(
        graph,
        sizes,
        torch.cat([buf[:n], ids]),
        torch.cat([buf[n + 1 :], ids]),
        torch.cat([graph.src_slot, local]),
        torch.cat([graph.dst_local, local]),
    )
    graph._looped = weakref.ref(looped)
    return looped


def _are_loops(t, num_nodes: int) -> bool:
    """``t`` is every rank's same ``(2, N)`` integer tensor with both rows ``arange(N)`` (PyG's ``loop_index``)."""
    if not isinstance(t, shard_tensor_cls()) or not _replicated(t._spec):
        return False
    local = t._local_tensor
    if (
        tuple(local.shape) != (2, num_nodes)
        or local.is_floating_point()
        or local.is_complex()
        or local.dtype == torch.bool
    ):
        return False
    ids = torch.arange(num_nodes, dtype=local.dtype, device=local.device)
    return bool(torch.equal(local[0], ids) and torch.equal(local[1], ids))


# --------------------------------------------------------------------------- #
# torch.cat
# --------------------------------------------------------------------------- #
def _loop_rows(b, rows: EdgeRows, dim: int):
    """This rank's rows of the loop operand ``b`` along ``dim``, or None if ``b`` is not in a fitting layout."""
    spec = b._spec
    if spec.mesh != rows.mesh or b.ndim <= dim or b.shape[dim] != rows.num_nodes:
        return None
    if _replicated(spec):
        graph_rank = _coordinate(rows)
        offset = sum(rows.node_sizes[:graph_rank])
        return b._local_tensor.narrow(dim, offset, rows.node_sizes[graph_rank])
    if _only_sharded(spec, rows.mesh_dim, dim) and tuple(spec.dim_sizes[dim]) == rows.node_sizes:
        return b._local_tensor
    return None


def _coordinate(rows: EdgeRows) -> int:
    return _mesh_order.coordinate(rows.mesh, rows.mesh_dim)


def _joined_spec(a_spec, rows: EdgeRows, dim: int, shape):
    sizes = tuple(e + k for e, k in zip(a_spec.dim_sizes[dim], rows.node_sizes))
    tables = tuple(sizes if d == dim else t for d, t in enumerate(a_spec.dim_sizes))
    return type(a_spec).from_sizes(a_spec.mesh, a_spec.placements, tuple(shape), a_spec.tensor_meta.dtype, tables)


class Interleave(Function):
    """``torch.cat([edge_rows, loop_rows], dim)`` in the looped graph's edge order (each rank: edges, then loops)."""

    @staticmethod
    def forward(a, b, rows, dim, b_local):
        local = torch.cat([a._local_tensor, b_local], dim)
        shape = list(a.shape)
        shape[dim] += b.shape[dim]
        spec = _joined_spec(a._spec, rows, dim, shape)
        out = wrap(local, spec)
        setattr(
            local.untyped_storage(), _ROWS, EdgeRows(rows.mesh, rows.mesh_dim, spec.dim_sizes[dim], rows.node_sizes)
        )
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, rows, dim, _ = inputs
        ctx.a_spec, ctx.b_spec, ctx.out_spec, ctx.rows, ctx.dim = a._spec, b._spec, output._spec, rows, dim

    @staticmethod
    def backward(ctx, grad):
        local = to_layout(grad, ctx.out_spec)
        dim, rows = ctx.dim, ctx.rows
        n_edges = ctx.a_spec.local_shape[dim]
        ga = local.narrow(dim, 0, n_edges)
        gb = local.narrow(dim, n_edges, local.shape[dim] - n_edges)
        grad_a = wrap(ga.contiguous(), ctx.a_spec)
        b_spec = ctx.b_spec
        if not _replicated(b_spec):
            return grad_a, wrap(gb.contiguous(), b_spec), None, None, None
        # a replicated loop operand: each rank holds its own nodes' gradient rows; the sum over the graph's
        # mesh dim is pending (Partial), reduced by whoever reads it (a promoted plain tensor's Promote step)
        whole = gb.new_zeros(tuple(b_spec.global_shape))
        rank = _coordinate(rows)
        whole.narrow(dim, sum(rows.node_sizes[:rank]), rows.node_sizes[rank]).copy_(gb)
        placements = tuple(Partial() if m == rows.mesh_dim else p for m, p in enumerate(b_spec.placements))
        return grad_a, wrap(whole, b_spec.with_layout(placements, b_spec.dim_sizes)), None, None, None


def join(tensors, dim):
    """``torch.cat(tensors, dim)`` when it joins a graph's edges with its loops; None for every other call."""
    ShardTensor = shard_tensor_cls()
    if len(tensors) != 2 or not all(isinstance(t, ShardTensor) for t in tensors) or not isinstance(dim, int):
        return None
    a, b = tensors
    if a.ndim == 0 or b.ndim != a.ndim:
        return None
    d = normalize_dim(dim, a.ndim)
    graph = edge_index_graph(a) if d == 1 else None
    if graph is not None:
        if not _are_loops(b, graph.num_nodes):
            return None
        return looped_graph(graph).edge_index
    rows = edge_rows(a, d)
    if rows is None:
        return None
    b_local = _loop_rows(b, rows, d)
    if b_local is None:
        return None
    if tuple(a.shape[:d]) + tuple(a.shape[d + 1 :]) != tuple(b.shape[:d]) + tuple(b.shape[d + 1 :]):
        return None  # torch.cat's own error
    return Interleave.apply(a, b, rows, d, b_local)
