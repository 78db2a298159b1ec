"""The graph of a prepared mesh, built from the cells each rank reads, cached per (file, partition).

A :class:`~datapipes.MeshSource` gives rank ``r`` the cells *owned* by its
point range (a cell's owner is its smallest point, see :mod:`datapipes.mesh`).
A graph network wants edges instead: every pair of points joined by a cell
side, in both directions, each exactly once. An edge can lie in cells of two
ranks (a side shared by a cell owned by rank ``r`` and one owned by ``r + 1``),
so local de-duplication is not enough. :func:`mesh_edges` sends every
undirected edge ``{a < b}`` it derived to the rank owning ``a`` (the lowest
point: owner ranks only grow along the curve, so this is a neighbour in
practice), which keeps one copy and emits ``a -> b`` and ``b -> a``: one
small all-to-all of edge keys. :func:`~physicsnemo_dp.graph.build_graph`
then moves each directed edge to the rank owning its destination.

:func:`mesh_graph` adds MeshGraphNet's edge features (the displacement
``p_src - p_dst`` and its length), computed with ``points[g.src]`` on the
ShardTensors: the ghost rows of the points move once. :class:`MeshGraphCache`
keeps the result per sample file and partition, so an epoch after the first
pays for neither.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import torch

from physicsnemo_dp import Shard, ShardTensor
from physicsnemo_dp.collectives import all_to_all_v
from physicsnemo_dp.graph import ShardedGraph, build_graph

from .agreement import check_all_ranks
from .errors import DataPipeError
from .mesh import MeshSource
from .pipe import Batch

__all__ = ["MeshGraph", "MeshGraphCache", "cell_edges", "mesh_edges", "mesh_graph"]


@dataclass(frozen=True)
class MeshGraph:
    """A sample's :class:`~physicsnemo_dp.graph.ShardedGraph` and its edge features.

    Attributes:
        graph: edges ``src -> dst`` at the rank owning ``dst``.
        edge_features: ShardTensor ``(E, ndim + 1)`` aligned with ``graph.src``:
            ``p_src - p_dst`` and its Euclidean length.
    """

    graph: ShardedGraph
    edge_features: ShardTensor


def cell_edges(cells: torch.Tensor, pairs: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Undirected edges ``(2, M)`` (row 0 < row 1, sorted, unique) joining the points of ``cells`` ``(C, k)``.

    Args:
        cells: point indices per cell.
        pairs: which corners of a cell are joined (default: every pair, right
            for lines, triangles and tetrahedra; pass the sides for quads or
            hexahedra, e.g. ``((0, 1), (1, 2), (2, 3), (3, 0))``). Corners ``-1``
            (the padding of mixed cells, see :mod:`datapipes.mesh_formats`) are
            skipped, so mixed lines, triangles and tetrahedra work with the default.

    Raises:
        DataPipeError: ``cells`` is not a 2-D integer tensor, or a pair names
            a corner the cells do not have.
    """
    if cells.ndim != 2 or cells.dtype.is_floating_point or cells.dtype == torch.bool:
        raise DataPipeError(f"cells must be an integer tensor (n_cells, k), got {cells.dtype} {tuple(cells.shape)}")
    k = cells.shape[1]
    pairs = tuple(combinations(range(k), 2)) if pairs is None else tuple(tuple(p) for p in pairs)
    if any(len(p) != 2 or not all(0 <= c < k for c in p) for p in pairs):
        raise DataPipeError(f"pairs must be (i, j) corner indices in [0, {k}) of a cell, got {pairs}")
    if not pairs or cells.shape[0] == 0:
        return torch.empty(2, 0, dtype=torch.int64, device=cells.device)
    cells = cells.to(torch.int64)
    first = torch.cat([cells[:, i] for i, _ in pairs])
    second = torch.cat([cells[:, j] for _, j in pairs])
    low, high = torch.minimum(first, second), torch.maximum(first, second)
    keep = (low != high) & (low >= 0)  # no edge to a repeated corner (degenerate cell) or to padding (-1)
    return _unique_pairs(low[keep], high[keep])


def _unique_pairs(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Sorted unique ``(low, high)`` columns (lexicographic order, so sorted by ``low`` first)."""
    if low.numel() == 0:
        return torch.stack([low, high])
    scale = int(high.max()) + 1
    keys = torch.unique(low * scale + high)  # sorted
    return torch.stack([keys // scale, keys % scale])


def _node_dim(points: ShardTensor) -> int:
    """The mesh dim that splits ``points``' dim 0 (the layout a graph is built for)."""
    if not isinstance(points, ShardTensor) or points.ndim != 2:
        raise DataPipeError(f"points must be a (n_points, ndim) ShardTensor, got {type(points).__name__} "
                            f"of shape {tuple(points.shape)}")
    dims = [m for m, p in enumerate(points.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(dims) != 1 or any(not p.is_replicate() for m, p in enumerate(points.placements) if m not in dims):
        raise DataPipeError(f"points must be split along dim 0 over one mesh dim (Shard(0)), got {points.placements}")
    return dims[0]


def mesh_edges(cells: torch.Tensor, points: ShardTensor, pairs: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """This rank's share of the mesh's directed edges ``(2, E_r)``: each edge on exactly one rank. Collective.

    Every rank passes the cells it read (any distribution works; a
    :class:`~datapipes.MeshSource` gives each rank the cells its points own)
    and the points' ShardTensor, whose layout decides who keeps what: an
    undirected edge ``{a < b}`` is kept by the rank owning ``a``, once, which
    returns it in both directions (rows: source, destination; global ids),
    sorted by ``a``, then ``b``, ``a -> b`` edges first.

    Args:
        cells: ``(C_r, k)`` global point indices of this rank's cells.
        points: the ``(n_points, ndim)`` node-sharded ShardTensor.
        pairs: corners joined by an edge (see :func:`cell_edges`).

    Raises:
        DataPipeError: on every rank, when ``points`` is not node-sharded or
            any rank's ``cells`` or ``pairs`` are malformed (see :func:`cell_edges`).
    """
    dim = _node_dim(points)
    mesh = points.device_mesh
    sizes = points.spec.dim_sizes[0]
    try:
        local, error = cell_edges(cells.to(points.device), pairs), None
    except DataPipeError as err:  # only this rank's cells may be bad: stop every rank before the all-to-all
        local, error = None, err
    check_all_ranks(error, mesh.get_group(dim))
    bounds = torch.tensor(sizes, dtype=torch.int64, device=points.device).cumsum(0)
    owner = torch.searchsorted(bounds, local[0], right=True).clamp_(max=len(sizes) - 1)
    send = torch.bincount(owner, minlength=len(sizes))  # keys are sorted by ``a``, hence by owner
    recv = all_to_all_v(send, [1] * len(sizes), [1] * len(sizes), mesh, dim)
    arrived = all_to_all_v(local.t().contiguous(), send.tolist(), recv.tolist(), mesh, dim)
    mine = _unique_pairs(arrived[:, 0], arrived[:, 1])
    return torch.cat([mine, mine.flip(0)], dim=1)


def mesh_graph(cells: torch.Tensor, points: ShardTensor, pairs: Sequence[tuple[int, int]] | None = None) -> MeshGraph:
    """The mesh's :class:`MeshGraph`: edges from ``cells`` (:func:`mesh_edges`), built against ``points``. Collective.

    Args:
        cells: ``(C_r, k)`` global point indices of this rank's cells.
        points: the ``(n_points, ndim)`` node-sharded ShardTensor (its layout is the graph's).
        pairs: corners joined by an edge (see :func:`cell_edges`).
    """
    graph = build_graph(mesh_edges(cells, points, pairs), points)
    with torch.no_grad():
        offset = points[graph.src] - points[graph.dst]
        features = torch.cat([offset, offset.pow(2).sum(dim=-1, keepdim=True).sqrt()], dim=-1)
    return MeshGraph(graph, features)


class MeshGraphCache:
    """:func:`mesh_graph` of a :class:`~datapipes.DomainPipe`'s samples, built once per (file, partition).

    Args:
        source: the pipe's :class:`~datapipes.MeshSource` (read with ``cells=True``).
        pairs: corners joined by an edge (see :func:`cell_edges`).
        max_items: graphs kept (least recently used dropped first); None keeps all.

    Raises:
        DataPipeError: the source reads no cells.

    The key is the sample's file (path and modification time) and the layout
    of its points (mesh ranks, shard sizes): a graph is tied to one partition,
    so the same file read on another layout is built again.
    """

    def __init__(self, source: MeshSource, pairs: Sequence[tuple[int, int]] | None = None,
                 max_items: int | None = None):
        if "cells" not in source.variables:
            raise DataPipeError(f"{source} reads no cells: build it with cells=True from files that have /cells")
        self.source = source
        self.pairs = pairs
        self.max_items = max_items
        self.builds = 0  # graphs built so far (the rest were cache hits)
        self._graphs: OrderedDict[tuple, MeshGraph] = OrderedDict()

    def __call__(self, batch: Batch, index: int = 0) -> MeshGraph:
        """The graph of the ``index``-th sample of ``batch``. Collective on a miss (every domain rank misses alike)."""
        points = batch["points"][index]
        path = self.source.paths[batch.samples[index]]
        mesh = points.device_mesh
        key = (os.path.abspath(path), os.stat(path).st_mtime_ns, tuple(mesh.mesh.flatten().tolist()),
               mesh.mesh_dim_names, points.placements, points.spec.dim_sizes)
        graph = self._graphs.get(key)
        if graph is None:
            graph = mesh_graph(batch["cells"].to_local()[index], points, self.pairs)
            self.builds += 1
            self._graphs[key] = graph
            if self.max_items is not None and len(self._graphs) > self.max_items:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return graph
