"""A transformer block with sequence-sharded attention under torch.compile.

With the token dim sharded, ``F.scaled_dot_product_attention`` runs ring
attention, whose point-to-point loop has no graph representation: it runs
eagerly. Three ways to compile the block, all checked against eager (outputs,
input and parameter gradients):

* the whole block, ``fullgraph=False``: exactly one graph break, at the
  attention call (none when the tokens' mesh dim has one rank: a ring of one
  rank sends nothing and is traced);
* the whole block, ``fullgraph=True``: refused with an error naming ring attention;
* the recommended regional pattern: the token-wise parts compiled with
  ``fullgraph=True``, the attention called between them.

"The ring runs eagerly" is proven by counting: ``count_collectives`` records
Python-level calls, which a compiled graph no longer makes at run time. On a
second call every recorded collective is the ring's ``send_recv`` and there
are exactly as many as in eager mode.
"""

import copy

import pytest
import torch

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ._cases import _g, _sharded
from ._compare import assert_same, make_inputs, meshes_for, run, skip_unless_in_scope
from ._models import Block, RegionalBlock


def _tokens(mesh):
    return [(_g(2, 9, 8), _sharded(mesh, 1, 0))]  # (batch, tokens, features), tokens sharded


def _forward(model, x):
    return model(x)


def _ring_calls(model, mesh):
    """What a forward records: must be only the ring's point-to-point hops."""
    x = make_inputs(_tokens(mesh), mesh)[0]
    with count_collectives() as c:
        model(x)
    return dict(c.calls)


def _check_against_eager(compiled, eager, mesh, label):
    xs, eager_xs = make_inputs(_tokens(mesh), mesh), make_inputs(_tokens(mesh), mesh)
    outs = run(_forward, compiled, xs)
    expected = run(_forward, eager, eager_xs)
    assert_same(label, torch.float64, outs, expected, xs, eager_xs, compiled, eager)
    eager_calls = _ring_calls(eager, mesh)
    # second call: compiled regions run as graphs, only the eager ring records
    assert _ring_calls(compiled, mesh) == {k: v for k, v in eager_calls.items() if k == "send_recv"}, eager_calls


@meshes_for("aot_eager")
def test_whole_block_breaks_the_graph_once_at_the_ring_aot_eager(ctx):
    _whole_block(ctx, "aot_eager")


@meshes_for("inductor")
def test_whole_block_breaks_the_graph_once_at_the_ring_inductor(ctx):
    _whole_block(ctx, "inductor")


def _whole_block(ctx, backend):
    skip_unless_in_scope(ctx, backend, inductor_by_default=False)  # Inductor: the regional test below
    torch.manual_seed(0)
    eager = Block()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled)(*make_inputs(_tokens(ctx.mesh), ctx.mesh))
    if ctx.mesh.size(0) == 1:  # a ring of one rank sends nothing: traced with the rest (tests/compile/test_one_rank.py)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    else:
        assert explained.graph_break_count == 1, [b.reason for b in explained.break_reasons]
        assert "ring attention" in explained.break_reasons[0].reason
        assert "scaled_dot_product_attention" in explained.break_reasons[0].user_stack[-1].line
    torch._dynamo.reset()
    _check_against_eager(torch.compile(compiled, backend=backend), eager, ctx.mesh, f"whole block [{backend}]")
    torch._dynamo.reset()


@distributed(world_sizes=(3,), mesh_2d=False, timeout=600)
def test_fullgraph_refuses_ring_attention(ctx):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = torch.compile(Block(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="ring attention"):
        model(make_inputs(_tokens(ctx.mesh), ctx.mesh)[0])
    torch._dynamo.reset()


@meshes_for("aot_eager")
def test_regional_compile_aot_eager(ctx):
    _regional(ctx, "aot_eager")


@meshes_for("inductor")
def test_regional_compile_inductor(ctx):
    _regional(ctx, "inductor")


def _regional(ctx, backend):
    skip_unless_in_scope(ctx, backend)
    torch.manual_seed(0)
    eager = Block()
    torch.manual_seed(0)
    regional = RegionalBlock(backend)  # same modules, same initial weights
    torch._dynamo.reset()
    _check_against_eager(regional, eager, ctx.mesh, f"regional [{backend}]")
    torch._dynamo.reset()
