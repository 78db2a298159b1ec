"""Batch, instance, group and layer normalization with statistics over all ranks' data."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import OP_WORLD_SIZES, check
from ._cases import check_module, grid, spatial_layouts

SHAPE = (3, 4, 11, 9)


def _layouts(mesh, ndim=4, k=2):
    return spatial_layouts(mesh, ndim, k, batch=True) + ([(Shard(0), Shard(0))] if mesh.ndim == 2 else [])


def _affine(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


@distributed(world_sizes=OP_WORLD_SIZES)
def test_batch_norm_training_and_running_stats(ctx):
    x = grid(SHAPE) * 3 + 10  # a large mean: the two-pass variance matters
    for placements in _layouts(ctx.mesh):
        for momentum in (0.1, None):
            torch.manual_seed(0)
            module = _affine(torch.nn.BatchNorm2d(4, momentum=momentum).double(), 1)
            ref = _affine(torch.nn.BatchNorm2d(4, momentum=momentum).double(), 1)
            check_module(module, x, placements, ctx.mesh, label=f"bn2d {placements}")
            ref(x)
            assert torch.allclose(module.running_mean, ref.running_mean) and torch.allclose(module.running_var, ref.running_var), placements
            assert module.num_batches_tracked == ref.num_batches_tracked
            module.eval()
            check_module(module, x, placements, ctx.mesh, label=f"bn2d eval {placements}")
    for ndim, k, cls in ((3, 1, torch.nn.BatchNorm1d), (5, 3, torch.nn.BatchNorm3d)):
        xs = grid((3, 4, 7, 6, 5)[:ndim])
        for placements in _layouts(ctx.mesh, ndim, k):
            check_module(_affine(cls(4).double(), 2), xs, placements, ctx.mesh, label=f"{cls.__name__}")
    for placements in _layouts(ctx.mesh):
        check(lambda x: F.batch_norm(x, None, None, training=True), [(x, placements)], ctx.mesh, label="bn no stats")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_instance_norm(ctx):
    x = grid(SHAPE)
    for placements in _layouts(ctx.mesh):
        check_module(torch.nn.InstanceNorm2d(4).double(), x, placements, ctx.mesh, label="in")
        module = _affine(torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True).double(), 3)
        ref = _affine(torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True).double(), 3)
        check_module(module, x, placements, ctx.mesh, label="in affine running")
        ref(x)
        assert torch.allclose(module.running_mean, ref.running_mean) and torch.allclose(module.running_var, ref.running_var), placements
        module.eval()
        check_module(module, x, placements, ctx.mesh, label="in eval")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_group_norm(ctx):
    x = grid(SHAPE)
    for placements in _layouts(ctx.mesh) + [(Shard(1),) * ctx.mesh.ndim]:
        for groups in (1, 2, 4):
            check_module(_affine(torch.nn.GroupNorm(groups, 4).double(), groups), x, placements, ctx.mesh, label=f"gn{groups}")
    check(lambda x: F.group_norm(x, 2), [(grid((3, 4, 13)), (Shard(2),) * ctx.mesh.ndim)], ctx.mesh, label="gn 1d no affine")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_layer_norm_over_sharded_dims(ctx):
    x = grid(SHAPE)
    for placements in _layouts(ctx.mesh):
        for normalized in ((9,), (11, 9), (4, 11, 9)):
            check_module(_affine(torch.nn.LayerNorm(normalized).double(), len(normalized)), x, placements, ctx.mesh, label=f"ln {normalized}")
        check(lambda x: F.layer_norm(x, (11, 9)), [(x, placements)], ctx.mesh, label="ln no affine")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_statistics_cost_small_all_reduces_only(ctx):
    placements = _layouts(ctx.mesh)[0]
    spec = make_spec(ctx.mesh, placements, SHAPE)
    x = shard_from_global(grid(SHAPE), spec, requires_grad=True)
    with count_collectives() as fwd:
        y = F.batch_norm(x, None, None, training=True)
    with count_collectives() as bwd:
        y.backward(torch.ones_like(y))
    reducing = sum(1 for m, p in enumerate(placements) if p.is_shard() and ctx.mesh.size(m) > 1)
    assert fwd.calls.get("all_reduce", 0) == fwd.total_calls == 2 * reducing, fwd.summary()  # mean, centred variance
    assert bwd.calls.get("all_reduce", 0) == bwd.total_calls == reducing, bwd.summary()
    assert y._spec == x._spec


@distributed(world_sizes=OP_WORLD_SIZES)
def test_layer_norm_over_whole_rows_runs_torch_kernels(ctx):
    """Tokens sharded, features whole (a transformer's LayerNorm): each rank runs torch's own
    native_layer_norm on its rows, and autograd's own node for its backward, not the decomposed
    statistics path (a dozen elementwise passes more per call)."""
    G = grid((2, 7, 8))
    placements = (Shard(1),) * ctx.mesh.ndim
    x = shard_from_global(G, make_spec(ctx.mesh, placements, G.shape), requires_grad=True)
    y = _affine(torch.nn.LayerNorm(8).double(), 3)(x)
    assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0", type(y.grad_fn).__name__
    check_module(_affine(torch.nn.LayerNorm(8).double(), 3), G, placements, ctx.mesh, label="ln rows")
    w, b = torch.randn(4), torch.randn(4)  # float32, and a strided (every other feature) local view
    check(lambda x: F.layer_norm(x[..., ::2], (4,), w, b), [(G.float(), placements)], ctx.mesh, label="ln strided f32")
    z = _affine(torch.nn.LayerNorm((7, 8)).double(), 3)(x)  # a sharded normalized dim: the statistics path
    assert type(z.grad_fn).__name__ != "NativeLayerNormBackward0" or ctx.world_size == 1
