"""Other people's code patterns on ShardTensors: bytes a rank receives over the input's global bytes.

Each case is a layer written the way a third-party library writes it (or the
library itself, where installed), run forward and backward on node- or
grid-sharded input with its parameters frozen, so every byte counted is
activation traffic (parameter-gradient reductions are a separate, model-sized
cost). Two figures per case, each the largest per-rank ``bytes received`` in
one step (``count_collectives``, self-copies excluded) over the global bytes
of the input feature tensor: through all-gathers (how implicit gathers move
data: ~0 on an O(local) path), and through all collectives. An O(local) path
receives only boundary rows (ghosts, cut windows), a fraction that shrinks as the domain grows; a
path that gathers the domain receives about ``(P - 1) / P`` of it per tensor
it gathers, several times per step. Target: <= 0.25. Comparing the same case
at P = 2 and P = 4 shows whether the figure grows with P.

Cases:

* ``scatter_sum into zeros`` / ``scatter_mean into zeros``: a MeshGraphNet
  layer as PhysicsNeMo writes it with torch_scatter's Python path (edge MLP on
  ``cat(x[src], x[dst])``, ``torch.zeros(N, F).scatter_add_(0, dst, e)``, a
  count for the mean, node MLP), the graph from ``build_graph``;
* ``x[idx] + index_add, plain sharded index``: the same gather/scatter with an
  index ShardTensor that did not come from ``build_graph`` (the edge list sorted
  by destination, in chunks);
* ``window attention``: a Swin-style block (windows of 4 rows) on a grid whose
  row shards cut windows;
* ``PyG GATConv`` / ``PyG PointNetConv`` (torch_geometric, default self
  loops) and ``neuraloperator FNO`` (as it is, and under the
  ``physicsnemo_dp.integrations`` adapter): only where the package is installed.
  An FNO step transposes its data for every FFT (8 per 2-block step, each
  ``(P - 1) / P`` of a rank's spectrum), so its figure stays above the target
  even with nothing gathered: its "received" figure has no target.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

import physicsnemo_dp
from physicsnemo_dp import integrations
from physicsnemo_dp import count_collectives
from physicsnemo_dp.collectives import mesh_device
from physicsnemo_dp.graph import build_graph

from ._models import shard
from ._record import Result, over_ranks

SUITE = "third_party"
TARGET = ("<=", 0.25)


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(side=12, width=4, window_rows=12, fno_grid=12)
    s = max(scale, 1 / 16) ** 0.5
    return dict(side=int(64 * s), width=32, window_rows=68, fno_grid=int(64 * s))


def _grid_edges(side: int) -> torch.Tensor:
    """A 4-neighbour grid's directed edges ``(2, E)``, nodes in row-major order (contiguous row slabs)."""
    ids = torch.arange(side * side).view(side, side)
    pairs = [(ids[:, :-1], ids[:, 1:]), (ids[:-1, :], ids[1:, :])]
    src = torch.cat([a.reshape(-1) for a, _ in pairs] + [b.reshape(-1) for _, b in pairs])
    dst = torch.cat([b.reshape(-1) for _, b in pairs] + [a.reshape(-1) for a, _ in pairs])
    return torch.stack([src, dst])


def _mlp(width_in: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width_in, width), nn.SiLU(), nn.Linear(width, width))


class _MeshGraphNetLayer(nn.Module):
    """One processor layer as PhysicsNeMo writes it on torch_scatter's Python ``scatter_sum`` / ``scatter_mean``."""

    def __init__(self, width: int, mean: bool):
        super().__init__()
        self.edge, self.node, self.mean = _mlp(2 * width, width), _mlp(2 * width, width), mean

    def forward(self, x, src, dst):
        e = self.edge(torch.cat([x[src], x[dst]], dim=-1))
        index = dst.view(-1, 1).expand_as(e)
        agg = torch.zeros(x.shape[0], e.shape[1], dtype=e.dtype, device=e.device).scatter_add_(0, index, e)
        if self.mean:
            count = torch.zeros(x.shape[0], 1, dtype=e.dtype, device=e.device)
            count = count.scatter_add_(0, dst.view(-1, 1), torch.ones_like(e[:, :1])).clamp_(min=1)
            agg = agg / count
        return x + self.node(torch.cat([x, agg], dim=-1))


class _WindowAttention(nn.Module):
    """Swin's window attention (timm's window_partition / window_reverse) on ``(1, H, W, C)``."""

    def __init__(self, width: int, window: int = 4, heads: int = 2):
        super().__init__()
        self.qkv, self.proj, self.window, self.heads = (
            nn.Linear(width, 3 * width),
            nn.Linear(width, width),
            window,
            heads,
        )

    def forward(self, x):
        B, H, W, C = x.shape
        ws, h = self.window, self.heads
        win = x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)
        q, k, v = self.qkv(win).reshape(-1, ws * ws, 3, h, C // h).permute(2, 0, 3, 1, 4)
        attn = ((q * (C // h) ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(-1, ws * ws, C))
        out = out.view(B, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        return x + out


def _received(step, x) -> tuple[float, float]:
    """Largest per-rank bytes received in ``step(x)`` forward + backward, through all-gathers and through all
    collectives, over the global bytes of ``x``."""
    x = x.requires_grad_()
    with physicsnemo_dp.implicit_gathers("allow"), count_collectives() as counter:
        step(x).square().mean().backward()
    size = x.numel() * x.element_size()
    gathered = over_ranks(counter.bytes_received["all_gather"], "max")
    return gathered / size, over_ranks(counter.total_received, "max") / size


def _frozen(module: nn.Module, mesh) -> nn.Module:
    torch.manual_seed(0)
    module = module.to(mesh_device(mesh))
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def _graph_cases(mesh, side: int, width: int):
    device = mesh_device(mesh)
    n = side * side
    x_full = torch.randn(n, width, generator=torch.Generator().manual_seed(1)).to(device)
    edges = _grid_edges(side)
    mine = torch.chunk(torch.arange(edges.shape[1]), mesh.size())[mesh.get_rank()]
    graph = build_graph(edges[:, mine].to(device), shard(x_full, mesh, 0))
    for name, mean in (("scatter_sum into zeros", False), ("scatter_mean into zeros", True)):
        layer = _frozen(_MeshGraphNetLayer(width, mean), mesh)
        yield name, (lambda x, layer=layer: layer(x, graph.src, graph.dst)), shard(x_full, mesh, 0)
    # an index ShardTensor of the edge list sorted by destination, as a mesh file stores it, in chunks of the
    # one split rule: not a graph, no ghost plan; a rank's edges mostly end at its own nodes
    by_dst = edges[:, torch.argsort(edges[1], stable=True)].to(device)
    src, dst = shard(by_dst[0], mesh, 0), shard(by_dst[1], mesh, 0)
    layer = _frozen(_MeshGraphNetLayer(width, False), mesh)
    yield "x[idx] + index_add, plain sharded index", (lambda x: layer(x, src, dst)), shard(x_full, mesh, 0)
    if importlib.util.find_spec("torch_geometric") is not None:
        from torch_geometric.nn import GATConv, PointNetConv

        gat = _frozen(GATConv(width, width, heads=2, concat=False), mesh)
        yield "PyG GATConv (default self loops)", (lambda x: gat(x, graph.edge_index)), shard(x_full, mesh, 0)
        pos_full = torch.randn(n, 3, generator=torch.Generator().manual_seed(2)).to(device)
        pos = shard(pos_full, mesh, 0)
        point = _frozen(PointNetConv(_mlp(width + 3, width), _mlp(width, width)), mesh)
        yield (
            "PyG PointNetConv (default self loops)",
            (lambda x: point(x, pos, graph.edge_index)),
            shard(x_full, mesh, 0),
        )


def _fno_case(mesh, grid: int, width: int):
    if importlib.util.find_spec("neuralop") is None:
        return
    from neuralop.models import FNO

    # as many input channels as hidden ones, so the figure is over the hidden features' bytes
    fno = _frozen(
        FNO(n_modes=(8, 8), hidden_channels=width // 2, in_channels=width // 2, out_channels=1, n_layers=2), mesh
    )
    x_full = torch.randn(1, width // 2, grid, grid, generator=torch.Generator().manual_seed(3)).to(mesh_device(mesh))
    yield "neuraloperator FNO", fno, shard(x_full, mesh, 2)

    def adapted(x):
        with integrations.neuraloperator():
            return fno(x)

    yield "neuraloperator FNO, integrations adapter", adapted, shard(x_full, mesh, 2)


def run(mesh, side: int, width: int, window_rows: int, fno_grid: int, compare_dtensor: bool = False) -> list[Result]:
    if mesh.size() == 1:
        return []
    cases = list(_graph_cases(mesh, side, width))
    attn = _frozen(_WindowAttention(width), mesh)
    x_full = torch.randn(1, window_rows, 8, width, generator=torch.Generator().manual_seed(4))
    cases.append(("window attention, shards cutting windows", attn, shard(x_full.to(mesh_device(mesh)), mesh, 1)))
    cases += list(_fno_case(mesh, fno_grid, width))
    results = []
    for name, step, x in cases:
        gathered, received = _received(step, x)
        results.append(Result(SUITE, f"{name}: all-gathered", mesh.size(), gathered, 1.0, "bytes / input", TARGET))
        # an FNO step transposes its data for every FFT: necessary traffic above the target, gathered or not
        target = None if "FNO" in name else TARGET
        results.append(Result(SUITE, f"{name}: received", mesh.size(), received, 1.0, "bytes / input", target))
    return results
