"""torch_geometric layers, unchanged, on a sharded graph: forward and every gradient equal one process.

Needs the ``graph`` extra; runs only with ``pytest tests/graph -m graph_extra``.
"""

from __future__ import annotations

import pytest
import torch

from physicsnemo_dp.debug import count_collectives
from physicsnemo_dp.graph import build_graph
from tests._harness import distributed

from ._graphs import random_case, with_self_loops

pytestmark = pytest.mark.graph_extra

F_IN, F_OUT = 3, 5
LAYERS = ["GraphConv", "GraphConv-mean", "EdgeConv", "GCNConv-loops-in-graph", "GCNConv"]


def _layer(name: str):
    pyg = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(11)
    if name == "GraphConv":
        return pyg.GraphConv(F_IN, F_OUT, aggr="add")
    if name == "GraphConv-mean":
        return pyg.GraphConv(F_IN, F_OUT, aggr="mean")
    if name == "EdgeConv":
        return pyg.EdgeConv(torch.nn.Sequential(torch.nn.Linear(2 * F_IN, F_OUT), torch.nn.Tanh()), aggr="max")
    if name == "GCNConv-loops-in-graph":  # self loops built into the graph, degree normalisation by PyG
        return pyg.GCNConv(F_IN, F_OUT, add_self_loops=False)
    return pyg.GCNConv(F_IN, F_OUT)


def _check_traffic(counter, g, gathers, width):
    """Forward: ``gathers`` all-to-alls of exactly the ghost rows, ``width`` numbers per ghost in all."""
    assert set(counter.calls) == {"all_to_all"} and counter.calls["all_to_all"] == gathers, counter.summary()
    assert counter.bytes_received["all_to_all"] == g.num_ghosts * width * 8


@pytest.mark.parametrize("name", LAYERS)
@distributed(timeout=120)
def test_pyg_layer_matches_one_process(ctx, name):
    layer = _layer(name).double()
    for seed, (n, e) in enumerate([(26, 80), (10, 6)]):
        case = random_case(ctx.mesh, n, e, 60 + seed)
        if name == "GCNConv-loops-in-graph":
            case = with_self_loops(case)
        gen = torch.Generator().manual_seed(seed)
        x_full = torch.randn(n, F_IN, dtype=torch.float64, generator=gen)
        w_full = torch.randn(n, F_OUT, dtype=torch.float64, generator=gen)
        order = case.order()
        ref_x = x_full.clone().requires_grad_()
        weighted = name == "GCNConv-loops-in-graph"  # edge weights given: else PyG makes plain ones(E)
        extra = (torch.ones(len(case.src), dtype=torch.float64),) if weighted else ()
        ref = layer(ref_x, torch.stack([case.src[order], case.dst[order]]), *extra)
        (ref * w_full).sum().backward()
        want = [ref_x.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()

        x = case.shard_nodes(ctx.mesh, x_full).requires_grad_()
        g = build_graph(case.given(), x)
        with count_collectives() as forward:
            extra = (torch.ones_like(g.src, dtype=torch.float64),) if weighted else ()
            out = layer(x, g.edge_index, *extra)
        if name == "GCNConv":
            # add_remaining_self_loops builds a new edge_index (a cat): not the graph's, so the generic
            # indexing rules serve it (correct, O(global edges) per rank); checked for values only
            assert "all_gather" in forward.calls
        else:
            # GCNConv transforms before it propagates, and gathers deg^-1/2 of the sources too
            _check_traffic(forward, g, *((2, F_OUT + 1) if weighted else (1, F_IN)))
        (out * case.shard_nodes(ctx.mesh, w_full)).sum().backward()
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-10, atol=1e-10)
        got = [x.grad.full_tensor()] + [p.grad for p in layer.parameters()]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        layer.zero_grad()
