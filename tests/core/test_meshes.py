"""One mesh object per mesh and process groups (physicsnemo_dp._meshes), and what depends on it.

``mesh["domain"]`` returns a new object on every call, equal to the last. Before
canonical meshes, an op's plan cached for one object came back holding it for
inputs on another: the output sat on the first object, its input on the second.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from physicsnemo_dp import Replicate, Shard, ShardTensor, _meshes, count_collectives
from physicsnemo_dp.distributed import MeshContext
from physicsnemo_dp.promotion import bucket_gradients, clear_gradient_buckets
from tests._harness import distributed


def _slices(ctx):
    """Two equal, distinct 1-D mesh objects over the same process group."""
    full = init_device_mesh(ctx.device.type, (1, ctx.world_size), mesh_dim_names=("ddp", "domain"))
    first, second = full["domain"], full["domain"]
    assert first is not second and first == second
    return first, second


def _tokens(mesh, seed: int, ctx) -> ShardTensor:
    torch.manual_seed(seed)
    whole = torch.randn(2, 3 * ctx.world_size + 1, 4, device=ctx.device)
    return ShardTensor.from_local(
        whole.chunk(ctx.world_size, dim=1)[ctx.rank].clone(), mesh, [Shard(1)], sharding_shapes="infer"
    )


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_equal_mesh_objects_share_one_mesh_and_outputs_stay_on_it(ctx):
    first, second = _slices(ctx)
    a, b = _tokens(first, 0, ctx), _tokens(second, 1, ctx)
    assert a.device_mesh is b.device_mesh  # one object for both
    assert (a + b).device_mesh is a.device_mesh
    c = _tokens(
        init_device_mesh(ctx.device.type, (1, ctx.world_size), mesh_dim_names=("ddp", "domain"))["domain"], 2, ctx
    )
    assert torch.tanh(c).device_mesh is c.device_mesh  # the plan of tanh was cached on another object first


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_a_mesh_over_other_process_groups_never_gets_their_plans(ctx):
    """A mesh over a new process group of the same ranks equals the old one but must keep its own group."""
    ranks = list(range(ctx.world_size))
    old, new = (
        DeviceMesh.from_group(dist.new_group(ranks), ctx.device.type, mesh_dim_names=("domain",)) for _ in range(2)
    )
    assert old == new and old.get_group(0).group_name != new.get_group(0).group_name
    x_old, x_new = _tokens(old, 3, ctx), _tokens(new, 3, ctx)
    assert x_old.device_mesh is not x_new.device_mesh
    for x in (x_old, x_new):  # the same plan twice: each output on its input's mesh and groups
        y = x.sum(dim=1).redistribute(placements=[Replicate()])
        assert y.device_mesh is x.device_mesh
        assert torch.allclose(y.to_local(), x.full_tensor().sum(dim=1))


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_a_bucket_promotes_once_when_inputs_come_on_a_new_mesh_object_each_step(ctx):
    """A training loop that slices ``mesh["domain"]`` per step: one bucket node, one all-reduce."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).to(ctx.device)
    bucket_gradients(net)
    full = init_device_mesh(ctx.device.type, (1, ctx.world_size), mesh_dim_names=("ddp", "domain"))
    try:
        for step in range(3):
            loss = net(_tokens(full["domain"], step, ctx)).pow(2).sum().redistribute(placements=[Replicate()])
            with count_collectives() as counter:
                loss.backward()
            assert counter.calls["all_reduce"] == 1, counter.summary()
    finally:
        clear_gradient_buckets()


def _gloo_worker_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in tasks.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_destroyed_process_groups_are_let_go(monkeypatch):
    """A script's ``destroy_process_group`` frees its groups, though specs still hold their meshes.

    A ``DeviceMesh`` keeps its groups' objects; the library keeps its meshes
    (specs, plans). Groups that lived on into interpreter shutdown joined their
    worker threads there and could abort a clean run. Re-initialising in the
    same process must give specs the new groups' mesh.
    """
    assert not dist.is_initialized(), "this test builds its own single-process default group"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = _gloo_worker_threads()
    meshes = []
    try:
        for _ in range(2):  # the second round re-creates groups with the same names
            mesh = MeshContext.build(domain_size=1, strategy=None, device_type="cpu").domain_mesh
            x = ShardTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)])
            assert torch.equal(x.sum().full_tensor(), x.to_local().sum())
            meshes.append(x.device_mesh)
            assert _gloo_worker_threads() > before
            dist.destroy_process_group()
        assert meshes[1] is not meshes[0]  # not the mesh of the destroyed groups
        assert _gloo_worker_threads() > before  # the live canonical mesh still holds its destroyed groups
        _meshes._release_destroyed_groups()  # what runs at interpreter exit
        assert _gloo_worker_threads() == before
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
