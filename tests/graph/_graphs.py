"""Random graphs and their partitions, the same on every rank, and the single-process expectations.

Every rank draws the same global graph (seeded), gives its share of the edge
list to ``build_graph`` and cuts its node rows; the expectations (edge order at
the owners, ghost ids) are computed from the global graph alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor


@dataclass
class Case:
    num_nodes: int
    src: torch.Tensor  # (E,) global edge list, as given over the ranks
    dst: torch.Tensor
    giver: torch.Tensor  # (E,) rank that gives each edge to build_graph
    node_sizes: tuple
    mesh_dim: int
    group: int
    me: int

    @property
    def node_bounds(self):
        ends = torch.tensor(self.node_sizes).cumsum(0)
        return ends - torch.tensor(self.node_sizes), ends

    def owner(self, ids):
        return torch.searchsorted(torch.tensor(self.node_sizes).cumsum(0), ids, right=True)

    def given(self):
        """This rank's edge_index (2, E_r) for build_graph."""
        mine = self.giver == self.me
        return torch.stack([self.src[mine], self.dst[mine]])

    def order(self):
        """Global edge ids in the graph's order: by owner of dst, then giving rank, then original position."""
        owner = self.owner(self.dst)
        key = owner * (self.group * (len(self.src) + 1)) + self.giver * (len(self.src) + 1) + torch.arange(len(self.src))
        return torch.argsort(key)

    def box(self, t):
        start = sum(self.node_sizes[: self.me])
        return t[start: start + self.node_sizes[self.me]]

    def shard_nodes(self, mesh, x):
        """``x`` (N, ...) node-sharded over ``mesh_dim`` with ``node_sizes``."""
        placements = [Shard(0) if m == self.mesh_dim else Replicate() for m in range(mesh.ndim)]
        shapes = {self.mesh_dim: [(s, *x.shape[1:]) for s in self.node_sizes]}
        return ShardTensor.from_local(self.box(x).clone(), mesh, placements, sharding_shapes=shapes)


def node_mesh_dim(mesh) -> int:
    names = mesh.mesh_dim_names or ()
    return names.index("domain") if "domain" in names and mesh.ndim > 1 else 0


def uneven_sizes(n: int, group: int, gen: torch.Generator, allow_empty: bool = True) -> tuple:
    """Random shard sizes adding up to ``n`` (some ranks empty when ``allow_empty``)."""
    if group == 1:
        return (n,)
    cuts = torch.randint(0 if allow_empty else 1, n + 1, (group - 1,), generator=gen).sort().values.tolist()
    bounds = [0, *cuts, n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def random_case(mesh, num_nodes: int, num_edges: int, seed: int, allow_empty: bool = True) -> Case:
    """A random graph (isolated nodes likely, duplicate edges and self loops possible) and a partition."""
    gen = torch.Generator().manual_seed(seed)
    mesh_dim = node_mesh_dim(mesh)
    group = mesh.size(mesh_dim)
    used = max(1, num_nodes * 3 // 4)  # the last quarter of the ids never appears: isolated nodes
    src = torch.randint(0, used, (num_edges,), generator=gen)
    dst = torch.randint(0, used, (num_edges,), generator=gen)
    giver = torch.randint(0, group, (num_edges,), generator=gen)
    sizes = uneven_sizes(num_nodes, group, gen, allow_empty)
    return Case(num_nodes, src, dst, giver, sizes, mesh_dim, group, mesh.get_coordinate()[mesh_dim])


def with_self_loops(case: Case) -> Case:
    """``case`` plus one loop per node, each given by the rank that owns the node."""
    ids = torch.arange(case.num_nodes)
    return Case(case.num_nodes, torch.cat([case.src, ids]), torch.cat([case.dst, ids]),
                torch.cat([case.giver, case.owner(ids)]), case.node_sizes, case.mesh_dim, case.group, case.me)


def shard_rows(mesh, full, mesh_dim, sizes):
    """This rank's rows of ``full`` as a ShardTensor, dim 0 sharded over ``mesh_dim`` with ``sizes`` (uneven,
    empty shards allowed), every other mesh dim replicated."""
    placements = [Shard(0) if m == mesh_dim else Replicate() for m in range(mesh.ndim)]
    coord = mesh.get_coordinate()[mesh_dim]
    start = sum(sizes[:coord])
    shapes = {mesh_dim: [(s, *full.shape[1:]) for s in sizes]}
    return ShardTensor.from_local(full[start : start + sizes[coord]].clone(), mesh, placements, sharding_shapes=shapes)
