"""DiffusionPipeline: one MeshContext for every selected component, frozen parts, checkpoints across layouts."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from physicsnemo_dp.checkpoint import CheckpointError
from physicsnemo_dp.distributed import MeshContext
from physicsnemo_dp.pipelines import DiffusionPipeline, EDMPrecond, EDMSchedule, HeunSampler
from physicsnemo_dp.random import randn_like
from tests._harness import distributed, run_job

from ._nets import CondNet, context, global_tensor, shard

SCHEDULE = EDMSchedule(sigma_data=0.6, sigma_max=20.0)
SAMPLER = HeunSampler(num_steps=3, S_churn=5.0)


def _components(seed: int = 0) -> dict[str, nn.Module]:
    """A regression network (condition -> mean) and a conditional denoiser, seeded weights, float64."""
    torch.manual_seed(seed)
    return {"regression": nn.Conv2d(1, 1, 3, padding=1).double(), "denoiser": EDMPrecond(CondNet(), SCHEDULE).double()}


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


# --------------------------------------------------------------------------- #
# One process (no MeshContext)
# --------------------------------------------------------------------------- #
def test_without_a_mesh_context_nothing_is_wrapped():
    parts = _components()
    pipe = DiffusionPipeline.from_components(parts, frozen=["regression"], schedule=SCHEDULE, sampler=SAMPLER)
    assert pipe["denoiser"] is parts["denoiser"] and pipe["regression"] is parts["regression"]
    assert pipe.parallelized == () and pipe.frozen == ("regression",) and pipe.mesh_context is None
    assert not any(p.requires_grad for p in pipe["regression"].parameters()) and not pipe["regression"].training
    assert {id(p) for p in pipe.trainable_parameters()} == {id(p) for p in parts["denoiser"].parameters()}
    cond = global_tensor(1)
    sample = pipe.sample(randn_like(cond, generator=torch.Generator().manual_seed(0)), cond,
                         generator=torch.Generator().manual_seed(1))  # fmt: skip
    residual = SAMPLER.sample(parts["denoiser"], randn_like(cond, generator=torch.Generator().manual_seed(0)), cond,
                              generator=torch.Generator().manual_seed(1))  # fmt: skip
    torch.testing.assert_close(sample, parts["regression"](cond) + residual)  # regression mean + residual
    loss = pipe.loss(global_tensor(2), cond, generator=torch.Generator().manual_seed(2))
    loss.backward()
    assert all(p.grad is not None for p in parts["denoiser"].parameters())
    assert all(p.grad is None for p in parts["regression"].parameters())  # frozen: untrained


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(components={}), ValueError, "non-empty mapping"),
    (dict(components={"denoiser": lambda x: x}), TypeError, "nn.Modules"),
    (dict(frozen="regression"), TypeError, "frozen must be a list"),
    (dict(frozen=["encoder"]), ValueError, r"frozen names \['encoder'\]"),
    (dict(components_to_parallelize=["decoder"]), ValueError, "components_to_parallelize names"),
    (dict(frozen=["regression"], components_to_parallelize=["regression"]), ValueError, "both frozen"),
    (dict(mesh_context="ddp"), TypeError, "mesh_context must be a MeshContext"),
])  # fmt: skip
def test_bad_arguments_are_named(kwargs, error, match):
    kwargs = {"components": _components(), **kwargs}
    with pytest.raises(error, match=match):
        DiffusionPipeline.from_components(kwargs.pop("components"), **kwargs)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    pipe = DiffusionPipeline.from_components(_components(0), schedule=SCHEDULE, sampler=SAMPLER)
    pipe.save(tmp_path / "pipe", step=5)
    assert json.loads((tmp_path / "pipe" / "pipeline.json").read_text())["sampler"]["num_steps"] == 3
    loaded = DiffusionPipeline.from_checkpoint(tmp_path / "pipe", _components(1), components_to_load=["denoiser"])
    assert list(loaded.components) == ["denoiser"] and loaded.schedule == SCHEDULE and loaded.sampler == SAMPLER
    for k, v in _state(loaded["denoiser"]).items():
        assert torch.equal(v, _state(pipe["denoiser"])[k]), k
    with pytest.raises(ValueError, match="components_to_load names"):
        DiffusionPipeline.from_checkpoint(tmp_path / "pipe", _components(1), components_to_load=["decoder"])
    with pytest.raises(ValueError, match="no module for them"):
        DiffusionPipeline.from_checkpoint(tmp_path / "pipe", {"denoiser": _components(1)["denoiser"]})
    with pytest.raises(CheckpointError, match="no pipeline.json"):
        DiffusionPipeline.from_checkpoint(tmp_path / "nothing", _components(1))
    weights = next((tmp_path / "pipe" / "denoiser" / "step_00000005").glob("*.distcp"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # a bit flip that keeps the size
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="hash mismatch"), pytest.raises(CheckpointError, match="denoiser"):
        DiffusionPipeline.from_checkpoint(tmp_path / "pipe", _components(1))
    with pytest.raises(CheckpointError, match="hash mismatch"):
        DiffusionPipeline.from_checkpoint(tmp_path / "pipe", _components(1), step=5)


# --------------------------------------------------------------------------- #
# Under a MeshContext
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@distributed(world_sizes=(2, 4), timeout=120)
def test_one_mesh_context_for_every_component(ctx, strategy):
    """Selected components go through parallelize_model; the frozen one is replicated and untrained."""
    mesh_context = context(ctx, strategy=strategy)
    ctx.seed(ctx.rank)  # different weights on every rank: the pipeline must make them agree
    parts = {name: m.to(ctx.device) for name, m in _components(ctx.rank).items()}
    pipe = DiffusionPipeline.from_components(parts, mesh_context=mesh_context, frozen=["regression"],
                                             schedule=SCHEDULE, sampler=SAMPLER)  # fmt: skip
    assert pipe.parallelized == ("denoiser",) and pipe.mesh_context is mesh_context
    if strategy == "ddp" and mesh_context.ddp_size > 1:
        assert isinstance(pipe["denoiser"], DistributedDataParallel)
    regression = pipe["regression"]
    assert type(regression) is nn.Conv2d and not regression.training
    assert not any(p.requires_grad for p in regression.parameters())
    for p in [*regression.parameters()]:  # rank 0's weights everywhere
        gathered = [torch.empty_like(p) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    before = _state(regression)
    optimizer = torch.optim.SGD(pipe.trainable_parameters(), lr=0.1)
    cond = shard(global_tensor(1), mesh_context.domain_mesh, salt=1)
    loss = pipe.loss(shard(global_tensor(2), mesh_context.domain_mesh, salt=2), cond)
    loss.backward()
    optimizer.step()
    assert all(torch.equal(v, before[k]) for k, v in _state(regression).items())
    if strategy == "fsdp2" or mesh_context.ddp_size > 1:  # wrapped: parallelized exactly once
        with pytest.raises(ValueError, match="already parallelized"):
            DiffusionPipeline.from_components({"denoiser": pipe["denoiser"]}, mesh_context=mesh_context)


def _save_body(ctx, root: str, strategy: str):
    """Build (rank-dependent weights, synchronized), parallelize on this layout, save; return the saved weights."""
    mesh_context = context(ctx, strategy=strategy)
    parts = {name: m.to(ctx.device) for name, m in _components(ctx.rank).items()}
    pipe = DiffusionPipeline.from_components(parts, mesh_context=mesh_context, frozen=["regression"],
                                             schedule=SCHEDULE, sampler=SAMPLER)  # fmt: skip
    pipe.save(root, step=1)
    cond = shard(global_tensor(1), mesh_context.domain_mesh, salt=1)
    sample = pipe.sample(randn_like(cond, generator=torch.Generator().manual_seed(4)), cond,
                         generator=torch.Generator().manual_seed(5))  # fmt: skip
    return sample.full_tensor()


def _load_body(ctx, root: str, strategy: str | None):
    """Load on this layout (or, with strategy None on one rank, without a MeshContext) and sample."""
    parts = {name: m.to(ctx.device) for name, m in _components(99).items()}
    mesh_context = None if strategy is None else context(ctx, strategy=strategy)
    pipe = DiffusionPipeline.from_checkpoint(root, parts, mesh_context=mesh_context, frozen=["regression"])
    assert pipe.sampler == SAMPLER and pipe.schedule == SCHEDULE
    cond = global_tensor(1) if mesh_context is None else shard(global_tensor(1), mesh_context.domain_mesh, salt=3)
    sample = pipe.sample(randn_like(cond, generator=torch.Generator().manual_seed(4)), cond,
                         generator=torch.Generator().manual_seed(5))  # fmt: skip
    return sample if mesh_context is None else sample.full_tensor()


def test_save_on_one_layout_load_on_another(tmp_path):
    """Saved from (2, 2) with FSDP2, loaded on (1, 3) with DDP and in one process without a MeshContext: same sample."""
    saved = run_job(4, (2, 2), __name__, "_save_body", {"root": str(tmp_path), "strategy": "fsdp2"}, timeout=120)
    expected = saved[0].value
    for shape, strategy in [((3,), "ddp"), ((1,), None)]:
        got = run_job(math.prod(shape), shape, __name__, "_load_body", {"root": str(tmp_path), "strategy": strategy},
                      timeout=120)[0].value  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=lambda m: f"{shape}: {m}")


def test_mesh_context_type_is_checked_before_anything_changes():
    parts = _components()
    with pytest.raises(TypeError, match="MeshContext"):
        DiffusionPipeline.from_components(parts, mesh_context=object(), frozen=["regression"])
    assert all(p.requires_grad for p in parts["regression"].parameters())  # the refusal changed nothing
    assert MeshContext  # the type the error names
