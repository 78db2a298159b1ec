"""The graph step's function-level fast paths: taken, and bitwise the general path's results.

``torch.cat`` of same-layout ShardTensors along an unsharded dim
(:func:`physicsnemo_dp.rules.joins.cat_same_layout`) and ``torch.index_add``
with a graph's ``dst`` (:func:`physicsnemo_dp.graph._aggregate.index_add_local`),
as a MeshGraphNet block writes them: counted while a layer runs, then the
same layer with both declined (the dispatch-level rules) gives the same bits,
forward and every gradient; both match one process.
"""

from __future__ import annotations

import torch

from torch.distributed.tensor.placement_types import Replicate

from physicsnemo_dp.graph import _dispatch, build_graph
from tests._harness import distributed

from ._graphs import random_case

F = 3


def _block(x, e, src, dst, lin):
    e = e + torch.tanh(lin(torch.cat([e, x[src], x[dst]], dim=-1)))
    return x + torch.index_add(torch.zeros_like(x), 0, dst, e), e


def _counting(fast: bool):
    """Swap in counting wrappers of both fast paths (declining every call unless ``fast``); returns (counts, restore)."""
    taken = {"cat": 0, "index_add": 0}
    originals = {"cat": _dispatch.cat_same_layout, "index_add": _dispatch.index_add_local}

    def counting(name):
        def patched(*args):
            out = originals[name](*args) if fast else None
            taken[name] += out is not None
            return out

        return patched

    def restore():
        _dispatch.cat_same_layout, _dispatch.index_add_local = originals["cat"], originals["index_add"]

    _dispatch.cat_same_layout, _dispatch.index_add_local = counting("cat"), counting("index_add")
    return taken, restore


def _run(ctx, case, fast: bool):
    gen = torch.Generator().manual_seed(7)
    x_full = torch.randn(case.num_nodes, F, dtype=torch.float64, generator=gen)
    torch.manual_seed(1)
    lin = torch.nn.Linear(3 * F, F, dtype=torch.float64)
    g = build_graph(case.given(), case.shard_nodes(ctx.mesh, x_full))
    x = case.shard_nodes(ctx.mesh, x_full).requires_grad_()
    e = (x[g.src] - x[g.dst]).detach().requires_grad_()
    taken, restore = _counting(fast)
    try:
        h, e2 = _block(x, e, g.src, g.dst, lin)
        ((h * h).sum() + (e2 * e2).sum()).backward()
    finally:
        restore()
    grads = [x.grad._local_tensor, e.grad._local_tensor] + [p.grad.clone() for p in lin.parameters()]
    return taken, [h._local_tensor, e2._local_tensor] + grads, (x_full, e, lin, h)


@distributed
def test_fast_paths_taken_and_equal_to_general_path(ctx):
    for seed, (n, m) in enumerate(((29, 70), (12, 9))):  # the small one leaves ranks without nodes or edges
        case = random_case(ctx.mesh, n, m, 60 + seed)
        taken, fast, (x_full, e, lin, h) = _run(ctx, case, True)
        assert taken == {"cat": 1, "index_add": 1}, taken
        declined, general, _ = _run(ctx, case, False)
        assert declined == {"cat": 0, "index_add": 0}
        for a, b in zip(fast, general):
            assert torch.equal(a, b)
        # and one process, on the global edge list in the graph's order
        order = case.order()
        ref_x = x_full.clone().requires_grad_()
        ref_e = e.full_tensor().detach().requires_grad_()
        lin.zero_grad()
        ref_h, ref_e2 = _block(ref_x, ref_e, case.src[order], case.dst[order], lin)
        ((ref_h * ref_h).sum() + (ref_e2 * ref_e2).sum()).backward()
        torch.testing.assert_close(h.full_tensor(), ref_h)
        torch.testing.assert_close(fast[2], case.box(ref_x.grad))


def _other_layout(ctx, case, fast: bool):
    """Gradients handed to both nodes in another layout (replicated): the backward takes the general slices/reads."""
    gen = torch.Generator().manual_seed(8)
    x_full = torch.randn(case.num_nodes, F, dtype=torch.float64, generator=gen)
    g = build_graph(case.given(), case.shard_nodes(ctx.mesh, x_full))
    x = case.shard_nodes(ctx.mesh, x_full).requires_grad_()
    e = (x[g.src] * 2).detach().requires_grad_()
    taken, restore = _counting(fast)
    try:
        joined = torch.cat([e, e * 3], dim=1)
        summed = torch.index_add(torch.zeros_like(x), 0, g.dst, e)
        replicated = [Replicate()] * ctx.mesh.ndim
        grads = [torch.ones_like(t).redistribute(placements=replicated) * 0.5 for t in (joined, summed)]
        (ge,) = torch.autograd.grad([joined, summed], [e], grads)
    finally:
        restore()
    return taken, ge


@distributed
def test_fast_paths_with_gradients_in_another_layout(ctx):
    case = random_case(ctx.mesh, 29, 70, 64)
    taken, fast = _other_layout(ctx, case, True)
    assert taken == {"cat": 1, "index_add": 1}, taken
    _, general = _other_layout(ctx, case, False)
    assert fast._spec.placements == general._spec.placements
    assert torch.equal(fast._local_tensor, general._local_tensor)
    torch.testing.assert_close(fast.full_tensor(), torch.full_like(fast.full_tensor(), 0.5 * (1 + 3) + 0.5))


@distributed
def test_graph_reads_skip_the_generic_checks_and_graph_of_is_kept(ctx):
    """``x[g.src]`` / ``x[g.dst]`` with ``x`` in the graph's own node layout go straight to the graph read
    (no mask or index analysis: ``_masked`` is not called), with the general path's values and gradients;
    ``x`` in another layout takes the general path. ``graph_of`` keeps its answer on the index tensor and
    still refuses an index written in place."""
    import pytest

    from physicsnemo_dp.errors import PlacementError
    from physicsnemo_dp.graph import _graph

    case = random_case(ctx.mesh, 29, 70, 65)
    gen = torch.Generator().manual_seed(9)
    x_full = torch.randn(case.num_nodes, F, dtype=torch.float64, generator=gen)
    g = build_graph(case.given(), case.shard_nodes(ctx.mesh, x_full))
    results = {}
    for fast in (True, False):
        x = case.shard_nodes(ctx.mesh, x_full).requires_grad_()
        assert (x._spec is g.node_spec(tuple(x.shape), x.dtype)) is True  # the graph's own node layout (memoised)
        masked, calls = _dispatch._masked, []

        def counting(*args, masked=masked, calls=calls):
            calls.append(1)
            return masked(*args)

        _dispatch._masked = counting
        if not fast:
            g.__dict__["_row_specs"] = {}  # the identity test finds nothing: the general checks run
        try:
            rows = x[g.src] * 2 + x[g.dst]
        finally:
            _dispatch._masked = masked
        assert len(calls) == (0 if fast else 2)
        (rows * rows).sum().backward()
        results[fast] = (rows._local_tensor, x.grad._local_tensor)
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    order = case.order()
    torch.testing.assert_close(rows.full_tensor(), x_full[case.src[order]] * 2 + x_full[case.dst[order]])
    # another layout of x: the general path (replicated over the graph's dim reads its rows directly)
    if ctx.mesh.ndim == 1 and ctx.world_size > 1:
        rep = case.shard_nodes(ctx.mesh, x_full).redistribute(placements=[Replicate()])
        masked, calls = _dispatch._masked, []
        _dispatch._masked = lambda *args: calls.append(1) or masked(*args)
        try:
            out = rep[g.src]
        finally:
            _dispatch._masked = masked
        assert calls == [1]
        torch.testing.assert_close(out.full_tensor(), x_full[case.src[order]])
    # graph_of: the second look-up does not search the storage; an in-place write is still refused
    tagged, seen = _graph.tagged_graph, []
    _graph.tagged_graph = lambda t: seen.append(1) or tagged(t)
    try:
        assert _graph.graph_of(g.src) is _graph.graph_of(g.src)
    finally:
        _graph.tagged_graph = tagged
    assert seen == []  # both answered from the memo left by the reads above
    g.src.add_(0)
    with pytest.raises(PlacementError, match="modified in place"):
        x[g.src]
