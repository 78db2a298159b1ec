"""The dispatch layer itself: handler registries, promotion modes, mixed inputs, module sync."""

import warnings

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import (
    PlacementError,
    PromotionError,
    ShardTensor,
    TensorPromotionMode,
    get_promotion_mode,
    promotion_mode,
    set_promotion_mode,
    sync_module_over_mesh,
)
from physicsnemo_dp._torch_compat import torch_function_disabled
from physicsnemo_dp.dispatch import registry
from physicsnemo_dp.dispatch.torch_function import set_patches_enabled
from tests._harness import distributed

from ._diff import OP_WORLD_SIZES

from ..core._util import make_spec, shard_from_global

SHAPE = (7, 5, 3)
aten = torch.ops.aten


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _sharded(mesh, seed=0, requires_grad=False):
    return shard_from_global(_g(seed=seed), make_spec(mesh, (Shard(0),) * mesh.ndim, SHAPE), requires_grad)


@torch.library.custom_op("pdp_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


# --------------------------------------------------------------------------- #
# registries
# --------------------------------------------------------------------------- #
@distributed(world_sizes=OP_WORLD_SIZES)
def test_dispatch_handler_wins_over_library_rule_and_is_removable(ctx):
    x = _sharded(ctx.mesh)
    calls = []

    def shifted_sin(func, types, args, kwargs):
        calls.append(func)
        a = args[0]
        return ShardTensor(torch.sin(a._local_tensor) + 1, a._spec, requires_grad=False)

    with registry.dispatch_handlers.override(aten.sin.default, shifted_sin):
        assert torch.allclose(torch.sin(x).full_tensor(), torch.sin(_g()) + 1)
    assert calls == [aten.sin.default]
    assert aten.sin.default not in registry.dispatch_handlers  # restored: no leak
    assert torch.allclose(torch.sin(x).full_tensor(), torch.sin(_g()))
    ShardTensor.register_dispatch_handler(aten.sin.default, shifted_sin)
    try:
        assert torch.allclose(torch.sin(x).full_tensor(), torch.sin(_g()) + 1)
    finally:
        registry.dispatch_handlers.unregister(aten.sin.default)
    assert torch.allclose(torch.sin(x).full_tensor(), torch.sin(_g()))
    with pytest.raises(TypeError, match="callable"):
        ShardTensor.register_dispatch_handler(aten.sin.default, "not a function")


def _constant(value):
    def handler(func, types, args, kwargs):
        a = args[0]
        return ShardTensor(torch.full_like(a._local_tensor, value), a._spec, requires_grad=False)

    return handler


@distributed(world_sizes=OP_WORLD_SIZES)
def test_override_restores_a_previous_handler_and_none_removes_one(ctx):
    x = _sharded(ctx.mesh)

    def value():
        return torch.unique(torch.cos(x).full_tensor()).tolist()

    with registry.dispatch_handlers.override(aten.cos.default, _constant(1.0)):
        with registry.dispatch_handlers.override(aten.cos.default, _constant(2.0)):
            assert value() == [2.0]
        assert value() == [1.0]
        with registry.dispatch_handlers.override(aten.cos.default, None):
            assert torch.allclose(torch.cos(x).full_tensor(), torch.cos(_g()))
        assert value() == [1.0]
    assert aten.cos.default not in registry.dispatch_handlers


@distributed(world_sizes=OP_WORLD_SIZES)
def test_function_handler_sees_promoted_plain_arguments(ctx):
    mesh = ctx.mesh
    x = _sharded(mesh)
    w = _g((3,), 1)
    seen = {}

    def handler(func, types, args, kwargs):
        seen["types"] = [type(a) for a in args]
        seen["placements"] = args[1].placements
        with torch_function_disabled():
            return func(*args, **kwargs) * 10

    ShardTensor.register_function_handler(torch.mul, handler)
    try:
        y = torch.mul(x, w)
    finally:
        registry.function_handlers.unregister(torch.mul)
    assert seen["types"] == [ShardTensor, ShardTensor]
    assert seen["placements"] == (Replicate(),) * mesh.ndim
    assert torch.allclose(y.full_tensor(), _g() * w * 10)
    assert torch.allclose(torch.mul(x, w).full_tensor(), _g() * w)  # gone again


@distributed(world_sizes=OP_WORLD_SIZES)
def test_patches_enabled_controls_function_handlers(ctx):
    x = _sharded(ctx.mesh)
    assert ShardTensor.patches_enabled()  # on as soon as a ShardTensor exists
    handler = lambda func, types, args, kwargs: "handled"  # noqa: E731
    with registry.function_handlers.override(torch.tanh, handler):
        assert torch.tanh(x) == "handled"
        set_patches_enabled(False)
        try:
            assert not ShardTensor.patches_enabled()
            assert torch.allclose(torch.tanh(x).full_tensor(), torch.tanh(_g()))
        finally:
            set_patches_enabled(True)
        assert torch.tanh(x) == "handled"


@distributed(world_sizes=OP_WORLD_SIZES)
def test_named_function_handler_for_a_custom_op(ctx):
    x = _sharded(ctx.mesh)
    assert torch.equal(_twice(_g()), _g() * 2)  # plain tensors: the op's own kernel
    with pytest.raises(NotImplementedError, match="pdp_test.twice"):
        _twice(x)
    calls = []

    def handler(func, types, args, kwargs):
        calls.append(str(func))
        a = args[0]
        return ShardTensor(a._local_tensor * 2, a._spec, requires_grad=False)

    ShardTensor.register_named_function_handler("pdp_test.twice.default", handler)
    try:
        y = _twice(x)
    finally:
        registry.named_function_handlers.unregister("pdp_test.twice.default")
    assert calls and set(calls) == {"pdp_test.twice.default"}
    assert isinstance(y, ShardTensor) and y._spec == x._spec
    assert torch.equal(y.full_tensor(), _g() * 2)


# --------------------------------------------------------------------------- #
# promotion modes (pure state; no ranks needed)
# --------------------------------------------------------------------------- #
def test_promotion_mode_setters_and_context_manager():
    assert get_promotion_mode() is TensorPromotionMode.SILENT  # the default
    try:
        for value, mode in (("disabled", TensorPromotionMode.DISABLED), ("WARN", TensorPromotionMode.WARN),
                            (TensorPromotionMode.SILENT, TensorPromotionMode.SILENT), ("silent", TensorPromotionMode.SILENT)):
            set_promotion_mode(value)
            assert get_promotion_mode() is mode
            assert ShardTensor.get_promotion_mode() is mode
        with pytest.raises(ValueError, match="disabled"):
            set_promotion_mode("loud")
        with pytest.raises(ValueError):
            set_promotion_mode(3)
        assert get_promotion_mode() is TensorPromotionMode.SILENT  # a bad value changes nothing
        with promotion_mode("warn") as active:
            assert active is TensorPromotionMode.WARN and get_promotion_mode() is TensorPromotionMode.WARN
            with ShardTensor.promotion_mode(TensorPromotionMode.DISABLED):
                assert get_promotion_mode() is TensorPromotionMode.DISABLED
            assert get_promotion_mode() is TensorPromotionMode.WARN
        assert get_promotion_mode() is TensorPromotionMode.SILENT
        with pytest.raises(KeyError):
            with promotion_mode("disabled"):
                raise KeyError("boom")
        assert get_promotion_mode() is TensorPromotionMode.SILENT  # restored on errors too
    finally:
        set_promotion_mode("silent")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_disabled_mode_refuses_plain_tensors_but_not_scalars(ctx):
    x = _sharded(ctx.mesh)
    w = _g((3,), 1)
    with promotion_mode("disabled"):
        with pytest.raises(PromotionError, match=r"plain tensor of shape \(3,\).*DISABLED"):
            torch.mul(x, w)
        with pytest.raises(PromotionError, match="DISABLED"):
            torch.add(w, x)
        with pytest.raises(PromotionError, match="DISABLED"):  # operators keep the message too
            x * w
        y = x * 2.0 + torch.tensor(1.5, dtype=torch.float64)  # Python and 0-d scalars are fine
    assert torch.allclose(y.full_tensor(), _g() * 2 + 1.5)
    assert torch.allclose((x * w).full_tensor(), _g() * w)  # silent again outside


@distributed(world_sizes=OP_WORLD_SIZES)
def test_warn_mode_warns_once_per_promotion(ctx):
    x = _sharded(ctx.mesh)
    w, b = _g((3,), 1), _g((5, 3), 2)
    with promotion_mode("warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = x * w + b
        z = x * 3.0
    messages = [str(c.message) for c in caught if "promoting a plain tensor" in str(c.message)]
    assert len(messages) == 2 and "(3,)" in messages[0] and "(5, 3)" in messages[1]
    assert torch.allclose(y.full_tensor(), _g() * w + b) and isinstance(z, ShardTensor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x * w  # SILENT: no warning
    assert not [c for c in caught if "promoting" in str(c.message)]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_promoted_parameter_gets_the_single_process_gradient_as_a_plain_tensor(ctx):
    mesh = ctx.mesh
    w = torch.nn.Parameter(_g((3,), 1))
    bias = torch.nn.Parameter(_g((5, 1), 2))
    scale = torch.nn.Parameter(_g((), 4))  # 0-dim: its gradient used to stay a per-rank Partial ShardTensor
    w_ref, b_ref, s_ref = (torch.nn.Parameter(t.detach().clone()) for t in (w, bias, scale))
    G, W = _g(), _g(seed=3)
    for placements in ((Shard(0),) * mesh.ndim, (Shard(1), Replicate())[: mesh.ndim], (Replicate(),) * mesh.ndim):
        w.grad = bias.grad = scale.grad = w_ref.grad = b_ref.grad = s_ref.grad = None
        spec = make_spec(mesh, placements, SHAPE)
        x = shard_from_global(G, spec, requires_grad=True)
        y = torch.tanh(x * w * scale + bias)
        torch.autograd.backward([y], [shard_from_global(W, y._spec)])
        ref = G.clone().requires_grad_(True)
        torch.autograd.backward([torch.tanh(ref * w_ref * s_ref + b_ref)], [W])
        for p, r in ((w, w_ref), (bias, b_ref), (scale, s_ref)):
            assert type(p.grad) is torch.Tensor, placements
            assert torch.allclose(p.grad, r.grad, rtol=1e-10, atol=1e-10), placements
        assert torch.allclose(x.grad.full_tensor(), ref.grad, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- #
# mixed inputs
# --------------------------------------------------------------------------- #
def _other_mesh(ctx):
    if ctx.mesh.ndim == 2:
        return ctx.mesh["ddp"], ctx.mesh["domain"]
    return ctx.mesh, DeviceMesh("cpu", list(range(ctx.world_size)), mesh_dim_names=("other",))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_shard_tensors_on_different_meshes_do_not_mix(ctx):
    a_mesh, b_mesh = _other_mesh(ctx)
    a = shard_from_global(_g(), make_spec(a_mesh, (Shard(0),), SHAPE))
    b = shard_from_global(_g(seed=1), make_spec(b_mesh, (Shard(0),), SHAPE))
    with pytest.raises(PlacementError, match="different device meshes"):
        torch.add(a, b)
    with pytest.raises(PlacementError, match="different device meshes"):
        a + b
    with pytest.raises(PlacementError, match="different device meshes"):
        torch.cat([a, b])


@distributed(world_sizes=OP_WORLD_SIZES)
def test_dtensor_arguments_are_converted(ctx):
    mesh = ctx.mesh
    x = _sharded(mesh, requires_grad=True)
    dt = distribute_tensor(_g(seed=1), mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)).requires_grad_(True)
    y = x * dt
    assert isinstance(y, ShardTensor) and not isinstance(y, DTensor)
    assert torch.allclose(y.full_tensor(), _g() * _g(seed=1))
    torch.autograd.backward([y], [shard_from_global(torch.ones(SHAPE, dtype=torch.float64), y._spec)])
    assert isinstance(dt.grad, DTensor)
    assert torch.allclose(dt.grad.full_tensor(), _g())
    assert torch.allclose(x.grad.full_tensor(), _g(seed=1))


def _dtensor_operand(mesh, kind, rank):
    """A DTensor leaf of value ``w`` (0-dim ``w = 0.75``, or ``w`` of shape ``SHAPE[-1:]``) in layout ``kind``."""
    if kind == "partial0":  # 0-dim, every rank a different contribution summing to 0.75
        contribution = torch.tensor(0.75 * (rank + 1) / (mesh.size() * (mesh.size() + 1) / 2), dtype=torch.float64)
        w = DTensor.from_local(contribution, mesh, [Partial()] * mesh.ndim, run_check=False)
        return w.requires_grad_(True), torch.tensor(0.75, dtype=torch.float64)
    value = torch.tensor(0.75, dtype=torch.float64) if kind == "replicate0" else _g(SHAPE[-1:], seed=2)
    placements = [Shard(0) if kind == "shard1" else Replicate()] + [Replicate()] * (mesh.ndim - 1)
    return distribute_tensor(value, mesh, placements).requires_grad_(True), value


@pytest.mark.parametrize("kind", ["replicate0", "partial0", "shard1"])
@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_dtensor_arguments_of_any_ndim_are_converted(ctx, kind):
    """A 0-dim DTensor used to slip past promotion as a "scalar" and reach DTensor's dispatch."""
    x = _sharded(ctx.mesh, requires_grad=True)
    dt, value = _dtensor_operand(ctx.mesh, kind, ctx.mesh.get_rank())
    f = torch.sigmoid if kind == "replicate0" else (lambda t: t)  # sigmoid: 0-dim output of an op on a DTensor
    ref_leaf = value.clone().requires_grad_(True)
    (_g() * f(ref_leaf)).sum().backward()
    w = f(dt)
    for y in (x * w, w * x):
        assert isinstance(y, ShardTensor) and not isinstance(y, DTensor)
        assert torch.allclose(y.full_tensor(), _g() * f(value))
    (x * w).sum().backward()
    assert isinstance(dt.grad, DTensor)
    assert torch.allclose(dt.grad.full_tensor(), ref_leaf.grad)
    assert torch.allclose(x.grad.full_tensor(), f(value).detach().expand(SHAPE))


# --------------------------------------------------------------------------- #
# sync_module_over_mesh
# --------------------------------------------------------------------------- #
class _Model(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.lin = torch.nn.Linear(3, width)
        self.register_buffer("stat", torch.randn(width))
        self.register_buffer("steps", torch.tensor(0))


def _model(seed, width=4):
    torch.manual_seed(seed)
    model = _Model(width)
    model.steps += seed
    return model


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@distributed(world_sizes=OP_WORLD_SIZES)
def test_sync_broadcasts_plain_state_over_a_1d_mesh(ctx):
    mesh = ctx.mesh if ctx.mesh.ndim == 1 else ctx.mesh["domain"]
    group_size = mesh.size()
    src = group_size - 1
    model = _model(ctx.rank)
    sync_module_over_mesh(model, mesh, src_mesh_rank=src, verify=True)
    # the source is the rank at position src of this rank's group along the mesh
    src_rank = int(mesh.mesh[src])
    expected = _state(_model(src_rank))
    for name, value in _state(model).items():
        assert torch.equal(value, expected[name]), name
    if ctx.mesh.ndim == 2:  # the other axis is untouched: ddp groups keep their own weights
        other = int(ctx.mesh.mesh[1 - ctx.mesh.get_coordinate()[0], src])
        assert not torch.equal(_state(model)["lin.weight"], _state(_model(other))["lin.weight"])
    sync_module_over_mesh(model, mesh)  # idempotent, default source 0


@distributed(world_sizes=OP_WORLD_SIZES)
def test_sync_skips_distributed_state(ctx):
    mesh = ctx.mesh if ctx.mesh.ndim == 1 else ctx.mesh["domain"]
    model = _model(ctx.rank)
    local = torch.full((2,), float(ctx.rank))
    model.register_buffer("sharded", ShardTensor.from_local(local, mesh, [Shard(0)]))
    model.register_buffer("dtensor", DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False))
    sync_module_over_mesh(model, mesh, verify=True)
    assert torch.equal(model.sharded._local_tensor, local)
    assert torch.equal(model.dtensor.to_local(), local)
    assert torch.equal(model.lin.weight, _model(int(mesh.mesh[0])).lin.weight)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_sync_errors(ctx):
    domain = ctx.mesh if ctx.mesh.ndim == 1 else ctx.mesh["domain"]
    model = _model(0)
    if ctx.mesh.ndim == 2:
        with pytest.raises(ValueError, match=r'mesh\["domain"\]'):
            sync_module_over_mesh(model, ctx.mesh)
    for bad in (-1, domain.size()):
        with pytest.raises(ValueError, match="src_mesh_rank"):
            sync_module_over_mesh(model, domain, src_mesh_rank=bad)
    with pytest.raises(RuntimeError, match="nothing plain"):
        sync_module_over_mesh(torch.nn.ReLU(), domain)
    only_sharded = torch.nn.Module()
    only_sharded.register_buffer("x", ShardTensor.from_local(torch.ones(2), domain, [Shard(0)]))
    with pytest.raises(RuntimeError, match="already distributed"):
        sync_module_over_mesh(only_sharded, domain)
    from torch.distributed.fsdp import fully_shard

    wrapped = fully_shard(_model(0), mesh=domain)
    with pytest.raises(RuntimeError, match="fully_shard"):
        sync_module_over_mesh(wrapped, domain)


@distributed(world_sizes=(2, 3), mesh_2d=True)
def test_sync_metadata_mismatch_raises_on_every_rank(ctx):
    domain = ctx.mesh if ctx.mesh.ndim == 1 else ctx.mesh["domain"]
    width = 4 if domain.get_local_rank() == 0 else 5
    with pytest.raises(RuntimeError, match="disagree"):
        sync_module_over_mesh(_model(0, width), domain)
    renamed = _model(0)
    if domain.get_local_rank() == 1:
        renamed.register_buffer("extra", torch.zeros(1))
    with pytest.raises(RuntimeError, match="disagree"):
        sync_module_over_mesh(renamed, domain, verify=True)
