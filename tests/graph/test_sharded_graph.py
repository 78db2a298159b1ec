"""build_graph: edge placement and order, ghost plan, validation, cost; ghost gathers against one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.debug import count_collectives
from physicsnemo_dp.errors import PlacementError
from physicsnemo_dp.graph import build_graph
from tests._harness import distributed

from ._graphs import random_case

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@distributed
def test_placement_order_and_ghost_plan(ctx):
    _placement_check(ctx)


def _placement_check(ctx):
    for seed, (n, e) in enumerate([(23, 60), (7, 0), (40, 5), (1, 3)]):
        case = random_case(ctx.mesh, n, e, seed)
        attr = torch.arange(e, dtype=torch.float64)[:, None] * torch.tensor([1.0, -1.0])
        nodes = case.shard_nodes(ctx.mesh, torch.zeros(n, 1))
        with count_collectives() as counter:
            g = build_graph(case.given(), nodes, edge_attr=attr[case.giver == case.me])
        assert counter.calls["all_to_all"] == 2
        order = case.order()
        owner = case.owner(case.dst[order])
        assert g.edge_sizes == tuple(torch.bincount(owner, minlength=case.group).tolist())
        assert torch.equal(g.src.full_tensor(), case.src[order])
        assert torch.equal(g.dst.full_tensor(), case.dst[order])
        assert torch.equal(g.edge_index.full_tensor(), torch.stack([case.src[order], case.dst[order]]))
        assert torch.equal(g.edge_attr.full_tensor(), attr[order])
        mine = order[owner == case.me]
        lo, hi = (int(b[case.me]) for b in case.node_bounds)
        remote = case.src[mine][(case.src[mine] < lo) | (case.src[mine] >= hi)]
        assert torch.equal(g.ghost_ids, torch.unique(remote))
        assert g.ghost_counts == tuple(torch.bincount(case.owner(g.ghost_ids), minlength=case.group).tolist())
        assert g.num_ghosts == len(g.ghost_ids) and g.num_nodes == n and g.node_sizes == case.node_sizes
        extended = torch.cat([torch.arange(lo, hi), g.ghost_ids])
        assert torch.equal(extended[g.src_slot], case.src[mine])
        assert torch.equal(g.dst_local + lo, case.dst[mine])


def _gather_check(ctx, case, dtype, index_op):
    f = 3
    x_full = torch.randn(case.num_nodes, f, dtype=dtype, generator=torch.Generator().manual_seed(7))
    w = torch.randn(len(case.src), f, dtype=dtype, generator=torch.Generator().manual_seed(8))
    g = build_graph(case.given(), case.shard_nodes(ctx.mesh, x_full))
    x = case.shard_nodes(ctx.mesh, x_full).requires_grad_()
    with count_collectives() as counter:
        y = index_op(x, g.src)
    row = f * dtype.itemsize
    exchanges = 1 if ctx.world_size > 1 else 0  # one rank holding the graph reads its own rows: nothing to move
    assert counter.calls["all_to_all"] == exchanges
    assert counter.total_calls == counter.calls["all_to_all"]
    assert counter.total_received == g.num_ghosts * row
    assert tuple(y._local_tensor.shape) == (g.num_local_edges, f) and y.spec.dim_sizes[0] == g.edge_sizes
    order = case.order()
    ref_x = x_full.clone().requires_grad_()
    ref = ref_x[case.src[order]]
    torch.testing.assert_close(y.full_tensor(), ref, **TOL[dtype])
    # a copy of the index is an ordinary index: the generic rules, same values
    torch.testing.assert_close(index_op(x, g.src.clone()).full_tensor(), ref, **TOL[dtype])
    w_sharded = g.edge_spec(tuple(w.shape), dtype)
    w_local = w[order][g.edge_offset: g.edge_offset + g.num_local_edges]
    with count_collectives() as counter:
        (y * ShardTensor.from_spec(w_local, w_sharded)).sum().backward()
    assert counter.calls["all_to_all"] == exchanges
    (ref * w[order]).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad, **TOL[dtype])
    # destinations: local both ways
    x.grad = None
    with count_collectives() as counter:
        yd = index_op(x, g.dst)
        (yd * ShardTensor.from_spec(w_local, w_sharded)).sum().backward()
    assert counter.calls["all_to_all"] == 0
    ref_x.grad = None
    refd = ref_x[case.dst[order]]
    (refd * w[order]).sum().backward()
    torch.testing.assert_close(yd.full_tensor(), refd, **TOL[dtype])
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad, **TOL[dtype])


_OPS = {
    "getitem": lambda x, i: x[i],
    "index_select": lambda x, i: x.index_select(0, i),
    "torch.index_select": lambda x, i: torch.index_select(x, -2, i),
    "gather": lambda x, i: torch.gather(x, 0, i.view(-1, 1).expand(-1, x.shape[1])),
}


@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@distributed
def test_ghost_gather(ctx, op, dtype):
    for seed, (n, e) in enumerate([(31, 90), (9, 4)]):
        _gather_check(ctx, random_case(ctx.mesh, n, e, 100 + seed), dtype, _OPS[op])


@distributed(world_sizes=(4,), mesh_2d=False)
def test_graph_on_a_mesh_with_ranks_out_of_order(ctx):
    """Edge placement, ghost plan and the ghost all-to-all follow mesh coordinates, not process-group ranks."""
    ctx = dataclasses.replace(ctx, mesh=DeviceMesh(ctx.device.type, [2, 0, 3, 1], mesh_dim_names=("domain",)))
    _placement_check(ctx)
    _gather_check(ctx, random_case(ctx.mesh, 31, 90, 100), torch.float64, _OPS["getitem"])


# --------------------------------------------------------------------------- #
# bad input: the same clear error on every rank, never a hang
# --------------------------------------------------------------------------- #
@distributed(mesh_2d=True)
def test_bad_edge_lists_raise_on_every_rank(ctx):
    case = random_case(ctx.mesh, 10, 20, 1)
    nodes = case.shard_nodes(ctx.mesh, torch.zeros(10, 2))
    given = case.given()
    last = case.me == case.group - 1  # only one rank of each group is wrong
    for bad, match in [
        (torch.cat([given, torch.tensor([[0], [10]])], 1) if last else given, "references node 10"),
        (torch.cat([given, torch.tensor([[-1], [0]])], 1) if last else given, "references node -1"),
        (given[:1] if last else given, "got a 2-d tensor with 1 rows"),
        (given[0] if last else given, "got a 1-d tensor"),
        (given.float() if last else given, "must be an integer tensor"),
    ]:
        with pytest.raises(PlacementError, match=match):
            build_graph(bad, nodes)
    attr = torch.zeros(given.shape[1] + (1 if last else 0), 3)
    with pytest.raises(PlacementError, match="edge_attr on rank .* rows"):
        build_graph(given, nodes, edge_attr=attr)
    if case.group > 1:
        attr = torch.zeros(given.shape[1], 3, dtype=torch.float64 if last else torch.float32)
        with pytest.raises(PlacementError, match="edge_attr differs between ranks"):
            build_graph(given, nodes, edge_attr=attr)
    with pytest.raises(PlacementError, match="node-sharded"):
        build_graph(given, nodes.redistribute(placements=[torch.distributed.tensor.Replicate()] * ctx.mesh.ndim))
    build_graph(given, nodes)  # the group is still in step


@distributed(world_sizes=(2, 3, 4), mesh_2d=True)
def test_graph_used_with_another_layout_raises(ctx):
    case = random_case(ctx.mesh, 12, 30, 2, allow_empty=False)
    g = build_graph(case.given(), case.shard_nodes(ctx.mesh, torch.zeros(12, 1)))
    x = case.shard_nodes(ctx.mesh, torch.randn(12, 3))
    other = random_case(ctx.mesh, 12, 30, 3, allow_empty=False)
    sizes = other.node_sizes if other.node_sizes != case.node_sizes else tuple(reversed(case.node_sizes))
    if sizes == case.node_sizes:
        sizes = (1,) * (case.group - 1) + (12 - case.group + 1,)
    other.node_sizes = sizes
    x_other = other.shard_nodes(ctx.mesh, torch.randn(12, 3))
    for op in (lambda t, i: t[i], lambda t, i: t.index_select(0, i)):
        for index in (g.src, g.dst):
            with pytest.raises(PlacementError, match="not laid out like the graph's nodes"):
                op(x_other, index)
    bigger = random_case(ctx.mesh, 13, 30, 2, allow_empty=False)
    with pytest.raises(PlacementError, match="13 rows"):
        bigger.shard_nodes(ctx.mesh, torch.randn(13, 3))[g.src]
    # messages of another graph (another edge count) aggregated with this graph's index
    g2 = build_graph(torch.cat([case.given(), torch.tensor([[0], [1]])], 1), x)
    msg = x[g2.src]
    with pytest.raises(PlacementError, match="edges"):
        torch.zeros_like(x).index_add_(0, g.dst, msg)
    with pytest.raises(PlacementError, match="two different graphs"):
        x[g.src, g2.dst]
    if ctx.mesh.ndim == 2:  # the same partition on another mesh
        sub = ctx.mesh["domain"]
        x_sub = ShardTensor.from_local(x._local_tensor, sub, [torch.distributed.tensor.Shard(0)],
                                       sharding_shapes={0: [(s, 3) for s in case.node_sizes]})
        with pytest.raises(PlacementError, match="mesh"):
            x_sub[g.src]
    g.src.add_(0)
    with pytest.raises(PlacementError, match="modified in place"):
        x[g.src]
