"""The compile protocol of ShardTensor, case by case.

What torch.compile needs from the subclass beyond "each op family compiles"
(``test_matrix``): conversions inside compiled code, tangents in another
layout than the output, graphs that differ per rank (cache keys, collectives
that one rank does not use), and the documented limits.
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensor, ShardTensorSpec, collectives, count_collectives
from physicsnemo_dp.dispatch.registry import function_handlers
from physicsnemo_dp.rule_kit import wrap
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._cases import _g, _sharded
from ._compare import BACKENDS, compare, meshes_for, skip_unless_in_scope

SHAPE = (7, 5, 3)


@meshes_for("aot_eager")
def test_conversions_inside_compiled_code_aot_eager(ctx):
    _conversions(ctx, "aot_eager")


@meshes_for("inductor")
def test_conversions_inside_compiled_code_inductor(ctx):
    _conversions(ctx, "inductor")


def _conversions(ctx, backend):
    """redistribute / full_tensor / to_local are opaque calls in the graph; from_local is one call too."""
    skip_unless_in_scope(ctx, backend, inductor_by_default=False)
    m = ctx.mesh
    x = [(_g(*SHAPE), _sharded(m, 0, 1))]
    moved = _sharded(m, 1, 2)
    compare(lambda x: x.redistribute(placements=moved) * 2, x, m, backend=backend, label="redistribute")
    compare(lambda x: x.sum(0).full_tensor() + x.full_tensor().mean(), x, m, backend=backend, label="full_tensor")
    compare(lambda x: torch.tanh(x.to_local()) * 2, x, m, backend=backend, label="to_local")

    def rewrap(x):
        local = torch.sin(x.to_local())
        return ShardTensor.from_local(local, m, x.placements, sharding_shapes=x._spec.sharding_shapes()) * 3

    compare(rewrap, x, m, backend=backend, label="from_local(dict)")
    chunked = lambda x: ShardTensor.from_local(x.to_local() * 2, m, x.placements, "chunk", global_shape=SHAPE)  # noqa: E731
    compare(chunked, x, m, backend=backend, kind="chunk", label='from_local("chunk")')


@distributed(world_sizes=(3,), mesh_2d=False, timeout=300)
def test_from_local_infer_is_refused_inside_compiled_code(ctx):
    """Inferring the other ranks' shapes needs data at run time: a clear error, not a hang."""
    torch._dynamo.reset()
    x = shard_from_global(_g(*SHAPE), make_spec(ctx.mesh, (Shard(0),), SHAPE))
    f = torch.compile(lambda x: ShardTensor.from_local(x.to_local() * 2, ctx.mesh, [Shard(0)]), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match='sharding_shapes="chunk"'):
        f(x)
    torch._dynamo.reset()


@distributed(world_sizes=(3,), mesh_2d=False, timeout=300)
def test_tangent_in_another_layout_is_coerced(ctx):
    """A compiled output that is Partial (a pending sum) traces its tangent as Replicate; a gradient
    arriving Partial or with other shard sizes is redistributed to that guess at run time."""
    m = ctx.mesh
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.tanh(x).sum(0), backend="aot_eager", fullgraph=True)
    G = _g(*SHAPE)
    for kind, grad_placements in (("uneven", (Replicate(),)), ("uneven", (Partial(),)), ("chunk", (Shard(0),))):
        x = shard_from_global(G, make_spec(m, (Shard(0),), SHAPE), requires_grad=True)
        out = f(x)
        assert out.placements == (Partial(),)
        w = _g(*out.shape, seed=5)
        out.backward(shard_from_global(w, make_spec(m, grad_placements, tuple(out.shape), kind)))
        ref = G.clone().requires_grad_(True)
        torch.tanh(ref).sum(0).backward(w)
        assert torch.allclose(x.grad.full_tensor(), ref.grad, atol=1e-12), grad_placements
    torch._dynamo.reset()


# --------------------------------------------------------------------------- #
# Graphs differ per rank
# --------------------------------------------------------------------------- #
class _Lopsided(torch.autograd.Function):
    """Collectives whose use differs on rank 1 (as with an empty shard): a forward sum that rank 1
    does not use, and a second backward sum to which rank 1 contributes zeros, not gradients.
    Eagerly every rank takes part in every collective, in the same order; compiled graphs must too."""

    @staticmethod
    def forward(x):
        local, spec = x._local_tensor, x._spec
        total = collectives.all_reduce(local, "sum", spec.mesh, 0)
        return wrap(local * 2 if spec.coordinate[0] == 1 else total, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = inputs[0]._spec

    @staticmethod
    def backward(ctx, grad):
        g, mesh = grad._local_tensor, ctx.spec.mesh
        first = collectives.all_reduce(g, "sum", mesh, 0)
        share = torch.zeros((1, g.shape[1]), dtype=g.dtype) if ctx.spec.coordinate[0] == 1 else g[:1]
        second = collectives.all_reduce(share, "sum", mesh, 0)
        return wrap(first + second, ctx.spec)


def _lopsided(func, types, args, kwargs):
    return _Lopsided.apply(args[0])


@pytest.mark.parametrize("backend", (*BACKENDS, "aot_eager_default_partitioner"))
@distributed(world_sizes=(3,), mesh_2d=False, timeout=300)
def test_collective_unused_on_one_rank_stays_in_every_graph(ctx, backend):
    """AOTAutograd assumes identical graphs on all ranks: it drops dead collectives and moves
    backward collectives that ignore the gradients into the forward. Ours differ per rank; without
    the guards in ``_torch_compat`` this test hangs (rank 1 skips collectives the others wait in)."""
    with function_handlers.override(torch.special.erfcx, _lopsided):
        compare(lambda x: torch.special.erfcx(x) * 3, [(_g(6, 2), (Replicate(),))], ctx.mesh, backend=backend, label="lopsided")


@distributed(world_sizes=(2,), mesh_2d=False, timeout=600)
def test_compiled_graphs_are_not_shared_between_ranks(ctx):
    """Both ranks compile the same calls on the same layout and local shape, yet each keeps its own
    rows: the graphs differ per rank. AOTAutograd's on-disk cache (keyed by the call, not the rank)
    is bypassed, so a second compilation cannot replay the other rank's graph; Inductor's cache,
    keyed by the traced graph, may hit."""
    from torch._dynamo.utils import counters

    m = ctx.mesh
    G = torch.arange(24, dtype=torch.float64).reshape(8, 3)
    x = shard_from_global(G, ShardTensorSpec.chunked(m, (Replicate(),), G.shape, G.dtype))
    calls = {
        "ShardTensor input": (lambda x: x.redistribute(placements=[Shard(0)]) * 2, x),
        "from_local inside": (lambda t: ShardTensor.from_local(t, m, [Replicate()], "chunk", global_shape=G.shape).redistribute(placements=[Shard(0)]).to_local() * 2, G),
    }
    expected = (x.redistribute(placements=[Shard(0)]) * 2)._local_tensor
    for label, (fn, arg) in calls.items():
        for attempt in range(2):
            torch._dynamo.reset()
            counters.clear()
            out = torch.compile(fn, backend="inductor", fullgraph=True)(arg)
            local = out._local_tensor if isinstance(out, ShardTensor) else out
            assert torch.equal(local, expected), (label, attempt)
            assert counters["aot_autograd"]["autograd_cache_hit"] == 0, (label, dict(counters["aot_autograd"]))
    torch._dynamo.reset()


@distributed(world_sizes=(3,), mesh_2d=False, timeout=300)
def test_collectives_are_counted_when_traced_not_when_run(ctx):
    """count_collectives records Python calls: in a compiled region they happen while tracing."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.redistribute(placements=[Shard(1)]) * 2, backend="aot_eager", fullgraph=True)
    x = shard_from_global(_g(*SHAPE), make_spec(ctx.mesh, (Shard(0),), SHAPE))
    with count_collectives() as first:
        f(x)
    with count_collectives() as second:
        f(x)
    assert first.total_calls > 0 and second.total_calls == 0
    torch._dynamo.reset()


@distributed(world_sizes=(3,), mesh_2d=False, timeout=300)
def test_index_range_check_runs_inside_compiled_code(ctx):
    """Reads along a sharded dim map foreign indices to "not owned", so their range check must survive
    tracing (as a graph op: a data-dependent Python int would fail to compile) to stay no silent zero."""
    torch._dynamo.reset()
    x = shard_from_global(_g(*SHAPE), make_spec(ctx.mesh, (Shard(0),), SHAPE))
    f = torch.compile(lambda x, i: torch.index_select(x, 0, i) * 2, backend="aot_eager", fullgraph=True)
    good = torch.tensor([6, 0, 2])
    assert torch.equal(f(x, good).full_tensor(), _g(*SHAPE)[good] * 2)
    for bad in (torch.tensor([6, 7, 0]), torch.tensor([0, -1, 2])):  # index_select takes no negatives
        with pytest.raises(RuntimeError, match=r"out of bounds for dim 0 with size 7 \(valid: \[0, 6\]\)"):
            f(x, bad)
    torch._dynamo.reset()


def test_traced_sees_fake_tensors_wrapped_by_torch_func():
    """A ``torch.func.vjp`` inside a traced backward (the window ops' local gradients) wraps fake tensors in
    plain-typed functorch wrappers: ``traced`` must see through them, or index tables become real tensors
    that fake tensors refuse (the U-Net's upsampling failed to compile that way)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from physicsnemo_dp._torch_compat import traced

    seen = []

    def f(t):
        seen.append(traced(t))
        return t * 2

    with FakeTensorMode() as mode:
        torch.func.vjp(f, mode.from_tensor(torch.ones(3)))
    torch.func.vjp(f, torch.ones(3))
    assert seen == [True, False]
