"""ModelParallelizer: refusals, explicit size-1 cases, sidecars, fp32 pins and frozen parts."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from physicsnemo_dp import count_collectives, promotion
from physicsnemo_dp.distributed import (
    CapabilityError,
    DDPConfig,
    FSDP2Config,
    MeshContext,
    MixedPrecisionPolicy,
    ModelCapabilities,
    ModelParallelizer,
    Trainability,
    is_checkpointed,
    parallelize_model,
    query_capabilities,
    register_capabilities,
    unregister_capabilities,
)
from physicsnemo_dp.promotion import clear_gradient_buckets
from tests._harness import distributed

from ._models import (
    HIDDEN,
    PinnedNet,
    TokenNet,
    assert_close_states,
    assert_same_on_all_ranks,
    device_mesh,
    full_state,
    local_input,
    loss_of,
    sample_batch,
    train,
)

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _context(ctx, **policies) -> MeshContext:
    """A (2, 2) context on the 2x2 layout, else (1, world size): every rank splits one sample."""
    shape = (2, 2) if ctx.mesh.ndim == 2 else (1, ctx.world_size)
    return MeshContext.from_mesh(device_mesh(ctx.device.type, *shape), **policies)


def _reference(batches, model_class=TokenNet):
    torch.manual_seed(0)
    model = model_class()
    train(model, batches)
    return full_state(model)


class _DomainOnly(TokenNet):
    @dataclass(frozen=True)
    class ModelCapabilities:
        supports_domain: bool = True


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


class ThirdPartyNet(nn.Module):
    """A model class one cannot edit: TokenNet's layers, no capability declaration."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TokenNet()  # the same parameters as TokenNet() after the same seed, under "net."

    def forward(self, x):
        return self.net(x)


def _third_party_reference(batches):
    return {f"net.{k}": v for k, v in _reference(batches).items()}


# ------------------------------------------------------------------ refusals
@distributed(world_sizes=(2,), mesh_2d=True)
def test_type_errors(ctx):
    context = _context(ctx)
    with pytest.raises(TypeError, match="parallelize needs an nn.Module, got function"):
        ModelParallelizer().parallelize(lambda x: x, context)
    with pytest.raises(TypeError, match="parallelize needs a MeshContext, got DeviceMesh"):
        parallelize_model(TokenNet(), ctx.mesh)

    class BadSidecar(TokenNet):
        parallelizer = "fsdp"

    with pytest.raises(TypeError, match="BadSidecar.parallelizer must be a ModelParallelizer instance, got str"):
        parallelize_model(BadSidecar(), context)


@distributed(world_sizes=(1, 2), mesh_2d=True)
def test_capability_refusal_names_the_flag_before_any_side_effect(ctx):
    domain = ctx.world_size > 1  # _context splits samples over every rank but the (2, 2) ddp pairs
    cases = [(_Plain, None, ["supports_domain"] if domain else []),
             (_Plain, DDPConfig(), (["supports_domain"] if domain else []) + ["supports_ddp"]),
             (_DomainOnly, DDPConfig(), ["supports_ddp"]),
             (_DomainOnly, FSDP2Config(), ["supports_fsdp2"]),
             (TokenNet, FSDP2Config(), [])]  # fmt: skip
    for model_class, strategy, missing in cases:
        model = model_class()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        context = _context(ctx, strategy=strategy, activation_checkpointing=model_class is not _Plain)
        if not missing:
            parallelize_model(model, context)
            continue
        with count_collectives() as counter, pytest.raises(CapabilityError) as info:
            parallelize_model(model, context)
        message = str(info.value)
        assert all(f"{flag}=True" in message for flag in missing), message
        assert f"{model_class.__name__} does not declare" in message
        assert counter.total_calls == 0
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert not any(is_checkpointed(m) for m in model.modules())


@distributed(world_sizes=(3,), mesh_2d=True)
def test_capabilities_for_a_class_one_cannot_edit(ctx):
    """capabilities= (one call) and register_capabilities (the process) stand for a missing declaration."""
    context = _context(ctx, strategy=DDPConfig())
    needed = ["supports_domain", "supports_ddp"]
    batches = [sample_batch(seed=s) for s in range(2)]
    with count_collectives() as counter:
        with pytest.raises(CapabilityError, match="register_capabilities"):  # the message names the way out
            parallelize_model(ThirdPartyNet(), context)
        with pytest.raises(TypeError, match=r"unknown flags \['supports_domian'\]; known flags: \['supports_domain'"):
            parallelize_model(ThirdPartyNet(), context, capabilities={"supports_domian": True})
        with pytest.raises(TypeError, match="must be a bool, got 'yes'"):
            parallelize_model(ThirdPartyNet(), context, capabilities={"supports_domain": "yes"})
        with pytest.raises(TypeError, match="takes a ModelCapabilities or a mapping"):
            parallelize_model(ThirdPartyNet(), context, capabilities=["supports_domain"])
        with pytest.raises(CapabilityError, match=f"{needed[-1]}=True"):  # a flag short
            parallelize_model(ThirdPartyNet(), context, capabilities={f: f != needed[-1] for f in needed})
        with pytest.raises(TypeError, match="TokenNet declares its own capabilities"):
            parallelize_model(TokenNet(), context, capabilities=ModelCapabilities(supports_domain=True))
    assert counter.total_calls == 0  # every refusal comes before any collective

    # one call: trains to the single-process parameters on uneven token shards
    torch.manual_seed(ctx.rank)  # different weights per rank: parallelize_model synchronizes them
    model = parallelize_model(ThirdPartyNet(), context, capabilities={f: True for f in needed})
    train(model, [local_input(b, context) for b in batches])
    assert_close_states(full_state(model), _third_party_reference(batches), atol=1e-5, rtol=1e-5)
    assert query_capabilities(ThirdPartyNet) == ModelCapabilities()  # capabilities= registered nothing

    # the process: a registration, inherited by a subclass that declares nothing
    class Subclass(ThirdPartyNet):
        pass

    try:
        registered = register_capabilities(ThirdPartyNet, supports_domain=True, supports_ddp=True)
        assert registered == ModelCapabilities(supports_domain=True, supports_ddp=True)
        assert query_capabilities(Subclass()) == registered
        torch.manual_seed(ctx.rank)
        model = parallelize_model(Subclass(), context)
        train(model, [local_input(b, context) for b in batches])
        assert_close_states(full_state(model), _third_party_reference(batches), atol=1e-5, rtol=1e-5)
        with pytest.raises(CapabilityError, match="supports_fsdp2=True"):
            parallelize_model(Subclass(), _context(ctx, strategy=FSDP2Config()))
    finally:
        unregister_capabilities(ThirdPartyNet)
    assert query_capabilities(Subclass) == ModelCapabilities()


@distributed(world_sizes=(2,), mesh_2d=True)
def test_value_errors(ctx):
    context = _context(ctx, strategy=DDPConfig())
    if context.ddp_size > 1:
        wrapped = parallelize_model(TokenNet(), context)
        with pytest.raises(ValueError, match="already parallelized"):
            parallelize_model(wrapped, context)
    sharded = parallelize_model(TokenNet(), _context(ctx, strategy=FSDP2Config()))
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_model(sharded, context)

    class Flat(TokenNet):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*self.blocks)

    with pytest.raises(ValueError, match="activation checkpointing was requested but Flat has no blocks"):
        parallelize_model(Flat(), _context(ctx, activation_checkpointing=True))
    with pytest.raises(ValueError, match=r"Trainability.frozen patterns \['encoder.\*'\] match no parameter"):
        parallelize_model(TokenNet(), _context(ctx, trainability=Trainability(frozen=("encoder.*",))))

    class MixedPin(TokenNet):
        _keep_in_fp32_modules_strict = ["out.bias"]

    with pytest.raises(ValueError, match="pinned to fp32"):
        parallelize_model(MixedPin(), _context(ctx, strategy=FSDP2Config(), mixed_precision=BF16))
    # without a lower compute dtype a pin needs no unit of its own, so nothing to refuse
    parallelize_model(MixedPin(), _context(ctx, strategy=FSDP2Config()))


# ------------------------------------------------------ domain reductions in buckets
@pytest.mark.parametrize("bucket_mb, reductions", [(25.0, 1), (0.0002, 2), (None, 4)])
@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_domain_reductions_are_bucketed_by_default(ctx, bucket_mb, reductions):
    """The promoted weights' gradients are summed over "domain" one bucket at a time: 25 MiB (the
    default, DDP's) holds all of TokenNet; 0.0002 MiB (210 bytes) cuts its parameters in reverse order
    into the last three layers plus the first block's bias, and the rest; None is one per layer call.
    Every gradient equals the single-process one."""
    torch.manual_seed(0)
    model = parallelize_model(TokenNet(), _context(ctx, gradient_bucket_mb=bucket_mb))
    batch = sample_batch()
    try:
        loss = loss_of(model(local_input(batch, _context(ctx))))
        with count_collectives() as counter:
            loss.backward()
    finally:
        clear_gradient_buckets()  # the rank process runs other tests next
    # + 1: backward() first sums the loss's pending per-rank partial values (a single float)
    assert counter.calls.get("all_reduce", 0) == reductions + 1, counter.summary()
    torch.manual_seed(0)
    reference = TokenNet()
    loss_of(reference(batch)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert type(p.grad) is torch.Tensor and torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-6), name


@distributed(world_sizes=(2,), mesh_2d=False)
def test_fsdp2_and_a_single_domain_rank_register_no_bucket(ctx):
    torch.manual_seed(0)
    parallelize_model(TokenNet(), _context(ctx, strategy=FSDP2Config()))
    single = MeshContext.from_mesh(device_mesh(ctx.device.type, 2, 1))
    parallelize_model(TokenNet(), single)
    assert promotion._BUCKETS == {}


# ------------------------------------------------------ explicit size-1 cases
@distributed(world_sizes=(1,), mesh_2d=False)
def test_world_size_one(ctx):
    context = MeshContext.build(domain_size=1, strategy="ddp", device_type=ctx.device.type)
    model = TokenNet()
    with count_collectives() as counter:
        out = parallelize_model(model, context)
    assert out is model and not isinstance(out, DistributedDataParallel)  # no one-rank DDP
    assert counter.total_calls == 0  # nothing to synchronize
    batches = [sample_batch(seed=s) for s in range(2)]
    train(out, [local_input(b, context) for b in batches])
    assert_close_states(full_state(out), _reference(batches), atol=1e-6, rtol=1e-6)

    torch.manual_seed(0)
    sharded = parallelize_model(TokenNet(), MeshContext.from_mesh(context.mesh, strategy="fsdp2"))
    assert isinstance(sharded, FSDPModule)  # kept on one rank: same precision handling at every scale
    train(sharded, [local_input(b, context) for b in batches])
    assert_close_states(full_state(sharded), _reference(batches), atol=1e-6, rtol=1e-6)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_ddp_size_one_synchronizes_over_domain_only(ctx):
    batches = [sample_batch(seed=s) for s in range(2)]
    for strategy in (DDPConfig(), FSDP2Config(), None):
        context = _context(ctx, strategy=strategy)
        assert (context.ddp_size, context.domain_size) == (1, 2)
        torch.manual_seed(ctx.rank)
        model = parallelize_model(TokenNet(), context)
        assert not isinstance(model, DistributedDataParallel)
        assert isinstance(model, FSDPModule) == isinstance(strategy, FSDP2Config)
        assert_same_on_all_ranks(full_state(model))  # rank 1 now holds rank 0's weights
        train(model, [local_input(b, context) for b in batches])
        assert_close_states(full_state(model), _reference(batches), atol=1e-5, rtol=1e-5)
        assert_same_on_all_ranks(full_state(model))


@distributed(world_sizes=(), mesh_2d=True)
def test_no_strategy_synchronizes_both_axes(ctx):
    torch.manual_seed(ctx.rank)
    model = parallelize_model(TokenNet(), MeshContext.from_mesh(ctx.mesh))
    assert type(model) is TokenNet
    assert_same_on_all_ranks(full_state(model))


# ------------------------------------------------------------------- sidecars
class _RecordingParallelizer(ModelParallelizer):
    """Overrides only the FSDP2 primitive: records each unit, then shards it as usual."""

    def __init__(self):
        self._units = []

    def _fully_shard_module(self, module, **kwargs):
        self._units.append((module, kwargs["mp_policy"], kwargs["mesh"]))
        return super()._fully_shard_module(module, **kwargs)


class _SidecarNet(PinnedNet):
    pass


@distributed(world_sizes=(), mesh_2d=True)
def test_sidecar_overriding_only_fully_shard_module(ctx):
    _SidecarNet.parallelizer = _RecordingParallelizer()
    try:
        context = _context(ctx, strategy=FSDP2Config(), mixed_precision=BF16)
        torch.manual_seed(ctx.rank)
        model = parallelize_model(_SidecarNet(), context)
        units = _SidecarNet.parallelizer._units
    finally:
        del _SidecarNet.parallelizer
    # bottom-up: the pinned gate and the blocks, then the root; all on the ddp submesh
    assert [m for m, _, _ in units] == [model.gate, model.blocks[1], model.blocks[0], model]
    assert all(mesh == context.ddp_mesh for _, _, mesh in units)
    assert [p.param_dtype for _, p, _ in units] == [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert all(isinstance(m, FSDPModule) for m, _, _ in units)
    train(model, [local_input(sample_batch(seed=s), context) for s in range(2)])
    assert_same_on_all_ranks(full_state(model))


class _SurroundingParallelizer(ModelParallelizer):
    """Overrides the unit boundaries, the checkpoint targets and surrounds the flow."""

    def _apply(self, model, mesh_context):
        model._before = True
        out = super()._apply(model, mesh_context)
        out._after = True
        return out

    def _apply_fsdp_sharding(self, model, mesh_context):
        return self._fully_shard_module(model, mesh=mesh_context.ddp_mesh)  # one unit only

    def _checkpoint_targets(self, model):
        return [model.out]


class _SurroundedNet(TokenNet):
    parallelizer = _SurroundingParallelizer()


@distributed(world_sizes=(), mesh_2d=True)
def test_sidecar_hooks_keep_the_flow(ctx):
    context = _context(ctx, strategy=FSDP2Config(), activation_checkpointing=True)
    torch.manual_seed(ctx.rank)
    model = parallelize_model(_SurroundedNet(), context)
    assert model._before and model._after
    assert is_checkpointed(model.out) and not any(is_checkpointed(b) for b in model.blocks)
    assert [isinstance(m, FSDPModule) for m in (model, *model.blocks)] == [True, False, False]
    batches = [sample_batch(seed=s) for s in range(2)]
    train(model, [local_input(b, context) for b in batches])
    assert_close_states(full_state(model), _reference(batches), atol=1e-5, rtol=1e-5)  # synchronized, trained
    assert_same_on_all_ranks(full_state(model))


# -------------------------------------------------------------------- precision
@distributed(world_sizes=(1,), mesh_2d=True)
def test_fp32_pin_computes_in_fp32_under_bf16(ctx):
    context = _context(ctx, strategy=FSDP2Config(), mixed_precision=BF16)
    model = PinnedNet()
    seen = {}

    def record(name):
        def hook(module, args, output):
            weight = module.log_scale if name == "gate" else module.lin.weight
            seen[name] = (weight.dtype, args[0].dtype, output.dtype)
            if name == "gate":  # the gate's arithmetic itself, checked against fp32 math
                local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
                exact = local(args[0]) * torch.exp(local(weight))
                assert exact.dtype == torch.float32 and torch.equal(local(output), exact)

        return hook

    model.gate.register_forward_hook(record("gate"))
    model.blocks[0].register_forward_hook(record("block"))
    model = parallelize_model(model, context)
    assert isinstance(model.gate, FSDPModule)
    out = model(local_input(sample_batch(), context))
    assert seen["gate"] == (torch.float32, torch.float32, torch.float32)  # weight, input, compute: fp32
    assert seen["block"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert out.dtype == torch.bfloat16  # the gate hands bf16 on to the bulk
    out.float().pow(2).mean().backward()
    gate = model.gate.log_scale
    assert isinstance(gate, DTensor) and gate.dtype == torch.float32 and gate.grad.dtype == torch.float32
    assert model.blocks[0].lin.weight.dtype == torch.float32  # fp32 master weights everywhere

    # the same model with fp32 FSDP2: the pin needs no unit of its own
    plain = parallelize_model(PinnedNet(), _context(ctx, strategy=FSDP2Config()))
    assert not isinstance(plain.gate, FSDPModule)


class _Shift(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.register_buffer("offset", torch.full((width,), 0.25))
        self.register_buffer("keep", torch.full((width,), 0.5))

    def forward(self, x):
        return x * self.w + self.offset * self.keep.to(x.dtype)


class _FrozenShiftNet(TokenNet):
    _keep_in_fp32_modules_strict = ["shift.keep"]

    def __init__(self):
        super().__init__()
        self.shift = _Shift(HIDDEN)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(self.shift(x))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@distributed(world_sizes=(), mesh_2d=True)
def test_frozen_parts(ctx, strategy):
    bf16 = strategy == "fsdp2"
    context = _context(ctx, strategy=strategy, mixed_precision=BF16 if bf16 else None,
                       trainability=Trainability(frozen=("shift.*",)))  # fmt: skip
    torch.manual_seed(0)
    model = parallelize_model(_FrozenShiftNet(), context)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    assert not inner.shift.w.requires_grad and inner.inp.weight.requires_grad
    frozen_before = full_state(model)["shift.w"]
    if bf16:
        assert inner.shift.offset.dtype == torch.bfloat16  # frozen buffer: cast
        assert inner.shift.keep.dtype == torch.float32  # pinned buffer: kept
        assert isinstance(inner.shift.w, DTensor) and inner.shift.w.dtype == torch.float32  # FSDP casts on gather
    else:
        assert inner.shift.offset.dtype == torch.float32
    before = full_state(model)
    train(model, [local_input(sample_batch(seed=s), context) for s in range(2)])
    after = full_state(model)
    assert torch.equal(after["shift.w"], frozen_before)
    assert not torch.equal(after["inp.weight"], before["inp.weight"])
    assert_same_on_all_ranks(after)
