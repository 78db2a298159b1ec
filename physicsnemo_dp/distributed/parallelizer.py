"""``ModelParallelizer``: the one contract between a model and the distributed runtime.

It has a single public operation, ``parallelize(model, mesh_context)``, and
always runs the same flow (:meth:`ModelParallelizer._apply`):

1. **check** — the model's declared capabilities cover the context, the model
   is not parallelized already, its fp32 pins are well formed;
2. **freeze** the parameters the context's ``Trainability`` names;
3. **synchronize** plain weights and buffers from rank 0 of the ``"domain"``
   axis (those ranks split one sample, so they must hold identical weights),
   and of the ``"ddp"`` axis too unless DDP does it (``fully_shard``
   broadcasts nothing);
4. **checkpoint** the activations of :meth:`_checkpoint_targets`, if asked;
5. **bucket** the domain reductions: the promoted weights' gradients are
   summed over ``"domain"`` one bucket of ``gradient_bucket_mb`` at a time
   (:func:`~physicsnemo_dp.bucket_gradients`) instead of one all-reduce per
   layer call, unless FSDP2 shards the weights or ``"domain"`` has one rank;
6. **dispatch** on the strategy: DDP on the ``"ddp"`` process group; FSDP2
   ``fully_shard`` per unit on the ``"ddp"`` submesh with the mixed-precision
   policy (pinned modules in fp32 units); nothing without a strategy;
7. **cast** fully frozen parts toward the compute dtype (FSDP2 mixed precision).

Axes of size 1 are explicit cases, not accidents: nothing is synchronized
over them, and DDP is not applied when ``ddp_size == 1`` (a one-rank
all-reduce is a copy; the model comes back unwrapped). FSDP2 is applied even
on one rank, so the mixed-precision policy and the pins behave the same at
every scale.

Domain parallelism needs no wrapper: a plain weight that meets a ShardTensor
input is promoted, and its ``.grad`` is the plain single-process gradient of
this rank's samples, which DDP's all-reduce and FSDP2's reduce-scatter then
average over ``"ddp"`` like any other gradient.

**Sidecars.** A model that needs something different subclasses this class,
overrides the narrowest protected hook, and attaches an instance to the model
class as ``parallelizer``::

    class MyModelParallelizer(ModelParallelizer):
        def _fully_shard_module(self, module, **kwargs):
            return my_fully_shard(module, **kwargs)

    MyModel.parallelizer = MyModelParallelizer()

Hooks: :meth:`_fully_shard_module` (the FSDP2 primitive), :meth:`_apply_fsdp_sharding`
(which modules become units), :meth:`_checkpoint_targets` (which modules are
recomputed) and :meth:`_apply` (surrounds the whole flow; call
``super()._apply`` to keep the ordering and checks). Sidecars add no public
methods and this module never names a model (``tools/lint_parallelizer_contract.py``).
"""

from __future__ import annotations

import contextvars

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..promotion import bucket_gradients
from ..sync import sync_module_over_mesh
from .capabilities import _as_capabilities, check_capabilities
from .activation_checkpointing import apply_checkpointing
from .config import DDPConfig, FSDP2Config
from .mesh_context import MeshContext
from .precision import cast_frozen_state, complex_policy, fp32_pins, pinned_owners, pinned_policy, unit_parameters

__all__ = ["ModelParallelizer", "parallelize_model", "find_blocks"]

#: The ``capabilities=`` of the ``parallelize`` call running now (None: the class's declaration). A context
#: variable rather than an argument so that sidecars' ``_apply(model, mesh_context)`` keeps its signature.
_GIVEN_CAPABILITIES: contextvars.ContextVar = contextvars.ContextVar("pdp_given_capabilities", default=None)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the entries of its outermost ``nn.ModuleList`` containers.

    This is the default FSDP unit and checkpointing granularity (a stack of
    layers is kept in a ``ModuleList`` by near universal convention). Lists
    nested inside a block belong to that block.
    """
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(child)
            else:
                visit(child)

    visit(model)
    return blocks


def _is_parallelized(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) or any(isinstance(m, FSDPModule) for m in model.modules())


def _bulk_policy(mesh_context: MeshContext) -> MixedPrecisionPolicy:
    return mesh_context.mixed_precision or MixedPrecisionPolicy()


def _active_pins(model: nn.Module, mesh_context: MeshContext) -> tuple[str, ...]:
    """The fp32 pins that need their own units: only when FSDP2 computes in another dtype."""
    pins = fp32_pins(model)
    lowered = isinstance(mesh_context.strategy, FSDP2Config) and _bulk_policy(mesh_context).param_dtype is not None
    return pins if lowered else ()


class ModelParallelizer:
    """Parallelizes a model for a :class:`MeshContext` (see the module doc for the flow and hooks)."""

    def parallelize(self, model: nn.Module, mesh_context: MeshContext, *, capabilities=None) -> nn.Module:
        """Return ``model`` parallelized for ``mesh_context`` (a DDP wrapper, or the model itself).

        Call it on every rank with the same model architecture, after moving the
        model to ``mesh_context.device`` and before building the optimizer.
        ``capabilities`` (a ModelCapabilities, or a mapping of flag names to
        bools) declares the profile of a model class that declares none, for
        this call only.

        Raises:
            TypeError: ``model`` is not an ``nn.Module`` or ``mesh_context`` not a MeshContext;
                ``capabilities`` with an unknown flag, or given for a class that declares its own.
            CapabilityError: the model does not declare a capability the context needs.
            ValueError: the model is already parallelized, its fp32 pins share a
                module with unpinned parameters, a trainability pattern matches
                nothing, or checkpointing has no target.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"parallelize needs an nn.Module, got {type(model).__name__}")
        if not isinstance(mesh_context, MeshContext):
            raise TypeError(
                f"parallelize needs a MeshContext, got {type(mesh_context).__name__}; "
                "build one with MeshContext.build(...) or MeshContext.from_mesh(mesh)"
            )
        if capabilities is not None:
            capabilities = _as_capabilities(capabilities, "capabilities=")
        token = _GIVEN_CAPABILITIES.set(capabilities)
        try:
            return self._apply(model, mesh_context)
        finally:
            _GIVEN_CAPABILITIES.reset(token)

    # ----------------------------------------------------------------- hooks
    def _apply(self, model: nn.Module, mesh_context: MeshContext) -> nn.Module:
        """The whole flow. Override to surround it; call ``super()._apply`` to keep it.

        Everything that can refuse runs before the first collective or change
        to the model, so a refusal leaves the model as it was on every rank.
        """
        _check(model, mesh_context)
        checkpointing = mesh_context.activation_checkpointing
        targets = self._checkpoint_targets(model) if checkpointing is not None else []
        if checkpointing is not None and not targets:
            raise ValueError(
                f"activation checkpointing was requested but {type(model).__name__} has no blocks "
                "(entries of an nn.ModuleList); keep its layers in a ModuleList or override "
                "_checkpoint_targets in a sidecar"
            )
        frozen = set(mesh_context.trainability.frozen_names(name for name, _ in model.named_parameters()))
        for name, param in model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        _synchronize(model, mesh_context)
        for module in targets:
            apply_checkpointing(module, checkpointing)
        _bucket_domain_reductions(model, mesh_context)
        if isinstance(mesh_context.strategy, FSDP2Config):
            model = self._apply_fsdp_sharding(model, mesh_context)
            policy = _bulk_policy(mesh_context)
            if policy.param_dtype is not None:
                cast_frozen_state(model, policy.param_dtype, fp32_pins(model))
        elif isinstance(mesh_context.strategy, DDPConfig):
            model = _wrap_ddp(model, mesh_context)
        return model

    def _fully_shard_module(self, module: nn.Module, **kwargs) -> nn.Module:
        """Make ``module`` one FSDP2 unit; ``kwargs`` are ``fully_shard``'s (mesh, mp_policy, ...)."""
        return fully_shard(module, **kwargs)

    def _apply_fsdp_sharding(self, model: nn.Module, mesh_context: MeshContext) -> nn.Module:
        """Shard the units bottom-up: fp32-pinned modules, blocks, then the root.

        Each unit goes through :meth:`_fully_shard_module` on ``mesh_context.ddp_mesh``.
        A pinned module gets :func:`~physicsnemo_dp.distributed.precision.pinned_policy`,
        a unit of complex trainable parameters :func:`~physicsnemo_dp.distributed.precision.complex_policy`
        (when the policy sets a ``reduce_dtype``), everything else the context's mixed-precision policy.
        """
        bulk = _bulk_policy(mesh_context)
        pinned = {id(m) for m in pinned_owners(model, _active_pins(model, mesh_context))}
        units = {id(m) for m in find_blocks(model)} | pinned | {id(model)}
        for module in reversed(list(model.modules())):  # reversed pre-order: children before parents
            if id(module) in units:
                policy = pinned_policy(bulk) if id(module) in pinned else bulk
                trainable = [p for p in unit_parameters(module, units - {id(module)}) if p.requires_grad]
                if policy.reduce_dtype is not None and trainable and all(p.is_complex() for p in trainable):
                    policy = complex_policy(policy)
                self._fully_shard_module(
                    module,
                    mesh=mesh_context.ddp_mesh,
                    mp_policy=policy,
                    reshard_after_forward=mesh_context.strategy.reshard_after_forward,
                )
        return model

    def _checkpoint_targets(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose activations are recomputed in backward (default: the blocks)."""
        return find_blocks(model)


# ------------------------------------------------------------------- the flow
# Module functions, not methods: sidecars customize through the hooks above only.
def _check(model: nn.Module, mesh_context: MeshContext) -> None:
    if _is_parallelized(model):
        raise ValueError(
            f"{type(model).__name__} is already parallelized (wrapped by DDP or fully_shard); "
            "parallelize the bare model exactly once"
        )
    check_capabilities(model, mesh_context, _GIVEN_CAPABILITIES.get())
    pinned_owners(model, _active_pins(model, mesh_context))


def _synchronize(model: nn.Module, mesh_context: MeshContext) -> None:
    """Rank 0's plain state on every rank of each axis of size > 1 (DDP broadcasts over "ddp" itself)."""
    axes = ("domain",) if isinstance(mesh_context.strategy, DDPConfig) else ("domain", "ddp")
    for axis in axes:
        if mesh_context.mesh[axis].size() > 1:
            sync_module_over_mesh(model, mesh_context.mesh[axis])


def _bucket_domain_reductions(model: nn.Module, mesh_context: MeshContext) -> None:
    """One all-reduce per bucket for the promoted weights' gradients over ``"domain"``.

    Why by default: every layer call's reduction is a collective with a fixed
    cost. MeshGraphNet (4 layers of edge and node MLPs) made 32 all-reduces per
    step; on 4 gloo ranks over 2 cores its CPU work of all ranks over one
    device's went from 2.26 to 1.23 at 4,096 nodes per rank with buckets. Under
    FSDP2 the weights that meet the activations are its unsharded copies, which
    are not the registered parameters, so there is nothing to bucket.
    """
    cap = mesh_context.gradient_bucket_mb
    if cap is None or mesh_context.domain_size == 1 or isinstance(mesh_context.strategy, FSDP2Config):
        return
    bucket_gradients(model, cap_mb=cap)


def _wrap_ddp(model: nn.Module, mesh_context: MeshContext) -> nn.Module:
    if mesh_context.ddp_size == 1:
        return model  # a one-rank all-reduce is a copy: return the model unwrapped
    kwargs = mesh_context.strategy.ddp_kwargs()
    if mesh_context.mesh.device_type == "cuda":
        kwargs["device_ids"] = [torch.cuda.current_device()]
    return DistributedDataParallel(model, device_mesh=mesh_context.ddp_mesh, **kwargs)


def parallelize_model(model: nn.Module, mesh_context: MeshContext, *, capabilities=None) -> nn.Module:
    """Parallelize ``model`` with its class's ``parallelizer`` sidecar, or the default one.

    ``capabilities`` declares what a model class one cannot edit was verified to
    support (``{"supports_domain": True}`` or a ModelCapabilities), for this call;
    :func:`~physicsnemo_dp.distributed.register_capabilities` does it for the
    whole process. Unknown flags, and either for a class that declares its own
    ``ModelCapabilities``, are refused (TypeError).

    Raises:
        TypeError: the class's ``parallelizer`` attribute is not a ModelParallelizer.
        (and whatever :meth:`ModelParallelizer.parallelize` raises)
    """
    parallelizer = getattr(type(model), "parallelizer", None)
    if parallelizer is None:
        parallelizer = ModelParallelizer()
    if not isinstance(parallelizer, ModelParallelizer):
        raise TypeError(
            f"{type(model).__name__}.parallelizer must be a ModelParallelizer instance, got "
            f"{type(parallelizer).__name__}; attach an instance of your sidecar class"
        )
    return parallelizer.parallelize(model, mesh_context, capabilities=capabilities)
