"""MeshContext: building the ("ddp", "domain") mesh, its views, and every refusal."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from physicsnemo_dp.distributed import (
    ActivationCheckpointing,
    DDPConfig,
    FSDP2Config,
    MeshContext,
    MixedPrecisionPolicy,
    Trainability,
)
from tests._harness import distributed

from ._models import device_mesh


@distributed(world_sizes=(1, 2, 4), mesh_2d=False)
def test_build_infers_the_missing_size(ctx):
    n = ctx.world_size
    for kwargs, shape in (
        (dict(domain_size=n), (1, n)),
        (dict(ddp_size=n), (n, 1)),
        (dict(domain_size=1, ddp_size=n), (n, 1)),
    ) + (((dict(domain_size=2), (2, 2)),) if n == 4 else ()):
        context = MeshContext.build(**kwargs, strategy="ddp", device_type=ctx.device.type)
        assert (context.ddp_size, context.domain_size) == shape
        assert context.world_size == n
        assert context.mesh.mesh_dim_names == ("ddp", "domain")
        assert context.strategy == DDPConfig()
        assert context.ddp_rank * shape[1] + context.domain_rank == ctx.rank
        assert context.ddp_mesh.size() == shape[0] and context.domain_mesh.size() == shape[1]
        assert context.device == ctx.device


@distributed(world_sizes=(), mesh_2d=True)
def test_views_of_a_2x2_mesh(ctx):
    context = MeshContext.from_mesh(ctx.mesh, strategy=FSDP2Config(), activation_checkpointing=True)
    assert (context.ddp_rank, context.domain_rank) == divmod(ctx.rank, 2)
    assert context.ddp_mesh.mesh.tolist() == [ctx.rank % 2, ctx.rank % 2 + 2]
    assert context.domain_mesh.mesh.tolist() == [ctx.rank // 2 * 2, ctx.rank // 2 * 2 + 1]
    assert context.activation_checkpointing == ActivationCheckpointing()
    assert MeshContext.from_mesh(ctx.mesh, activation_checkpointing=False).activation_checkpointing is None
    assert context.trainability == Trainability() and context.mixed_precision is None


@distributed(world_sizes=(4,), mesh_2d=False)
def test_build_errors(ctx):
    with pytest.raises(ValueError, match="domain_size=3 does not divide the world size 4"):
        MeshContext.build(domain_size=3)
    with pytest.raises(ValueError, match="ddp_size=4 x domain_size=2 = 8 ranks, but the world size is 4"):
        MeshContext.build(domain_size=2, ddp_size=4)
    with pytest.raises(ValueError, match="give domain_size or ddp_size"):
        MeshContext.build()
    with pytest.raises(TypeError, match="domain_size must be an int"):
        MeshContext.build(domain_size="2")
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        MeshContext.build(domain_size=2, strategy="zero3")


@distributed(world_sizes=(4,), mesh_2d=True)
def test_from_mesh_errors(ctx):
    mesh2d = device_mesh(ctx.device.type, 2, 2)
    one_d = ctx.mesh if ctx.mesh.ndim == 1 else ctx.mesh["domain"]
    with pytest.raises(ValueError, match=r"dim names \('ddp', 'domain'\).*got \('domain',\)"):
        MeshContext.from_mesh(one_d)
    swapped = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("domain", "ddp"))
    with pytest.raises(ValueError, match=r"got \('domain', 'ddp'\)"):
        MeshContext.from_mesh(swapped)
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        MeshContext("cpu")
    with pytest.raises(ValueError, match="unknown strategy"):
        MeshContext.from_mesh(mesh2d, strategy=object())
    with pytest.raises(TypeError, match="mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy"):
        MeshContext.from_mesh(mesh2d, strategy="fsdp2", mixed_precision=torch.bfloat16)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for strategy in ("ddp", None):
        with pytest.raises(ValueError, match="mixed_precision is applied by FSDP2"):
            MeshContext.from_mesh(mesh2d, strategy=strategy, mixed_precision=bf16)
    assert MeshContext.from_mesh(mesh2d, strategy="fsdp2", mixed_precision=bf16).mixed_precision is bf16
    with pytest.raises(TypeError, match="trainability must be a Trainability"):
        MeshContext.from_mesh(mesh2d, trainability=("inp.*",))
    with pytest.raises(TypeError, match="activation_checkpointing must be"):
        MeshContext.from_mesh(mesh2d, activation_checkpointing="blocks")
    for bad in (0, -1.0, True, "25", float("nan")):
        with pytest.raises(ValueError, match="gradient_bucket_mb must be a positive number of MiB or None"):
            MeshContext.from_mesh(mesh2d, gradient_bucket_mb=bad)
    assert MeshContext.from_mesh(mesh2d).gradient_bucket_mb == 25.0
    assert MeshContext.from_mesh(mesh2d, gradient_bucket_mb=None).gradient_bucket_mb is None
