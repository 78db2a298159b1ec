"""Exceptions physicsnemo_dp raises for requests it cannot honour."""

from __future__ import annotations

__all__ = ["PlacementError", "PromotionError", "ImplicitGatherError", "ImplicitGatherWarning"]


class PlacementError(ValueError, RuntimeError):
    """A placement, mesh or shard-size request that cannot be honoured.

    It is both a ``ValueError`` (bad argument) and a ``RuntimeError`` (what
    DTensor raises for the same mistakes), so either ``except`` clause works.
    The checks read only metadata that every rank shares, or that every rank
    first gathered from all ranks (``physicsnemo_dp._agreement``), so every
    rank raises the same error instead of some ranks waiting in a collective.
    Communication-free constructions compare ranks only in the checking mode
    (:func:`physicsnemo_dp.debug.checks`).
    """


class PromotionError(RuntimeError):
    """A plain tensor met a ShardTensor while promotion is DISABLED.

    Not a ``TypeError`` on purpose: Python turns a ``TypeError`` raised inside
    an operator (``x * w``) into its own "unsupported operand" message, which
    would hide the explanation and the fix.
    """


class ImplicitGatherError(RuntimeError):
    """An op gathered data the size of a whole sharded dim that the result did not ask for, under policy ``"raise"``.

    Raised on every rank alike (the decision reads only layouts) before any
    data moves; the message names the op, the bytes per rank, the user's
    source line and the fix (see :func:`physicsnemo_dp.implicit_gathers`).
    """


class ImplicitGatherWarning(UserWarning):
    """An implicit gather under policy ``"warn"`` (printed once per source line, by the first rank of the mesh)."""
