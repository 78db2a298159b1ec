"""The one split rule (public: `physicsnemo_dp.split.chunk_sizes`).

Every place in physicsnemo_dp (and datapipes) that splits a dimension without
being told the sizes explicitly uses :func:`chunk_sizes`. It reproduces
``torch.chunk`` — the rule DTensor uses — including its empty trailing pieces:
6 over 4 gives ``(2, 2, 2, 0)`` and 9 over 4 gives ``(3, 3, 3, 0)``. Keeping a
single rule is what lets shapes computed in different modules (scatter,
redistribute, from_dtensor, data loading) agree without communicating.
"""

from __future__ import annotations

from itertools import accumulate


def chunk_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Sizes of the ``parts`` pieces ``torch.chunk`` makes of a dim of ``total``.

    ``torch.chunk`` uses pieces of ``ceil(total / parts)``; the last non-empty
    piece takes the remainder and any pieces after it are empty.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if total == 0:
        return (0,) * parts
    step = -(-total // parts)
    return tuple(max(0, min(step, total - i * step)) for i in range(parts))


def offsets_from_sizes(sizes: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Start index of each piece given the sizes of all pieces (exclusive scan)."""
    return (0, *accumulate(sizes))[: len(sizes)]


def chunk_offset(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``index`` under :func:`chunk_sizes`."""
    sizes = chunk_sizes(total, parts)
    return sum(sizes[:index]), sizes[index]
