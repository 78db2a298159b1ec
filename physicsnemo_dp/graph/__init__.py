"""Sharded graphs: edges at their destination's owner, ghost-node gathers, local aggregation.

``build_graph(edge_index, nodes)`` places each edge at the rank that owns its
destination node and plans which remote source rows ("ghost nodes") each rank
needs. Ordinary graph code then runs on ShardTensors with O(local + ghost)
memory: ``x[g.src]`` / ``x.index_select(0, g.src)`` move exactly the ghost rows
(one all-to-all), ``x[g.dst]`` and aggregation with ``g.dst`` (``index_add``,
``scatter_add``, ``scatter_reduce``) are local. See docs/graphs.md.
"""

from __future__ import annotations

from . import _dispatch
from ._build import build_graph
from ._graph import ShardedGraph

__all__ = ["ShardedGraph", "build_graph", "knn", "radius"]

#: The graph op family, installed by ``catalog.py`` after the generic indexing rules (see ``_dispatch``).
RULES: dict = dict(_dispatch.RULES)
FUNCTIONS: dict = dict(_dispatch.FUNCTIONS)

from .neighbours import knn, radius
