"""On a mesh of one rank a traced graph is plain torch's: what the library would add there, it does not.

The graphs AOTAutograd hands the backend are captured (forward and backward,
``aot_eager`` otherwise) and read op by op, and every compiled step is
compared with eager on the same inputs (outputs and layouts, input and
parameter gradients):

* ``layer_norm`` over whole rows traces to torch's ``native_layer_norm`` and
  its backward, not the decomposed statistics (about ten elementwise ops a
  call, which the compiled step paid at P = 1 before);
* a MeshGraphNet's graph tables enter its graph once each, however many
  layers read them (each read was a ``lift_fresh_copy``, a copy per call
  under Inductor), and its aggregations are torch's out-of-place ops (no
  ``clone`` of the zero target before an in-place one);
* a transformer block whose attention is a ring of one rank compiles as one
  graph with ``fullgraph=True`` (the ring's eager-only entry, a graph break,
  is for rings of two ranks and more: ``tests/compile/test_transformer.py``).
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch.distributed.tensor.placement_types import Shard

from tests._harness import distributed

from ._compare import assert_same, make_inputs, run
from ._models import Block

aten = torch.ops.aten


class _Capture:
    """A ``torch.compile`` backend recording the ATen ops of each forward and backward graph AOTAutograd makes."""

    def __init__(self):
        self.graphs = {"forward": [], "backward": []}
        self.frames = 0

    def _compiler(self, kind):
        from functorch.compile import make_boxed_func

        def compile_graph(gm, example_inputs):
            self.graphs[kind].append(Counter(n.target for n in gm.graph.nodes if n.op == "call_function"))
            return make_boxed_func(gm.forward)

        return compile_graph

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        self.frames += 1
        return aot_autograd(fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"))(
            gm, example_inputs
        )

    def count(self, kind, op) -> int:
        return sum(c[op] for c in self.graphs[kind])


def _compiled_against_eager(fn, module, xs_of, label):
    """``fn(module, *xs)`` compiled (fullgraph, captured) and eager on fresh copies: the capture, checked equal."""
    capture = _Capture()
    torch._dynamo.reset()
    compiled_module, eager_module = copy.deepcopy(module), copy.deepcopy(module)
    xs, eager_xs = xs_of(), xs_of()
    outs = run(torch.compile(fn, backend=capture, fullgraph=True), compiled_module, xs)
    eager = run(fn, eager_module, eager_xs)
    assert_same(label, torch.float64, outs, eager, xs, eager_xs, compiled_module, eager_module)
    torch._dynamo.reset()
    return capture


@distributed(world_sizes=(1,), mesh_2d=False, timeout=600)
def test_layer_norm_traces_to_torchs_kernel(ctx):
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8, dtype=torch.float64)
    g = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    capture = _compiled_against_eager(
        lambda m, x: m(x), norm, lambda: make_inputs([(g, (Shard(1),))], ctx.mesh), "layer_norm, one rank"
    )
    assert capture.count("forward", aten.native_layer_norm.default) == 1, capture.graphs
    assert capture.count("backward", aten.native_layer_norm_backward.default) == 1, capture.graphs
    for op in (aten.rsqrt.default, aten.var_mean.correction, aten.sum.dim_IntList):
        assert capture.count("forward", op) == 0, f"{op} in the forward graph: {capture.graphs['forward']}"


@distributed(world_sizes=(1,), mesh_2d=False, timeout=600)
def test_meshgraphnet_reads_each_graph_table_once(ctx):
    """The benchmark's MeshGraphNet (tiny sizes, 2 layers): at P = 1 the graph's tables are the destination rows
    and the source slots, each lifted once; the plain model's graph has no such constants at all (its indices
    are inputs), and its LayerNorms and aggregations are the same ops as plain torch's."""
    from benchmarks import compiled, graph

    sizes = compiled.sizes(True, 1.0)
    _, (x, e, src, dst), _ = graph.inputs(ctx.mesh, sizes["around"], sizes["rings"])
    net = graph.model(sizes["width"], sizes["layers"], ctx.device).double()

    def loss(net, x, e):
        return (net(x, e, src, dst) * torch.arange(x.shape[0], dtype=x.dtype)[:, None]).square().mean()

    def inputs():
        return [t.detach().double().requires_grad_() for t in (x, e)]

    capture = _compiled_against_eager(loss, net, inputs, "MeshGraphNet, one rank")
    lifted = capture.count("forward", aten.lift_fresh_copy.default) + capture.count(
        "backward", aten.lift_fresh_copy.default
    )
    assert lifted == 2, f"{lifted} graph tables lifted into the graphs (2 distinct tables at P = 1)"
    norms = sum(isinstance(m, torch.nn.LayerNorm) for m in net.modules())
    assert capture.count("forward", aten.native_layer_norm.default) == norms, capture.graphs["forward"]
    assert capture.count("forward", aten.clone.default) == 0, capture.graphs["forward"]
    assert capture.count("forward", aten.index_add.default) == sizes["layers"], capture.graphs["forward"]


@distributed(world_sizes=(1,), mesh_2d=False, timeout=600)
def test_transformer_block_is_one_graph_when_the_ring_has_one_rank(ctx):
    from ._cases import _g

    torch.manual_seed(0)
    capture = _compiled_against_eager(
        lambda m, x: m(x), Block(), lambda: make_inputs([(_g(2, 9, 8), (Shard(1),))], ctx.mesh), "block, one rank"
    )
    assert capture.frames == 1, f"{capture.frames} graphs: the attention broke the graph"
    assert capture.count("forward", aten._scaled_dot_product_flash_attention_for_cpu.default) == 1


@distributed(world_sizes=(1,), mesh_2d=False, timeout=600)
def test_region_outputs_aliasing_one_base_skip_the_dispatcher(ctx):
    """AOTAutograd hides outputs that alias one base (``q, k, v`` of one projection) behind
    ``aten._unsafe_view(o, o.shape)`` on every call; on ShardTensors that is served above the dispatcher
    (no rule runs at run time), with the values, layouts and gradients of eager. A recorded call (input
    requiring grad, grad mode on) still takes the dispatcher path and autograd's node."""
    import physicsnemo_dp.shard_tensor as st
    from benchmarks.compiled import _QKV

    torch.manual_seed(0)
    qkv = _QKV(8, 2).double()
    g = torch.randn(1, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xs = make_inputs([(g, (Shard(1),))], ctx.mesh)
    compiled = torch.compile(copy.deepcopy(qkv), backend="aot_eager", fullgraph=True)
    compiled(*make_inputs([(g, (Shard(1),))], ctx.mesh))  # compiled here, not counted below
    seen, dispatch = [], st.handle_torch_dispatch
    st.handle_torch_dispatch = lambda func, *rest: seen.append(func) or dispatch(func, *rest)
    try:
        outs = compiled(*xs)
    finally:
        st.handle_torch_dispatch = dispatch
    assert aten._unsafe_view.default not in seen, seen
    eager_xs = make_inputs([(g, (Shard(1),))], ctx.mesh)
    eager = qkv(*eager_xs)
    for o, e in zip(outs, eager):
        assert o._spec == e._spec and torch.equal(o._local_tensor, e._local_tensor)
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    sum((e * (i + 1)).sum() for i, e in enumerate(eager)).backward()
    assert torch.equal(xs[0].grad._local_tensor, eager_xs[0].grad._local_tensor)
    recorded = torch.ops.aten._unsafe_view(eager_xs[0] * 1, tuple(g.shape))
    assert "UnsafeView" in recorded.grad_fn.name(), recorded.grad_fn


@distributed(world_sizes=(1,), mesh_2d=False, timeout=600)
def test_guards_compare_specs_by_identity_and_recompile_on_a_new_layout(ctx):
    """Specs are immutable, so a (deep) copy is the spec itself: torch.compile's guards and tangent checks
    keep the very object and compare on identity. A spec equal but not identical passes the guard; a new
    layout of the same local and global shapes (another sharded dim) still compiles a new graph."""
    from physicsnemo_dp import ShardTensor, ShardTensorSpec
    from physicsnemo_dp.debug import compile_counts
    from physicsnemo_dp.spec import _built_spec

    g = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x = ShardTensor.from_spec(g.clone(), ShardTensorSpec.chunked(ctx.mesh, [Shard(0)], (4, 4), g.dtype))
    assert copy.deepcopy(x._spec) is x._spec and copy.copy(x._spec) is x._spec
    torch._dynamo.reset()
    fn = torch.compile(lambda t: (t * 2).sum(dim=1), backend="aot_eager", fullgraph=True)
    start = compile_counts()["graphs"]
    out = fn(x)
    assert out._spec.placements == (Shard(0),)
    _built_spec.cache_clear()  # the same layout as a new, equal object: no recompilation
    same = ShardTensor.from_spec(g.clone(), ShardTensorSpec.chunked(ctx.mesh, [Shard(0)], (4, 4), g.dtype))
    assert same._spec is not x._spec and same._spec == x._spec
    fn(same)
    assert compile_counts()["graphs"] - start == 1
    other = ShardTensor.from_spec(g.clone(), ShardTensorSpec.chunked(ctx.mesh, [Shard(1)], (4, 4), g.dtype))
    out = fn(other)
    assert compile_counts()["graphs"] - start == 2, "a new layout must compile a new graph"
    assert out._spec.placements != (Shard(0),)  # the sum over the sharded dim: a pending sum
    assert torch.equal(out.full_tensor(), (g * 2).sum(dim=1))
    torch._dynamo.reset()
