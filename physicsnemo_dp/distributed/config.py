"""Policy objects a :class:`~physicsnemo_dp.distributed.MeshContext` carries.

Each is a small frozen dataclass that only *describes* a choice; the
:class:`~physicsnemo_dp.distributed.ModelParallelizer` is the one place that
acts on it. Values are checked when the object is built, so a typo fails at
configuration time on every rank alike, not deep inside a collective.

Mixed precision reuses torch's own ``MixedPrecisionPolicy`` (the FSDP2 one)
rather than inventing a parallel type: it is what ``fully_shard`` consumes.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, fields
from typing import Union

from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "DDPConfig",
    "FSDP2Config",
    "ActivationCheckpointing",
    "Trainability",
    "MixedPrecisionPolicy",
    "Strategy",
    "resolve_strategy",
]


def _check_bools(obj) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise TypeError(f"{type(obj).__name__}.{f.name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class DDPConfig:
    """Replicate the weights over the ``"ddp"`` axis with ``DistributedDataParallel``.

    The fields are passed to DDP unchanged; see its documentation. DDP
    broadcasts rank 0's initial weights over its group itself, so only the
    ``"domain"`` axis needs an explicit synchronization.
    """

    find_unused_parameters: bool = False
    forward_sync_buffers: bool = True
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        _check_bools(self)
        if self.bucket_cap_mb is not None and (
            isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0
        ):
            raise ValueError(f"DDPConfig.bucket_cap_mb must be a positive number or None, got {self.bucket_cap_mb!r}")

    def ddp_kwargs(self) -> dict:
        """Keyword arguments for ``DistributedDataParallel`` (``bucket_cap_mb`` only when set)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        if kwargs["bucket_cap_mb"] is None:
            del kwargs["bucket_cap_mb"]
        return kwargs


@dataclass(frozen=True)
class FSDP2Config:
    """Shard parameters, gradients and optimizer state over the ``"ddp"`` axis with ``fully_shard``.

    Every block (see :class:`~physicsnemo_dp.distributed.ModelParallelizer`)
    becomes one FSDP unit and the root another. ``reshard_after_forward``
    trades memory (``True``: free the gathered weights after forward, gather
    again in backward) for communication.
    """

    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        _check_bools(self)


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Recompute each checkpointed module's forward during backward instead of storing activations.

    Uses ``torch.utils.checkpoint`` (non-reentrant). ``preserve_rng_state``
    makes dropout draw the same numbers in the recomputation.
    """

    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        _check_bools(self)


@dataclass(frozen=True)
class Trainability:
    """Which parameters are frozen: ``fnmatch`` patterns over parameter names.

    ``Trainability(frozen=("encoder.*",))`` sets ``requires_grad=False`` on
    every parameter whose name matches, before any wrapper is built (DDP and
    FSDP2 read ``requires_grad`` when they are constructed). A pattern that
    matches nothing is an error: it is almost always a typo.
    """

    frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        patterns = self.frozen
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"Trainability.frozen must be a tuple of name patterns, got {patterns!r}")
        object.__setattr__(self, "frozen", tuple(patterns))

    def frozen_names(self, names) -> list[str]:
        """The names among ``names`` that are frozen (raises ``ValueError`` for a pattern matching none)."""
        names = list(names)
        unmatched = [p for p in self.frozen if not fnmatch.filter(names, p)]
        if unmatched:
            raise ValueError(
                f"Trainability.frozen patterns {unmatched} match no parameter of the model; "
                f"parameter names look like {names[:3]}"
            )
        return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in self.frozen)]


Strategy = Union[DDPConfig, FSDP2Config, None]

_STRATEGY_NAMES = {"ddp": DDPConfig, "fsdp2": FSDP2Config}


def resolve_strategy(strategy) -> Strategy:
    """A strategy config from a config object, ``"ddp"``, ``"fsdp2"`` or ``None``.

    Raises:
        ValueError: anything else (the message lists the choices).
    """
    if strategy is None or isinstance(strategy, (DDPConfig, FSDP2Config)):
        return strategy
    if isinstance(strategy, str) and strategy.lower() in _STRATEGY_NAMES:
        return _STRATEGY_NAMES[strategy.lower()]()
    raise ValueError(
        f"unknown strategy {strategy!r}; use DDPConfig(...), FSDP2Config(...), "
        '"ddp", "fsdp2" or None (no data-parallel wrapper)'
    )
