"""Graph message passing on an SFC-partitioned mesh: ghost traffic, MeshGraphNet memory, ghost fraction.

The mesh is the plate with a hole of ``datapipes.synthetic.plate_with_hole``
(a triangulated annulus-like square), its points sorted along a Hilbert curve
as ``datapipes.prepare_mesh`` would, each rank owning a contiguous range
(``balanced_sizes``, as ``MeshSource`` reads it) and the cells its points own.
The graph is built the way training builds it (``datapipes.mesh_graph``:
edges from cells, each once, ``build_graph``, edge features). The model is
``examples/graph_models.MeshGraphNet``. Three figures:

* **ghost bytes / minimum** (target <= 1.1): bytes arriving at all ranks
  during one MeshGraphNet forward (``count_collectives``), over the minimum:
  every processor layer must receive each ghost node's latent row once
  (``layers * ghosts * width * itemsize``, summed over ranks).
* **MeshGraphNet step, strong: per-rank peak / ideal** (target <= 1.2): the
  largest per-rank peak of one forward + backward (``LiveBytes``, as
  ``memory_scaling`` measures) over ``1/P`` of the same step on one device
  with plain tensors and index tensors.
* **MeshGraphNet step, torch_scatter-style aggregation: per-rank peak / (ideal + ghosts)**
  (target <= 1.2): the same model with each processor block summing its
  messages as torch_scatter's python ``scatter_sum`` does (a plain
  ``torch.zeros(N, F)`` and ``scatter_add_`` with ``dst.view(-1, 1).expand_as(e)``),
  on edge lists that are plain index ShardTensors (not a ``build_graph`` graph:
  edges grouped by their destination's ``torch.chunk`` owner); reads and the
  aggregation go by request. Baseline: ``1/P`` of the single-device peak plus
  the rank's ghost rows (distinct remote sources, one ``width`` row per layer).
* **ghost nodes / nodes** at this run's P (no target: a surface-to-volume
  figure; a 2-D mesh's ghosts grow like ``sqrt(P * N)``). :func:`plots`
  draws the same fraction for P = 1 ... 256 from the edge list alone (the
  ghosts of a rank are the distinct sources of its edges owned elsewhere),
  checked against the library's count at the run's P.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from datapipes import balanced_sizes
from datapipes.mesh_graph import cell_edges, mesh_graph
from datapipes.sfc import curve_order
from datapipes.synthetic import plate_with_hole
from physicsnemo_dp import Shard, ShardTensor, ShardTensorSpec, count_collectives
from physicsnemo_dp.collectives import mesh_device

from ._memory import peak_bytes
from ._record import Result, over_ranks

SUITE = "graph"
CURVE_P = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(around=24, rings=6, width=4, layers=2)
    s = max(scale, 1 / 16) ** 0.5  # nodes grow with scale
    return dict(around=int(256 * s), rings=int(64 * s), width=16, layers=4)


@lru_cache(maxsize=2)
def _plate(around: int, rings: int) -> tuple[np.ndarray, np.ndarray]:
    """Points ``(n, 2)`` in Hilbert order and triangles renumbered to it (the prepared file's layout).

    The temperature is not needed: no solver iterations (``max_iter=0``).
    """
    mesh = plate_with_hole(1, around, rings, seed=0, max_iter=0)[0]
    order = curve_order(mesh.points, "hilbert")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return mesh.points[order], inverse[mesh.cells]


def model(width: int, layers: int, device):
    """``examples/graph_models.MeshGraphNet`` (user code: its folder goes on ``sys.path``), seeded."""
    folder = str(Path(__file__).resolve().parents[1] / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from graph_models import MeshGraphNet

    torch.manual_seed(0)
    return MeshGraphNet(2, 3, 1, width=width, layers=layers).to(device)


def inputs(mesh, around: int, rings: int):
    """Plain ``(x, e, src, dst)`` on one device and this rank's sharded ones (graph built as in training)."""
    points, cells = _plate(around, rings)
    device = mesh_device(mesh)
    n, P, me = len(points), mesh.size(), mesh.get_local_rank()
    sizes_ = balanced_sizes(n, P)
    start = sum(sizes_[:me])
    spec = ShardTensorSpec.from_sizes(mesh, [Shard(0)], (n, 2), torch.float32, (sizes_, None))
    x_full = torch.from_numpy(points).float().to(device)
    x = ShardTensor.from_spec(x_full[start:start + sizes_[me]].contiguous(), spec)
    owner = cells.min(axis=1)
    mine = cells[(owner >= start) & (owner < start + sizes_[me])]  # the cells MeshSource gives this rank
    graph = mesh_graph(torch.from_numpy(mine).to(device), x)
    undirected = cell_edges(torch.from_numpy(cells))
    src = torch.cat([undirected[0], undirected[1]]).to(device)
    dst = torch.cat([undirected[1], undirected[0]]).to(device)
    offset = x_full[src] - x_full[dst]
    e_full = torch.cat([offset, offset.norm(dim=-1, keepdim=True)], dim=-1)
    return (x_full, e_full, src, dst), (x, graph.edge_features, graph.graph.src, graph.graph.dst), graph.graph


def scatter_sum(src, index, dim, dim_size):
    """torch_scatter's python ``scatter_sum`` (``out=None``, ``dim_size`` given), as written there."""
    index = index.view(-1, 1).expand_as(src) if index.dim() == 1 else index.expand_as(src)
    size = list(src.size())
    size[dim] = dim_size
    out = torch.zeros(size, dtype=src.dtype, device=src.device)
    return out.scatter_add_(dim, index, src)


def scatter_model(width: int, layers: int, device):
    """:func:`model` with every processor block aggregating through :func:`scatter_sum` (user code)."""
    net = model(width, layers, device)

    def forward(self, h, e, src, dst):
        e = e + self.edge_mlp(torch.cat([e, h[src], h[dst]], dim=-1))
        aggregated = scatter_sum(e, dst, 0, h.shape[0])
        return h + self.node_mlp(torch.cat([h, aggregated], dim=-1)), e

    for block in net.processor:
        block.forward = forward.__get__(block)
    return net


def scatter_inputs(mesh, plain):
    """This rank's ``(x, e, src, dst)`` for :func:`scatter_model`: nodes in ``torch.chunk`` rows, edge lists
    as index ShardTensors grouped by their destination's owner (no graph), and the rank's ghost count."""
    from physicsnemo_dp.split import chunk_sizes

    x_full, e_full, src, dst = plain
    n, P, me = len(x_full), mesh.size(), mesh.get_local_rank()
    nodes = chunk_sizes(n, P)
    ends = torch.tensor(nodes).cumsum(0)
    owner = torch.searchsorted(ends, dst, right=True)
    order = torch.argsort(owner, stable=True)
    edges = tuple(torch.bincount(owner, minlength=P).tolist())
    mine = order[sum(edges[:me]):sum(edges[:me + 1])]

    def shard(full, sizes, local):
        spec = ShardTensorSpec.from_sizes(mesh, [Shard(0)], tuple(full.shape), full.dtype,
                                          (sizes,) + (None,) * (full.ndim - 1))
        return ShardTensor.from_spec(local.contiguous(), spec)

    start = sum(nodes[:me])
    x = shard(x_full, nodes, x_full[start:start + nodes[me]])
    sharded = (x, shard(e_full, edges, e_full[mine]), shard(src, edges, src[mine]), shard(dst, edges, dst[mine]))
    lo, hi = start, start + nodes[me]
    remote = src[mine][(src[mine] < lo) | (src[mine] >= hi)]
    return sharded, len(torch.unique(remote))


def step(net, args) -> None:
    """Forward and backward with a unit upstream gradient (as ``memory_scaling``'s train step)."""
    net.zero_grad(set_to_none=True)
    y = net(*args)
    y.backward(torch.ones_like(y))


def ghost_fractions(around: int, rings: int, parts=CURVE_P) -> dict[int, float]:
    """Ghost nodes (summed over ranks) / nodes for each P, from the edge list alone (no ranks needed)."""
    points, cells = _plate(around, rings)
    pairs = cell_edges(torch.from_numpy(cells)).numpy()
    src, dst = np.concatenate([pairs[0], pairs[1]]), np.concatenate([pairs[1], pairs[0]])
    n, out = len(points), {}
    for P in parts:
        bounds = np.cumsum(balanced_sizes(n, P))
        rank_of = np.searchsorted(bounds, np.arange(n), side="right")
        remote = rank_of[src] != rank_of[dst]
        out[P] = len(np.unique(rank_of[dst][remote] * n + src[remote])) / n  # distinct (rank, ghost) pairs
    return out


def run(mesh, around: int, rings: int, width: int, layers: int, compare_dtensor: bool = False) -> list[Result]:
    P = mesh.size()
    net = model(width, layers, mesh_device(mesh))
    plain, sharded, graph = inputs(mesh, around, rings)
    n = len(plain[0])
    results = []
    ghosts = over_ranks(graph.num_ghosts)
    expected = ghost_fractions(around, rings, (P,))[P] * n
    if ghosts != expected:  # the offline curve of plots() must describe what the library does
        raise AssertionError(f"the graph has {ghosts} ghost nodes over all ranks, the edge list implies {expected}")
    results.append(Result(SUITE, "ghost nodes / nodes, SFC partition", P, ghosts, n, "nodes"))
    if P > 1:
        with torch.no_grad(), count_collectives() as counter:
            net(*sharded)
        moved = over_ranks(counter.total_received)
        minimum = layers * ghosts * width * torch.finfo(torch.float32).bits // 8
        results.append(Result(SUITE, "meshgraphnet forward: ghost bytes / minimum", P, moved, minimum, "bytes",
                              ("<=", 1.1)))
    single = peak_bytes(lambda: step(net, plain))
    per_rank = over_ranks(peak_bytes(lambda: step(net, sharded)), "max")
    results.append(Result(SUITE, f"meshgraphnet step ({n} nodes), strong: per-rank peak / ideal", P, per_rank,
                          single / P, "bytes", ("<=", 1.2)))
    results.append(scatter_style(mesh, plain, width, layers))
    return results


def scatter_style(mesh, plain, width: int, layers: int) -> Result:
    """The torch_scatter-style MeshGraphNet step: per-rank peak over ``1/P`` single-device peak plus ghosts."""
    P = mesh.size()
    net = scatter_model(width, layers, mesh_device(mesh))
    sharded, ghosts = scatter_inputs(mesh, plain)
    step(net, sharded)  # plans made once (cached on the index tensors, as in training)
    single = peak_bytes(lambda: step(net, plain))
    ghost_bytes = ghosts * width * layers * torch.finfo(torch.float32).bits // 8
    per_rank = peak_bytes(lambda: step(net, sharded))
    worst = over_ranks(per_rank / (single / P + ghost_bytes), "max")
    n = len(plain[0])
    return Result(SUITE, f"meshgraphnet step ({n} nodes), torch_scatter-style: per-rank peak / (ideal + ghosts)", P,
                  worst, 1.0, "ratio", ("<=", 1.2))


def plots(out: Path, tiny: bool = False, scale: float = 1.0) -> list[Path]:
    """``graph_ghost_fraction.png``: ghost nodes / nodes vs P for the SFC partition of the benchmark's mesh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = sizes(tiny, scale)
    n = len(_plate(s["around"], s["rings"])[0])
    fractions = ghost_fractions(s["around"], s["rings"], tuple(p for p in CURVE_P if p <= n))
    parts = np.array(list(fractions))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(parts[1:], [fractions[p] for p in parts[1:]], "o-", label="Hilbert ranges (balanced sizes)")
    middle = parts[len(parts) // 2]
    ideal = fractions[middle] * np.sqrt(parts[1:] / middle)
    ax.loglog(parts[1:], ideal, "k--", linewidth=0.8, label="~ sqrt(P) (surface / volume in 2-D)")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("ghost nodes / owned nodes (all ranks)")
    ax.set_title(f"ghost fraction, plate with a hole, {n} nodes", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out) / "graph_ghost_fraction.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
