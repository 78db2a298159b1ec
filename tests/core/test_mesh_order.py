"""Meshes whose ranks are not in increasing order, and meshes from ``DeviceMesh.from_group``.

Shard ``i`` lives at mesh coordinate ``i``; the mesh dim's process group numbers its
members by increasing global rank, so on ``DeviceMesh("cpu", [3, 2, 1, 0])`` coordinate
and group rank differ and every positional argument of a collective (split lists,
gathered order, peers, broadcast source) must be translated (``_mesh_order.py``).
The property tests (``tests/properties/test_mesh_order.py``) draw any order for every
core family; these are the reported cases and the meshes the harness never builds.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import physicsnemo_dp as pdp
from physicsnemo_dp import Replicate, Shard, ShardTensor, _mesh_order
from tests._harness import distributed


def _sharded(whole: torch.Tensor, mesh: DeviceMesh, placements, dim: int = 0) -> ShardTensor:
    """``whole`` split by the split rule along ``dim`` over every mesh dim, this rank's piece at its coordinate."""
    coord = mesh.get_coordinate()
    flat = 0
    for m in range(mesh.ndim):
        flat = flat * mesh.size(m) + coord[m]
    local = whole.chunk(mesh.size(), dim)[flat].clone()
    return ShardTensor.from_local(local, mesh, placements, sharding_shapes="chunk", global_shape=whole.shape)


@pytest.mark.parametrize("checks", [False, True])
@distributed(world_sizes=(4,), mesh_2d=False)
def test_reversed_mesh_reported_cases(ctx, checks):
    """``DeviceMesh("cpu", [3, 2, 1, 0])``: indexing, cumsum, slicing arithmetic, redistribute."""
    mesh = DeviceMesh(ctx.device.type, [3, 2, 1, 0])
    assert mesh.get_coordinate() == (3 - ctx.rank,) and mesh.get_local_rank(0) == ctx.rank  # they differ
    rows = torch.arange(24.0, device=ctx.device).reshape(8, 3)
    steps = torch.arange(8.0, device=ctx.device) // 2
    with pdp.debug.checks() if checks else contextlib.nullcontext():
        st = _sharded(rows, mesh, [Shard(0)])
        assert torch.equal(st.full_tensor(), rows)
        assert torch.equal(st[5].full_tensor(), rows[5])  # before: uninitialised memory
        cumsum = _sharded(steps, mesh, [Shard(0)]).cumsum(0).full_tensor()
        assert cumsum.tolist() == [0, 0, 1, 2, 4, 6, 9, 12]  # before: [6, 6, 3, 4, 2, 4, 3, 6]
        assert torch.equal((st[1:6] * 2 + st[2:7]).full_tensor(), rows[1:6] * 2 + rows[2:7])  # before: gloo crash
        replicated = st.redistribute(mesh, [Replicate()])  # before: gloo crash
        assert torch.equal(replicated.to_local(), rows)
        assert torch.equal(replicated.redistribute(mesh, [Shard(1)]).full_tensor(), rows)
        scattered = pdp.scatter_tensor(rows if ctx.rank == 1 else None, 1, mesh, [Shard(0)])
        assert torch.equal(scattered.to_local(), st.to_local())


@distributed(world_sizes=(4,), mesh_2d=False)
def test_mesh_order_maps_coordinates_to_group_ranks(ctx):
    """The translation table itself: identity meshes translate nothing, a reversed mesh all."""
    assert _mesh_order.line(DeviceMesh(ctx.device.type, [0, 1, 2, 3]), 0) == (ctx.rank, None, None)
    line = _mesh_order.line(DeviceMesh(ctx.device.type, [3, 2, 1, 0]), 0)
    assert line == (3 - ctx.rank, (3, 2, 1, 0), (3, 2, 1, 0))
    line = _mesh_order.line(DeviceMesh(ctx.device.type, [[2, 0], [3, 1]]), 1)  # rows [2, 0] and [3, 1]
    assert line.me == {2: 0, 0: 1, 3: 0, 1: 1}[ctx.rank] and line.to_group == (1, 0)


def _from_group_mesh(ctx) -> DeviceMesh:
    """A 2x2 ``("ddp", "domain")`` mesh over ``[[2, 0], [3, 1]]`` made with ``DeviceMesh.from_group``."""
    layout = [[2, 0], [3, 1]]
    groups = {}
    for ranks in ([2, 3], [0, 1], [2, 0], [3, 1]):  # columns (dim 0), then rows (dim 1); every rank makes all
        groups[tuple(ranks)] = dist.new_group(ranks)
    column = next(g for ranks, g in list(groups.items())[:2] if ctx.rank in ranks)
    row = next(g for ranks, g in list(groups.items())[2:] if ctx.rank in ranks)
    return DeviceMesh.from_group([column, row], ctx.device.type, mesh=layout, mesh_dim_names=("ddp", "domain"))


@distributed(world_sizes=(4,), mesh_2d=False)
def test_from_group_mesh(ctx):
    """Redistribute, a halo conv, a contraction and ring attention on a ``from_group`` mesh out of order."""
    mesh = _from_group_mesh(ctx)
    assert _mesh_order.line(mesh, 1).to_group == (1, 0)  # the domain dim's coordinates and group ranks differ
    torch.manual_seed(0)
    image, weight = torch.randn(2, 2, 11, 5, dtype=torch.float64), torch.randn(3, 2, 3, 3, dtype=torch.float64)
    x = ShardTensor.from_local(image.chunk(2, 0)[mesh.get_coordinate()[0]].chunk(2, 2)[mesh.get_coordinate()[1]].clone(),
                               mesh, [Shard(0), Shard(2)])  # shapes inferred: one all-gather
    assert torch.equal(x.full_tensor(), image)
    for placements in ([Replicate(), Shard(3)], [Shard(2), Shard(2)], [Replicate(), Replicate()]):
        assert torch.equal(x.redistribute(mesh, placements).full_tensor(), image)
    assert torch.allclose(F.conv2d(x, weight, padding=1).full_tensor(), F.conv2d(image, weight, padding=1))
    assert torch.allclose((x @ x.transpose(2, 3)).full_tensor(), image @ image.transpose(2, 3))
    q, k, v = (torch.randn(2, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    domain = mesh["domain"]
    sharded = [_sharded(t, domain, [Shard(2)], dim=2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*sharded, is_causal=True)  # ring: both sequences sharded
    assert torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@distributed(world_sizes=(4,), mesh_2d=False)
def test_mesh_and_groups_that_disagree_raise_on_every_rank(ctx):
    """Groups over other ranks than the mesh's lines: a clear error, not traffic with the wrong ranks."""
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    column, row = columns[ctx.rank % 2], rows[ctx.rank // 2]
    mesh = DeviceMesh.from_group([row, column], ctx.device.type, mesh=[[0, 1], [2, 3]],
                                 mesh_dim_names=("ddp", "domain"))  # dims swapped: row groups along dim 0
    with pytest.raises(RuntimeError, match="the mesh and its process groups disagree"):
        ShardTensor.from_local(torch.ones(2, device=ctx.device), mesh, [Shard(0), Replicate()])


@distributed(world_sizes=(4,), mesh_2d=False, timeout=240)
def test_compiled_on_a_reversed_mesh(ctx):
    """Traced code takes the functional collectives (a halo becomes an all-to-all there): translated alike."""
    from tests.compile._compare import compare

    mesh = DeviceMesh(ctx.device.type, [3, 2, 1, 0])
    torch.manual_seed(0)
    x, w = torch.randn(2, 2, 13, dtype=torch.float64), torch.randn(3, 2, 3, dtype=torch.float64)
    fn = lambda x, w: F.conv1d(x, w, padding=1).cumsum(2)  # noqa: E731  halo all-to-all, then a gathered scan
    out = fn(_sharded(x, mesh, [Shard(2)], dim=2), w).full_tensor()
    assert torch.allclose(out, fn(x, w))
    compare(fn, [(x, [Shard(2)]), (w, None)], mesh, backend="aot_eager", grad=False, label="reversed mesh")
