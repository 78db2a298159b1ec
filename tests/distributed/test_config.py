"""Single-process checks: policy objects, size resolution, capabilities, pins, frozen casting, checkpointing.

None of these need a process group; their error paths are pure functions of
their arguments, so they are identical on every rank by construction.
"""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from physicsnemo_dp.distributed import (
    ActivationCheckpointing,
    CapabilityError,
    DDPConfig,
    FSDP2Config,
    ModelCapabilities,
    MixedPrecisionPolicy,
    Trainability,
    find_blocks,
    is_checkpointed,
    query_capabilities,
    register_capabilities,
    unregister_capabilities,
)
from physicsnemo_dp.distributed.activation_checkpointing import apply_checkpointing
from physicsnemo_dp.distributed.config import resolve_strategy
from physicsnemo_dp.distributed.mesh_context import resolve_sizes
from physicsnemo_dp.distributed.precision import cast_frozen_state, fp32_pins, pinned_owners, pinned_policy

from ._models import Block, PinnedNet, TokenNet, sample_batch


# ------------------------------------------------------------------ configs
def test_configs_reject_non_bools_and_bad_values():
    for make in (
        lambda: DDPConfig(find_unused_parameters=1),
        lambda: DDPConfig(static_graph="yes"),
        lambda: FSDP2Config(reshard_after_forward=None),
        lambda: ActivationCheckpointing(preserve_rng_state=0),
    ):
        with pytest.raises(TypeError, match="must be a bool"):
            make()
    for bad in (0, -1.5, True, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            DDPConfig(bucket_cap_mb=bad)
    assert DDPConfig().ddp_kwargs() == dict(
        find_unused_parameters=False, forward_sync_buffers=True, gradient_as_bucket_view=False, static_graph=False
    )
    assert DDPConfig(bucket_cap_mb=5).ddp_kwargs()["bucket_cap_mb"] == 5


def test_strategy_resolution():
    assert resolve_strategy(None) is None
    assert resolve_strategy("ddp") == DDPConfig()
    assert resolve_strategy("FSDP2") == FSDP2Config()
    cfg = DDPConfig(static_graph=True)
    assert resolve_strategy(cfg) is cfg
    for bad in ("fsdp", "megatron", 3, DDPConfig):
        with pytest.raises(ValueError, match="unknown strategy"):
            resolve_strategy(bad)


def test_trainability_patterns():
    names = ["inp.weight", "inp.bias", "blocks.0.lin.weight", "blocks.1.lin.weight", "out.weight"]
    assert Trainability(frozen=("blocks.*",)).frozen_names(names) == ["blocks.0.lin.weight", "blocks.1.lin.weight"]
    assert Trainability(frozen=["inp.bias", "out.*"]).frozen == ("inp.bias", "out.*")
    assert Trainability().frozen_names(names) == []
    with pytest.raises(ValueError, match=r"\['encoder\.\*'\] match no parameter"):
        Trainability(frozen=("encoder.*", "inp.*")).frozen_names(names)
    for bad in ("inp.*", ("inp.*", 3)):
        with pytest.raises(TypeError, match="tuple of name patterns"):
            Trainability(frozen=bad)


def test_size_resolution():
    assert resolve_sizes(8, 2, None) == (4, 2)
    assert resolve_sizes(8, None, 2) == (2, 4)
    assert resolve_sizes(6, 3, 2) == (2, 3)
    assert resolve_sizes(1, 1, None) == (1, 1)
    with pytest.raises(ValueError, match="give domain_size or ddp_size"):
        resolve_sizes(4, None, None)
    with pytest.raises(ValueError, match="domain_size=3 does not divide the world size 4"):
        resolve_sizes(4, 3, None)
    with pytest.raises(ValueError, match="ddp_size=3 does not divide"):
        resolve_sizes(4, None, 3)
    with pytest.raises(ValueError, match=r"ddp_size=2 x domain_size=3 = 6 ranks, but the world size is 4"):
        resolve_sizes(4, 3, 2)
    with pytest.raises(ValueError, match="domain_size must be >= 1"):
        resolve_sizes(4, 0, None)
    with pytest.raises(TypeError, match="ddp_size must be an int"):
        resolve_sizes(4, None, 2.0)
    with pytest.raises(TypeError, match="domain_size must be an int"):
        resolve_sizes(4, True, None)


# ------------------------------------------------------------ capabilities
class _Undeclared(nn.Module):
    pass


class _Variant(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config

    @classmethod
    def get_capabilities(cls, config):
        return ModelCapabilities(supports_domain=config["domain"], supports_ddp=True)


@dataclass
class _Config:
    model_class: type
    domain: bool = True

    def __getitem__(self, key):
        return getattr(self, key)


def test_query_capabilities_static_variant_and_config():
    expected = ModelCapabilities(supports_domain=True, supports_ddp=True, supports_fsdp2=True)
    assert query_capabilities(TokenNet) == expected
    assert query_capabilities(TokenNet()) == expected
    assert query_capabilities(PinnedNet) == expected  # inherited declaration
    assert query_capabilities(_Undeclared) == ModelCapabilities()
    assert query_capabilities(_Variant({"domain": False})) == ModelCapabilities(supports_ddp=True)
    assert query_capabilities(_Variant, {"domain": True}).supports_domain
    assert query_capabilities(_Config(_Variant, domain=True)).supports_domain
    assert query_capabilities(_Config(TokenNet)) == expected
    assert isinstance(query_capabilities(TokenNet), ModelCapabilities)


def test_register_capabilities_refusals():
    """Unknown flags, non-bools, both forms, a declared class: refused; nothing is registered by a refusal."""

    class Outside(nn.Module):  # stands for a third-party class
        pass

    with pytest.raises(TypeError, match=r"unknown flags \['supports_dmoain'\]; known flags"):
        register_capabilities(Outside, supports_dmoain=True)
    with pytest.raises(TypeError, match="must be a bool"):
        register_capabilities(Outside, supports_domain=1)
    with pytest.raises(TypeError, match="not both"):
        register_capabilities(Outside, ModelCapabilities(supports_domain=True), supports_ddp=True)
    with pytest.raises(TypeError, match="takes a model class, got Outside"):
        register_capabilities(Outside(), supports_domain=True)
    with pytest.raises(TypeError, match="TokenNet declares its own capabilities"):
        register_capabilities(TokenNet, supports_domain=True)
    with pytest.raises(TypeError, match="_Variant declares its own capabilities"):
        register_capabilities(_Variant, supports_domain=True)
    assert query_capabilities(Outside) == ModelCapabilities()
    try:
        register_capabilities(Outside, ModelCapabilities(supports_domain=True))
        register_capabilities(Outside, supports_ddp=True)  # again: replaces
        assert query_capabilities(Outside()) == ModelCapabilities(supports_ddp=True)
    finally:
        unregister_capabilities(Outside)
    assert query_capabilities(Outside) == ModelCapabilities()


def test_query_capabilities_errors():
    with pytest.raises(ValueError, match="depend on the configuration"):
        query_capabilities(_Variant)
    with pytest.raises(ValueError, match="depend on the configuration"):
        query_capabilities(_Variant())  # instance without a config

    class Both(nn.Module):
        @dataclass(frozen=True)
        class ModelCapabilities:
            supports_ddp: bool = True

        @classmethod
        def get_capabilities(cls, config):
            return ModelCapabilities()

    with pytest.raises(TypeError, match="declares both"):
        query_capabilities(Both)

    class NotADataclass(nn.Module):
        class ModelCapabilities:
            supports_ddp = True

    with pytest.raises(TypeError, match="must be a \\(frozen\\) dataclass"):
        query_capabilities(NotADataclass)

    class UnknownFlag(nn.Module):
        @dataclass(frozen=True)
        class ModelCapabilities:
            supports_tp: bool = True

    with pytest.raises(TypeError, match=r"unknown flags \['supports_tp'\]"):
        query_capabilities(UnknownFlag)

    class WrongReturn(nn.Module):
        @classmethod
        def get_capabilities(cls, config):
            return {"supports_ddp": True}

    with pytest.raises(TypeError, match="must return a ModelCapabilities"):
        query_capabilities(WrongReturn, config={})
    with pytest.raises(TypeError, match="query_capabilities takes"):
        query_capabilities({"model": "TokenNet"})
    with pytest.raises(TypeError, match="must be a bool"):
        ModelCapabilities(supports_ddp=1)
    assert issubclass(CapabilityError, ValueError)


# ---------------------------------------------------------------- precision
def test_fp32_pins_and_owners():
    model = PinnedNet()
    assert fp32_pins(model) == ("gate.log_scale",)
    assert fp32_pins(TokenNet()) == ()
    assert pinned_owners(model, fp32_pins(model)) == [model.gate]
    assert pinned_owners(model, ()) == []

    class MixedPin(TokenNet):
        _keep_in_fp32_modules_strict = ["inp.bias"]

    with pytest.raises(ValueError, match=r"\['inp.bias'\] are pinned to fp32 .* also holds \['inp.weight'\]"):
        pinned_owners(MixedPin(), fp32_pins(MixedPin()))

    for bad in ("gate", ["gate", ""], [3]):
        Bad = type("Bad", (TokenNet,), {"_keep_in_fp32_modules_strict": bad})
        with pytest.raises(TypeError, match="_keep_in_fp32_modules_strict must be a list"):
            fp32_pins(Bad())

    policy = pinned_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert policy.cast_forward_inputs


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.register_buffer("offset", torch.ones(3))
        self.register_buffer("keep", torch.ones(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


class _WithTower(nn.Module):
    _keep_in_fp32_modules_strict = ["tower.keep"]

    def __init__(self):
        super().__init__()
        self.tower = _Tower()
        self.head = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))


def test_frozen_unsharded_modules_are_cast_except_pins():
    model = _WithTower()
    model.tower.requires_grad_(False)
    cast = cast_frozen_state(model, torch.bfloat16, fp32_pins(model))
    assert sorted(cast) == ["tower.offset", "tower.proj.bias", "tower.proj.weight"]
    assert model.tower.proj.weight.dtype == torch.bfloat16 and isinstance(model.tower.proj.weight, nn.Parameter)
    assert model.tower.keep.dtype == torch.float32  # pinned buffer
    assert model.tower.steps.dtype == torch.int64  # not floating
    assert model.head.weight.dtype == torch.float32 and model.scale.dtype == torch.float32  # trainable part
    model.requires_grad_(False)  # the whole model frozen: its own buffers too
    assert cast_frozen_state(model, torch.bfloat16, ()) == ["scale", "tower.keep", "head.weight", "head.bias"]


# ------------------------------------------------------------ checkpointing
def test_find_blocks():
    model = TokenNet(depth=3)
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(nn.Sequential(nn.Linear(2, 2))) == []
    nested = nn.Module()
    nested.outer = nn.ModuleList([nn.ModuleList([nn.Linear(1, 1)]), nn.Linear(1, 1)])
    assert find_blocks(nested) == list(nested.outer)  # lists inside a block belong to it


def test_checkpointing_recomputes_in_backward_and_keeps_names():
    torch.manual_seed(0)
    model = TokenNet()
    reference = TokenNet()
    reference.load_state_dict(model.state_dict())
    names = list(model.state_dict())
    for block in model.blocks:
        apply_checkpointing(block, ActivationCheckpointing())
    assert all(is_checkpointed(b) and isinstance(b, Block) for b in model.blocks)
    assert not is_checkpointed(model.inp)
    assert list(model.state_dict()) == names
    x = sample_batch()
    model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert [b.calls for b in model.blocks] == [2, 2]  # forward, then the recomputation in backward
    assert [b.calls for b in reference.blocks] == [1, 1]
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), n
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_checkpointing(model.blocks[0], ActivationCheckpointing())
