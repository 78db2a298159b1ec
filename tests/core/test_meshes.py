"""One mesh object per mesh and process groups (physicsnemo_dp._meshes), and what depends on it.

``mesh["domain"]`` returns a new object on every call, equal to the last. Before
canonical meshes, an op's plan cached for one object came back holding it for
inputs on another: the output sat on the first object, its input on the second.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from physicsnemo_dp import Replicate, Shard, ShardTensor, count_collectives
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
    return ShardTensor.from_local(whole.chunk(ctx.world_size, dim=1)[ctx.rank].clone(), mesh, [Shard(1)],
                                  sharding_shapes="infer")


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_equal_mesh_objects_share_one_mesh_and_outputs_stay_on_it(ctx):
    first, second = _slices(ctx)
    a, b = _tokens(first, 0, ctx), _tokens(second, 1, ctx)
    assert a.device_mesh is b.device_mesh  # one object for both
    assert (a + b).device_mesh is a.device_mesh
    c = _tokens(init_device_mesh(ctx.device.type, (1, ctx.world_size), mesh_dim_names=("ddp", "domain"))["domain"], 2, ctx)
    assert torch.tanh(c).device_mesh is c.device_mesh  # the plan of tanh was cached on another object first


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_a_mesh_over_other_process_groups_never_gets_their_plans(ctx):
    """A mesh over a new process group of the same ranks equals the old one but must keep its own group."""
    ranks = list(range(ctx.world_size))
    old, new = (DeviceMesh.from_group(dist.new_group(ranks), ctx.device.type, mesh_dim_names=("domain",))
                for _ in range(2))
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
