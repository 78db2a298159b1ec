"""Graph message passing compiled: ``x[g.src]`` and aggregations with ``g.dst`` trace without a graph break.

The graph's index tensors are found through a tag on their local storage; the
ShardTensor's flatten context carries it to torch.compile's stand-ins
(``rule_kit.carry_storage_tag``), so the traced calls take the graph's paths
(one all-to-all of the ghost rows, local aggregation) instead of the generic
indexing rules, whose data-dependent steps cannot be traced. Compiled with
``fullgraph=True`` (any break is an error) and compared with eager on the same
sharded inputs: outputs and layouts, input and parameter gradients; a second
call with new values compiles nothing. World 3 has uneven node shards with an
empty one; the 2x2 mesh shards the nodes over ``"domain"``.
"""

from __future__ import annotations

import copy

import torch

from physicsnemo_dp.graph import build_graph
from tests._harness import distributed

from ..graph._graphs import random_case
from ..graph.test_message_passing import message_passing
from ._compare import assert_same, run

F = 4
#: aggregation forms: in place with alpha into a replicated ``new_zeros`` target, and ``scatter_add_`` /
#: ``scatter_reduce`` through ``dst.view(-1, 1).expand_as(m)`` (views of the index made while tracing);
#: ``torch.index_add`` runs in the MeshGraphNet test below. Both reads (``x[src]``, ``index_select(dst)``) in each.
HOWS = ("index_add_", "scatter_add_", "reduce-amax-noself")


@distributed(world_sizes=(3,), mesh_2d=True, timeout=600)
def test_message_passing_compiles_without_graph_breaks(ctx):
    from torch._dynamo.testing import CompileCounterWithBackend

    case = random_case(ctx.mesh, 19, 50, seed=7)
    gen = torch.Generator().manual_seed(3)
    x_full = torch.randn(case.num_nodes, F, dtype=torch.float64, generator=gen)
    g = build_graph(case.given(), case.shard_nodes(ctx.mesh, x_full))
    torch.manual_seed(5)
    lin = torch.nn.Linear(2 * F, F, dtype=torch.float64)

    def layers(lin, x, src, dst):  # every form in one graph: one compilation
        return tuple(message_passing(x, src, dst, lin, how) for how in HOWS)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(layers, backend=counter, fullgraph=True)
    compiled_lin = copy.deepcopy(lin)
    for call in range(2):  # the second call, with other values, must reuse the graph
        values = x_full * (1 + call)
        compiled_lin.zero_grad()
        eager_lin = copy.deepcopy(compiled_lin)
        eager_x = [case.shard_nodes(ctx.mesh, values).requires_grad_()]
        eager = run(lambda m, x: layers(m, x, g.src, g.dst), eager_lin, eager_x)
        xs = [case.shard_nodes(ctx.mesh, values).requires_grad_()]
        outs = run(lambda m, x: step(m, x, g.src, g.dst), compiled_lin, xs)
        assert_same(f"{HOWS} call {call}", torch.float64, outs, eager, xs, eager_x, compiled_lin, eager_lin)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two calls"
    torch._dynamo.reset()


@distributed(world_sizes=(1, 2), mesh_2d=False, timeout=600)
def test_meshgraphnet_step_is_one_graph(ctx):
    """The benchmark's MeshGraphNet (``benchmarks/compiled.py``, tiny sizes) on its plate mesh: forward, loss and
    backward compile to one graph at P = 1 and 2 and match eager; a second step recompiles nothing."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from benchmarks import compiled, graph
    from physicsnemo_dp.debug import compile_counts

    sizes = compiled.sizes(True, 1.0)
    _, (x, e, src, dst), _ = graph.inputs(ctx.mesh, sizes["around"], sizes["rings"])
    net = graph.model(sizes["width"], sizes["layers"], ctx.device).double()

    def loss(net, x, e):
        return (net(x, e, src, dst) * torch.arange(x.shape[0], dtype=x.dtype)[:, None]).square().mean()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(loss, backend=counter, fullgraph=True)
    before = compile_counts()
    compiled_net = copy.deepcopy(net)
    for call in range(2):
        compiled_net.zero_grad()
        eager_net = copy.deepcopy(compiled_net)
        inputs = [[t.detach().double() * (1 + call) for t in (x, e)] for _ in range(2)]
        for t in inputs[0] + inputs[1]:
            t.requires_grad_()
        eager = run(loss, eager_net, inputs[0])
        outs = run(step, compiled_net, inputs[1])
        assert_same(
            f"MeshGraphNet call {call}", torch.float64, outs, eager, inputs[1], inputs[0], compiled_net, eager_net
        )
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two steps"
    assert compile_counts()["graph_breaks"] == before["graph_breaks"]
    torch._dynamo.reset()
