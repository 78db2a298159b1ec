"""Activation checkpointing applied in place, without renaming anything.

``torch.utils.checkpoint`` recomputes a module's forward during backward
instead of keeping its activations. The usual way to apply it to a module,
wrapping it in another module, inserts a level into every parameter name
(``blocks.0._checkpoint_wrapped_module.weight``), which then leaks into
precision pins, trainability patterns, optimizer groups and state dicts.

Here the module's class is swapped for a subclass whose ``forward`` runs the
original one under ``checkpoint`` — the same technique ``fully_shard`` uses —
so names, ``isinstance`` and ``state_dict`` are unchanged. FSDP2 units built
afterwards wrap the checkpointed forward: the weights they gather for
backward are in place when the recomputation runs.

The recomputation runs under the torch-function state of the original
forward. Backward may be entered with subclass ``__torch_function__``
disabled (``ShardTensor.backward`` goes through it); without restoring the
state, ShardTensor ops would skip their function-level handlers (e.g.
``F.linear`` would decompose into ``view`` + ``mm``), record different saved
tensors and fail checkpoint's consistency check.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from .._torch_compat import torch_function_state, torch_function_state_as
from .config import ActivationCheckpointing

__all__ = ["apply_checkpointing", "is_checkpointed"]


class _Checkpointed:
    """Marker base of the generated classes."""


@functools.lru_cache(maxsize=None)
def _checkpointed_class(cls: type, preserve_rng_state: bool) -> type:
    inner = cls.forward

    def forward(self, *args, **kwargs):
        state = torch_function_state()

        def run(*args, **kwargs):
            with torch_function_state_as(state):
                return inner(self, *args, **kwargs)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    forward.__doc__ = f"{cls.__name__}.forward, recomputed in backward (activation checkpointing)."
    return type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {"forward": forward, "__module__": cls.__module__})


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_checkpointing` has been applied to ``module``."""
    return isinstance(module, _Checkpointed)


def apply_checkpointing(module: nn.Module, policy: ActivationCheckpointing) -> None:
    """Make ``module``'s forward recompute in backward (in place; names stay the same).

    Raises:
        ValueError: ``module`` is already checkpointed (parallelized twice?).
    """
    if is_checkpointed(module):
        raise ValueError(f"{type(module).__name__} is already checkpointed; parallelize a model only once")
    module.__class__ = _checkpointed_class(type(module), policy.preserve_rng_state)
