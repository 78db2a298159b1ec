"""Precision pins and the casting rules for frozen parts under mixed precision.

**Pins.** A model class lists parameter-name substrings in
``_keep_in_fp32_modules_strict``; matching parameters are stored *and
computed* in fp32 even when the FSDP2 policy computes the rest in bf16 (think
of a learned log-timescale or a gate bias whose bf16 rounding changes
results). torch 2.13's ``MixedPrecisionPolicy`` has no per-parameter dtype,
so each module that holds pinned parameters becomes its own FSDP unit with an
fp32 policy: its weights are gathered in fp32, its inputs are cast to fp32 on
entry, and its output is cast back to the bulk compute dtype so the next
(bf16) module receives what it expects. Two consequences:

* the module must hold *only* pinned parameters directly (put them in a small
  holder submodule, e.g. ``self._fp32_params``); a module mixing pinned and
  unpinned parameters is refused rather than silently computed in one dtype;
* the module must be *called* (its forward is where FSDP gathers and casts);
  reading ``holder.weight`` from a parent's forward bypasses that.

**Complex parameters** (an FNO's spectral weights). FSDP2 never casts them
(mixed precision is for floating-point parameters), but it would reduce their
gradients in the policy's ``reduce_dtype``, and a complex gradient cannot be
cast to a real dtype (torch's ``TypeError`` in the backward). A unit whose
trainable parameters are all complex therefore gets the bulk policy with
``reduce_dtype=None`` (:func:`complex_policy`): its gradients are reduced in
their own complex dtype. FSDP2 refuses a unit mixing complex and real
trainable parameters with any policy (keep them in separate blocks).

**Frozen parts.** A fully frozen submodule that stayed fp32 would feed fp32
tensors into bf16 modules. After sharding, such submodules are cast toward
the policy's ``param_dtype`` unless pinned: their plain parameters are cast,
parameters FSDP manages (DTensors) are left to FSDP's cast on all-gather, and
floating buffers — always plain — are cast.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

__all__ = [
    "fp32_pins",
    "is_pinned",
    "pinned_owners",
    "pinned_policy",
    "complex_policy",
    "unit_parameters",
    "cast_frozen_state",
]

_PIN_ATTRIBUTE = "_keep_in_fp32_modules_strict"


def fp32_pins(model: nn.Module) -> tuple[str, ...]:
    """The parameter-name substrings ``model``'s class pins to fp32 (empty if none)."""
    pins = getattr(type(model), _PIN_ATTRIBUTE, None) or ()
    if isinstance(pins, str) or not all(isinstance(p, str) and p for p in pins):
        raise TypeError(
            f"{type(model).__name__}.{_PIN_ATTRIBUTE} must be a list of non-empty parameter-name "
            f"substrings, got {pins!r}"
        )
    return tuple(pins)


def is_pinned(name: str, pins) -> bool:
    """Whether the parameter or buffer ``name`` (fully qualified) matches a pin."""
    return any(p in name for p in pins)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def pinned_owners(model: nn.Module, pins) -> list[nn.Module]:
    """The modules that directly hold pinned parameters (each becomes an fp32 FSDP unit).

    Raises:
        ValueError: a module directly holds pinned and unpinned parameters.
    """
    owners = []
    for prefix, module in model.named_modules():
        direct = [_qualified(prefix, n) for n, _ in module.named_parameters(recurse=False)]
        pinned = [n for n in direct if is_pinned(n, pins)]
        if pinned and len(pinned) != len(direct):
            others = [n for n in direct if n not in pinned]
            raise ValueError(
                f"{pinned} are pinned to fp32 ({_PIN_ATTRIBUTE}) but their module "
                f"{prefix or type(model).__name__!r} also holds {others}, which are not; an FSDP unit "
                "has one compute dtype, so move the pinned parameters into their own submodule "
                "(e.g. an `_fp32_params` holder that the module calls)"
            )
        if pinned:
            owners.append(module)
    return owners


def pinned_policy(bulk: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of a pinned unit: fp32 weights, inputs and reduction; output in the bulk dtype."""
    return MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        output_dtype=bulk.output_dtype or bulk.param_dtype,
        cast_forward_inputs=True,
    )


def complex_policy(bulk: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of a unit of complex parameters: the bulk policy, gradients reduced in their own dtype."""
    return MixedPrecisionPolicy(
        param_dtype=bulk.param_dtype,
        reduce_dtype=None,
        output_dtype=bulk.output_dtype,
        cast_forward_inputs=bulk.cast_forward_inputs,
    )


def unit_parameters(unit: nn.Module, unit_ids) -> list[nn.Parameter]:
    """The parameters FSDP2 manages in ``unit``: its own, not those of nested units (``id``s in ``unit_ids``)."""
    found, stack = {}, [unit]
    while stack:
        module = stack.pop()
        for p in module.parameters(recurse=False):
            found[id(p)] = p
        stack.extend(c for c in module.children() if id(c) not in unit_ids)
    return list(found.values())


def _fully_frozen(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def cast_frozen_state(model: nn.Module, dtype: torch.dtype, pins) -> list[str]:
    """Cast the fully frozen submodules' state toward ``dtype`` (see the module doc); return what was cast."""
    frozen_roots = [prefix for prefix, m in model.named_modules() if _fully_frozen(m)]
    cast = []
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if not any(prefix == r or prefix.startswith(r + ".") or r == "" for r in frozen_roots):
                continue
            for name, p in module.named_parameters(recurse=False):
                full = _qualified(prefix, name)
                if (
                    p.is_floating_point()
                    and p.dtype != dtype
                    and not isinstance(p, DTensor)
                    and not is_pinned(full, pins)
                ):
                    p.data = p.data.to(dtype)
                    cast.append(full)
            for name, b in module.named_buffers(recurse=False):
                full = _qualified(prefix, name)
                if b.is_floating_point() and b.dtype != dtype and not is_pinned(full, pins):
                    setattr(module, name, b.to(dtype))
                    cast.append(full)
    return cast
