"""What happens when a plain ``torch.Tensor`` meets a ShardTensor.

A plain tensor in an op with sharded data is almost always a model weight
(replicated by DDP, all-gathered by FSDP2). *Promotion* treats it as
``Replicate`` on the ShardTensor's mesh and, in backward, sums its gradient
over that mesh so it equals the single-process gradient.

The mode is explicit, resettable state: :func:`set_promotion_mode` and the
:func:`promotion_mode` context manager (which always restores the previous
mode) — tests can change it without leaking into each other.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator

__all__ = ["TensorPromotionMode", "set_promotion_mode", "get_promotion_mode", "promotion_mode"]


class TensorPromotionMode(enum.Enum):
    """How a plain tensor meeting a ShardTensor is handled."""

    #: No promotion: a plain tensor meeting sharded data raises, unless it is a
    #: 0-dim tensor without grad (a scalar; a scalar parameter's gradient needs promotion).
    DISABLED = "disabled"
    #: Promote to Replicate and warn on every promotion (to find where it happens).
    WARN = "warn"
    #: Promote to Replicate silently. The default.
    SILENT = "silent"


_mode = TensorPromotionMode.SILENT


def _coerce(mode) -> TensorPromotionMode:
    if isinstance(mode, TensorPromotionMode):
        return mode
    if isinstance(mode, str):
        try:
            return TensorPromotionMode(mode.lower())
        except ValueError:
            pass
    choices = ", ".join(repr(m.value) for m in TensorPromotionMode)
    raise ValueError(f"mode must be a TensorPromotionMode or one of {choices}, got {mode!r}")


def set_promotion_mode(mode) -> None:
    """Set the promotion mode (enum or ``"disabled"`` / ``"warn"`` / ``"silent"``)."""
    global _mode
    _mode = _coerce(mode)


def get_promotion_mode() -> TensorPromotionMode:
    """The active promotion mode (``SILENT`` unless changed)."""
    return _mode


@contextlib.contextmanager
def promotion_mode(mode) -> Iterator[TensorPromotionMode]:
    """Use ``mode`` inside the block; the previous mode returns on exit, also on errors."""
    previous = get_promotion_mode()
    set_promotion_mode(mode)
    try:
        yield get_promotion_mode()
    finally:
        set_promotion_mode(previous)
