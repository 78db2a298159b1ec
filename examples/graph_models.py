"""Graph networks in plain torch: MeshGraphNet and a radius-neighbourhood point-cloud network.

Not a script: the models of ``examples/meshgraphnet_heat.py``, ``tests/graph``
and ``benchmarks/graph.py``. Nothing here knows about ranks. Messages are
gathered with ``h[src]`` and summed (or maximised) at their destinations with
``torch.index_add`` / ``Tensor.scatter_reduce``, as any single-device graph
code writes them. Given plain index tensors they run on one device; given the
``src`` / ``dst`` of a :class:`physicsnemo_dp.graph.ShardedGraph` and
node-sharded ShardTensors, the same lines gather only the ghost rows from
other ranks and aggregate locally (the index tensors carry their graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MLP", "MeshGraphNet", "ProcessorBlock", "RadiusConv", "PointCloudNet"]


class MLP(nn.Sequential):
    """``layers`` linear layers with SiLU between them, optionally followed by a LayerNorm (MeshGraphNet's MLPs)."""

    def __init__(self, c_in: int, hidden: int, c_out: int, layers: int = 2, norm: bool = True):
        widths = [c_in] + [hidden] * (layers - 1) + [c_out]
        modules: list[nn.Module] = []
        for k, (a, b) in enumerate(zip(widths, widths[1:])):
            modules.append(nn.Linear(a, b))
            if k < layers - 1:
                modules.append(nn.SiLU())
        if norm:
            modules.append(nn.LayerNorm(c_out))
        super().__init__(*modules)


class ProcessorBlock(nn.Module):
    """One message-passing step: edge update from ``[e, h_src, h_dst]``, sum at ``dst``, node update, residuals."""

    def __init__(self, width: int, mlp_layers: int = 2):
        super().__init__()
        self.edge_mlp = MLP(3 * width, width, width, mlp_layers)
        self.node_mlp = MLP(2 * width, width, width, mlp_layers)

    def forward(self, h: torch.Tensor, e: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
        e = e + self.edge_mlp(torch.cat([e, h[src], h[dst]], dim=-1))
        aggregated = torch.index_add(torch.zeros_like(h), 0, dst, e)  # sum of incoming edges per node
        h = h + self.node_mlp(torch.cat([h, aggregated], dim=-1))
        return h, e


class MeshGraphNet(nn.Module):
    """Encode-process-decode (Pfaff et al., 2021): node and edge encoders, ``layers`` processor blocks, a decoder.

    Args:
        node_in: node input features.
        edge_in: edge input features (e.g. relative displacement and its norm).
        out: node outputs.
        width: latent width of nodes and edges.
        layers: processor blocks (message-passing steps).
        mlp_layers: linear layers per MLP.

    ``forward(x, e, src, dst)``: node features ``(N, node_in)``, edge features
    ``(E, edge_in)``, and the edges' source and destination node indices
    ``(E,)``; returns ``(N, out)``.
    """

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/graph/test_models.py and tests/examples/test_meshgraphnet_heat.py
        supports_domain: bool = True
        supports_ddp: bool = True

    def __init__(self, node_in: int, edge_in: int, out: int, width: int = 64, layers: int = 10, mlp_layers: int = 2):
        super().__init__()
        self.node_encoder = MLP(node_in, width, width, mlp_layers)
        self.edge_encoder = MLP(edge_in, width, width, mlp_layers)
        self.processor = nn.ModuleList(ProcessorBlock(width, mlp_layers) for _ in range(layers))
        self.decoder = MLP(width, width, out, mlp_layers, norm=False)

    def forward(self, x: torch.Tensor, e: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h, e = self.node_encoder(x), self.edge_encoder(e)
        for block in self.processor:
            h, e = block(h, e, src, dst)
        return self.decoder(h)


class RadiusConv(nn.Module):
    """PointNet++-style set abstraction over a radius neighbourhood (no subsampling), with a residual.

    ``h_i + max_j MLP([h_j, p_j - p_i])`` over the edges ``j -> i``; every
    point needs at least one incoming edge (build the graph with ``loop=True``).
    """

    def __init__(self, width: int, ndim: int):
        super().__init__()
        self.message = MLP(width + ndim, width, width, norm=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        message = self.message(torch.cat([h[src], pos[src] - pos[dst]], dim=-1))
        index = dst.view(-1, 1).expand_as(message)
        pooled = torch.zeros_like(h).scatter_reduce(0, index, message, "amax", include_self=False)
        return self.norm(h + pooled)


class PointCloudNet(nn.Module):
    """Per-point regression on a point cloud: embed, ``layers`` :class:`RadiusConv` blocks, a head.

    ``forward(x, pos, src, dst)``: point features ``(N, c_in)``, positions
    ``(N, ndim)``, radius-graph edges; returns ``(N, out)``.
    """

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/graph/test_models.py
        supports_domain: bool = True

    def __init__(self, c_in: int, out: int, ndim: int = 3, width: int = 32, layers: int = 3):
        super().__init__()
        self.embed = MLP(c_in + ndim, width, width)
        self.blocks = nn.ModuleList(RadiusConv(width, ndim) for _ in range(layers))
        self.head = MLP(width, width, out, norm=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h = self.embed(torch.cat([x, pos], dim=-1))
        for block in self.blocks:
            h = block(h, pos, src, dst)
        return self.head(h)
