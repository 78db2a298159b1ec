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

The FNO of ``examples/spectral_models.py`` compiles to one graph too, and no graph of its step sums
complex tensors (what Inductor cannot lower in its backward).
"""

from __future__ import annotations

import copy

import torch

from physicsnemo_dp.graph import build_graph
from tests._harness import distributed
from tests.examples import EXAMPLES  # noqa: F401  (puts the examples on sys.path, for spectral_models)

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


@distributed(world_sizes=(2,), mesh_2d=False, timeout=600)
def test_fno_step_is_one_graph_without_complex_sums(ctx):
    """The FNO of ``examples/spectral_models.py`` (2 Fourier layers, 11 x 9 grid, rows sharded unevenly): forward,
    loss and backward compile to one graph (``fullgraph=True``) matching eager, a second step compiles nothing,
    and no graph adds complex tensors. Inductor lowers a complex ``add`` by viewing its operands as real, which
    fails in the FNO's backward ("self.stride(-1) must be 1 to view ComplexFloat as Float", torch 2.13, plain
    tensors too); with the spectral product on the spectrum's real view the only complex ops left are the
    transforms and views. The step is compiled before any eager FFT, so the FFT plans (torch's decomposition,
    recorded on meta tensors) are recorded while Dynamo traces, under its Python dispatcher: ``real_tensors``
    turns that off, else ``rfft2`` reaches the recorder whole and breaks the graph at every transform.
    (aot_eager: an Inductor compile takes minutes here; benchmarks/compiled.py runs it.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.distributed.tensor.placement_types import Shard

    import spectral_models
    from physicsnemo_dp.debug import compile_counts
    from physicsnemo_dp.rules import fft

    from ..core._util import make_spec, shard_from_global

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    net = spectral_models.FNO2d(width=4, modes=(3, 3), layers=2, dtype=torch.float64)

    def loss(net, x):
        return net(x).square().mean()

    torch._dynamo.reset()
    fft._plan.cache_clear()  # no plan recorded eagerly by an earlier test
    step = torch.compile(loss, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    before = compile_counts()
    compiled_net = copy.deepcopy(net)
    for call in range(2):
        compiled_net.zero_grad()
        eager_net = copy.deepcopy(compiled_net)
        x = torch.randn(2, 1, 11, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(call))
        spec = make_spec(ctx.mesh, [Shard(2)], tuple(x.shape), "uneven", dtype=x.dtype, salt=1)
        inputs = [[shard_from_global(x, spec).requires_grad_()] for _ in range(2)]
        outs = run(step, compiled_net, inputs[1])  # compiled first: the FFT plans are traced cold
        eager = run(loss, eager_net, inputs[0])
        assert_same(f"FNO call {call}", torch.float64, outs, eager, inputs[1], inputs[0], compiled_net, eager_net)
    assert compile_counts()["graphs"] - before["graphs"] == 1, "a second step compiled again"
    assert len(graphs) == 2, f"{len(graphs)} forward/backward graphs, expected 2"
    complex_sums = [
        f"{kind}: {node.format_node()}"
        for kind, gm in zip(("forward", "backward"), graphs)
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node.target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)
        and getattr(node.meta.get("val"), "is_complex", lambda: False)()
    ]
    assert not complex_sums, "complex sums Inductor cannot lower:\n" + "\n".join(complex_sums)
    torch._dynamo.reset()
