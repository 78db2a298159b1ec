"""``ShardedGraph``: the edges of one node partition, placed at their destination's owner, and its ghost plan.

A graph is built once per node partition (:func:`~physicsnemo_dp.graph.build_graph`)
and is reusable for every step and every feature tensor of that partition:
nothing in it depends on feature values, only on the layout of dim 0 of the
node tensors it was built for.

How ops recognise "index ShardTensors that carry their graph": the graph's
index tensors (``src``, ``dst`` and ``edge_index``) are views of one private
int64 buffer, laid out ``[src | 1 pad | dst]``, whose storage carries a weak
reference to the graph as a Python attribute. Every local view the rules take
of them (``edge_index[0]``, ``.view(-1, 1)``, ``.expand_as(msg)``,
``.unsqueeze``) shares that storage, and torch keeps one Python object per
storage, attribute included. :func:`graph_of` reads the graph back from an
index's local tensor and says which row the view shows by its storage offset
(0: sources, ``E_r + 1``: destinations; the pad keeps the two apart even on a
rank without edges). The view must show that row along dim 0 with every
other dim broadcast (stride 0), and the index's spec must be the graph's
edge layout, so the answer depends only on metadata every rank shares.
Anything else (a copy, ``repeat``, a slice of the row) is an ordinary index
and takes the generic indexing rules: correct, but O(global edges) per rank.

The reference is weak (a strong one from a storage would never be
collected); ``src``, ``dst``, ``edge_index`` and ``edge_attr`` hold the graph
strongly, so it lives as long as the graph object or any of them does.
In-place edits of ``src`` / ``dst`` / ``edge_index`` (or of views of them)
are caught by their version counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import weakref

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from .. import _layout, _mesh_order
from .._torch_compat import torch_function_disabled
from ..errors import PlacementError
from ..rule_kit import carry_storage_tag, shard_tensor_cls, wrap

__all__ = ["ShardedGraph", "graph_of", "tagged_graph", "live_graphs"]

_ATTR = "_pdp_sharded_graph"
carry_storage_tag(_ATTR)  # torch.compile's stand-ins of the index tensors keep their graph
_LIVE: "weakref.WeakSet[ShardedGraph]" = weakref.WeakSet()  # every graph alive (edge layouts of masks and joins)


def live_graphs() -> list:
    """The graphs alive in this process (built or derived), in no particular order."""
    return list(_LIVE)


class ShardedGraph:
    """The edges of a node-sharded graph, each stored at the rank owning its destination.

    Build with :func:`~physicsnemo_dp.graph.build_graph` (or ``knn`` / ``radius``).
    Rank ``r`` holds the edges whose destination it owns, ordered by sending
    rank, then by their order at the sender. Attributes:

    * ``src``, ``dst``: int64 ShardTensors ``(E,)``, ``Shard(0)`` over the node
      mesh dim with the per-rank edge counts ``edge_sizes``; values are global
      node ids. ``x[g.src]`` / ``x.index_select(0, g.src)`` move exactly the
      ghost rows; ``x[g.dst]`` and aggregation with ``g.dst`` (``index_add``,
      ``scatter_add``, ``scatter_reduce``) are local.
    * ``edge_index``: ``(2, E)`` ``Shard(1)``, rows ``src`` and ``dst`` (PyG layout).
    * ``edge_attr``: ``(E, ...)`` ``Shard(0)`` ShardTensor travelled with the edges, or None.
    * ``num_nodes``, ``node_sizes``, ``num_edges``, ``edge_sizes``, ``nodes_spec``,
      ``mesh``, ``mesh_dim`` (the mesh dim that shards the nodes).
    * Ghost plan of this rank: ``ghost_ids`` (sorted global ids of the remote
      sources its edges read), ``ghost_counts`` (how many come from each peer of
      the node mesh dim), ``num_ghosts``, and ``src_slot`` (per local edge, its
      source's row in ``[local rows | ghost rows]``) and ``dst_local`` (per local
      edge, its destination's local row).
    """

    def __init__(self, *, nodes_spec, mesh_dim: int, edge_sizes, buffer: torch.Tensor, edge_attr,
                 plan, dst_local: torch.Tensor) -> None:
        self.nodes_spec = nodes_spec
        self.mesh = nodes_spec.mesh
        self.mesh_dim = mesh_dim
        self.num_nodes = nodes_spec.global_shape[0]
        self.node_sizes = tuple(nodes_spec.dim_sizes[0])
        self.rank = _mesh_order.coordinate(self.mesh, mesh_dim)  # this rank's index in the size tables
        self.node_offset = sum(self.node_sizes[: self.rank])
        self.num_local_nodes = self.node_sizes[self.rank]
        self.edge_sizes = tuple(int(s) for s in edge_sizes)
        self.num_edges = sum(self.edge_sizes)
        self.num_local_edges = self.edge_sizes[self.rank]
        self.plan = plan  # the sources' row plan (._requests.RowPlan)
        self.ghost_ids = plan.ghost_ids
        self.ghost_counts = plan.ghost_counts
        self.num_ghosts = plan.num_ghosts
        self.src_slot = plan.slot
        self.dst_local = dst_local
        n = self.num_local_edges
        self._buffer = buffer
        setattr(buffer.untyped_storage(), _ATTR, weakref.ref(self))
        edge_spec = self.edge_spec((self.num_edges,), torch.int64)
        self.src = wrap(buffer[:n], edge_spec)
        self.dst = wrap(buffer[n + 1:], edge_spec)
        ei_spec = type(edge_spec).from_sizes(
            self.mesh, self._placements(1), (2, self.num_edges), torch.int64, (None, self.edge_sizes)
        )
        self.edge_index = wrap(buffer.as_strided((2, n), (n + 1, 1)), ei_spec)
        self.edge_attr = None
        if edge_attr is not None:
            spec = self.edge_spec((self.num_edges, *edge_attr.shape[1:]), edge_attr.dtype)
            self.edge_attr = wrap(edge_attr, spec)
        for t in (self.src, self.dst, self.edge_index, self.edge_attr):
            if t is not None:
                setattr(t, _ATTR, self)  # tensor attributes are collected with their cycles
        self._versions = self._index_versions()
        _LIVE.add(self)

    def _index_versions(self) -> tuple:
        # In-place ops bump the version of the wrappers (and of their views taken above autograd);
        # the rules' local writes below autograd do not bump the buffer's.
        # Read with subclass torch-function off: on a ShardTensor each ``_version`` read is a trip through
        # __torch_function__ (~2-10 us), and every graph gather and scatter checks three of them.
        with torch_function_disabled():
            return tuple(t._version for t in (self.src, self.dst, self.edge_index))

    # ------------------------------------------------------------------ layouts
    def _placements(self, dim: int):
        """Placements of a tensor sharded along ``dim`` like the graph (kept: compared on every gather)."""
        cache = self.__dict__.setdefault("_placements_of", {})
        hit = cache.get(dim)
        if hit is None:
            hit = cache[dim] = tuple(
                _layout.interned(Shard(dim) if m == self.mesh_dim else Replicate()) for m in range(self.mesh.ndim)
            )
        return hit

    def edge_spec(self, shape, dtype):
        """Spec of an edge-aligned tensor of global ``shape`` (dim 0 = the ``E`` edges), like ``src``."""
        return self._row_spec("edges", tuple(shape), dtype)

    def node_spec(self, shape, dtype):
        """Spec of a node-aligned tensor of global ``shape`` (dim 0 = the ``N`` nodes) in the graph's layout."""
        return self._row_spec("nodes", tuple(shape), dtype)

    def is_node_spec(self, spec) -> bool:
        """Whether ``spec`` is the graph's own node-layout spec of its shape and dtype (an identity; builds nothing)."""
        cache = self.__dict__.get("_row_specs")
        return cache is not None and cache.get(("nodes", spec.global_shape, spec.tensor_meta.dtype)) is spec

    def _row_spec(self, kind, shape, dtype):
        """The spec of ``kind`` ("edges" / "nodes") rows (kept per shape and dtype: one object per layout, so the plans that
        later ops memoise on a spec's identity are found again, and no spec is rebuilt per gather or scatter)."""
        cache = self.__dict__.setdefault("_row_specs", {})
        key = (kind, shape, dtype)
        hit = cache.get(key)
        if hit is None:
            sizes = self.edge_sizes if kind == "edges" else self.node_sizes
            if len(cache) >= 256:
                cache.clear()
            hit = cache[key] = type(self.nodes_spec).from_sizes(
                self.mesh, self._placements(0), shape, dtype, (sizes,) + (None,) * (len(shape) - 1)
            )
        return hit

    @property
    def edge_offset(self) -> int:
        """Global position of this rank's first edge."""
        return sum(self.edge_sizes[: self.rank])

    def check_nodes(self, spec, name: str, allow_replicated: bool = False) -> None:
        """Raise ``PlacementError`` unless dim 0 of ``spec`` is laid out as this graph's nodes.

        With ``allow_replicated``, a tensor replicated over the graph's mesh dim
        passes if it has ``num_nodes`` rows. Metadata only: every rank raises alike.
        """
        self._check_mesh(spec, name)
        if allow_replicated and not issubclass(type(spec.placements[self.mesh_dim]), Shard):
            if spec.global_shape[0] != self.num_nodes:
                raise PlacementError(
                    f"{name} has {spec.global_shape[0]} rows but the graph has {self.num_nodes} nodes; "
                    f"allocate it with one row per node (e.g. x.new_zeros(x.shape))"
                )
            return
        sizes = spec.dim_sizes[0] if spec.dim_sizes else None
        if (spec.placements[self.mesh_dim] != Shard(0) or sizes != self.node_sizes
                or spec.global_shape[0] != self.num_nodes):
            raise PlacementError(
                f"{name} is not laid out like the graph's nodes: {name} has {spec.global_shape[0]} rows "
                f"with placements {spec.placements} and shard sizes {sizes}, the graph was built for "
                f"{self.num_nodes} nodes sharded over mesh dim {self.mesh_dim} as {self.node_sizes}; "
                f"build the graph for this partition (build_graph(edge_index, {name})) or redistribute {name}"
            )

    def check_edges(self, spec, name: str, allow_replicated: bool = False) -> None:
        """Raise ``PlacementError`` unless dim 0 of ``spec`` holds this graph's ``E`` edges in its layout.

        With ``allow_replicated``, a tensor replicated over the graph's mesh dim passes.
        """
        self._check_mesh(spec, name)
        if spec.global_shape[0] != self.num_edges:
            raise PlacementError(
                f"{name} has {spec.global_shape[0]} rows but the graph has {self.num_edges} edges: "
                f"{name} must hold one row per edge of the graph its index comes from"
            )
        p = spec.placements[self.mesh_dim]
        if (issubclass(type(p), Shard) and (p.dim != 0 or spec.dim_sizes[0] != self.edge_sizes)) or (
                not issubclass(type(p), Shard) and not allow_replicated):
            raise PlacementError(
                f"{name} is laid out as {spec.placements} with sizes {spec.dim_sizes}, but the graph's "
                f"{self.num_edges} edges are sharded along dim 0 as {self.edge_sizes}: {name} belongs to "
                f"another graph (use index tensors and messages of the same graph in one op)"
            )

    def _check_mesh(self, spec, name: str) -> None:
        if spec.mesh != self.mesh:
            raise PlacementError(
                f"{name} lives on mesh {tuple(spec.mesh.shape)}{spec.mesh.mesh_dim_names or ''} but the graph "
                f"was built on mesh {tuple(self.mesh.shape)}{self.mesh.mesh_dim_names or ''}; build the graph "
                f"for {name}'s layout (build_graph(edge_index, {name}))"
            )

    def __repr__(self) -> str:
        return (
            f"ShardedGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, node_sizes={self.node_sizes}, "
            f"edge_sizes={self.edge_sizes}, ghosts on this rank={self.num_ghosts}, mesh_dim={self.mesh_dim})"
        )


@dataclass(frozen=True)
class GraphIndex:
    """An index tensor recognised as one row of a graph: ``role`` is ``"src"`` or ``"dst"``."""

    graph: ShardedGraph
    role: str

    def local_dst(self, local: torch.Tensor) -> torch.Tensor:
        """The graph's local destination rows in the shape of the ``dst`` view ``local``.

        Aggregations use these instead of the index's values (global ids), which are never read.
        """
        from ._requests import table

        rows = table(self.graph.dst_local, local)
        return rows.reshape((-1,) + (1,) * (local.ndim - 1)).expand(local.shape)


def tagged_graph(t) -> ShardedGraph | None:
    """The live graph whose index buffer ``t``'s local storage is (any view of it), else None."""
    if not isinstance(t, shard_tensor_cls()):
        return None
    ref = getattr(t._local_tensor.untyped_storage(), _ATTR, None)
    return ref() if ref is not None else None


#: Attribute of an index ShardTensor holding ``(local tensor, spec, GraphIndex)`` of its last recognition.
_MEMO = "_pdp_graph_index"


def graph_of(index) -> GraphIndex | None:
    """The graph row that ``index`` shows, or None for any other index (see the module docstring).

    The answer is kept on the index tensor (~3 us a call less; every graph op asks) and reused while the
    tensor holds the same local tensor and spec objects (an in-place view op replaces the spec); the check
    that the graph's index tensors were not written in place runs on every call.
    """
    memo = getattr(index, _MEMO, None)
    if memo is not None and memo[0] is index._local_tensor and memo[1] is index._spec:
        graph = memo[2].graph
        if graph._index_versions() != graph._versions:
            _raise_modified()
        return memo[2]
    graph = tagged_graph(index)
    local = index._local_tensor if graph is not None else None
    if graph is None or local.ndim == 0:
        return None
    n = graph.num_local_edges
    offset = local.storage_offset()
    role = "src" if offset == 0 else "dst" if offset == n + 1 else None
    if role is None or local.shape[0] != n or (n > 1 and local.stride(0) != 1):
        return None
    if any(s != 0 and k != 1 for s, k in zip(local.stride()[1:], local.shape[1:])):
        return None
    spec = index._spec
    if (spec.mesh != graph.mesh or spec.global_shape[0] != graph.num_edges
            or spec.placements != graph._placements(0) or spec.dim_sizes[0] != graph.edge_sizes
            or any(t is not None for t in spec.dim_sizes[1:])):
        return None
    if graph._index_versions() != graph._versions:
        _raise_modified()
    gi = GraphIndex(graph, role)
    setattr(index, _MEMO, (local, spec, gi))
    return gi


def _raise_modified():
    raise PlacementError(
        "an index tensor of a ShardedGraph was modified in place; the graph's plan no longer matches "
        "its values. Build a new graph (build_graph) instead of editing g.src / g.dst / g.edge_index"
    )
