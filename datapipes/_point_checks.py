"""Checks of a mesh's points before preparation: finite coordinates, and no two points at one place.

A NaN or infinite coordinate has no place on the space-filling curve (its key
is garbage) and poisons every model that reads it, so preparation refuses it.
Two points with the same coordinates are two graph nodes at one place: the
cells on either side of them share no node, so a model that passes messages
along cells sees a cut there (the usual cause: ``.pvtu`` pieces that each
keep their copy of the nodes they share). Preparation refuses them unless
the caller says they are intended.

Duplicates are found where they are cheap to find: equal coordinates give
equal curve keys, so each run of equal keys of the sorted points is checked
on its own (rows sorted by key, in any number of consecutive blocks: the
trailing run of one block is carried into the next, or exchanged between
ranks).
"""

from __future__ import annotations

import numpy as np

from .errors import DataPipeError

__all__ = ["DuplicateScan", "across_edges", "check_finite", "duplicate_error", "edge_runs", "first_duplicate",
           "nonfinite", "nonfinite_error"]


def check_finite(points: np.ndarray, where: str, offset: int = 0) -> None:
    """Raise naming ``where`` if any coordinate is NaN or infinite (``offset``: input index of row 0)."""
    count, first, row = nonfinite(points, offset)
    if count:
        raise nonfinite_error(where, count, first, row)


def nonfinite(points: np.ndarray, offset: int = 0) -> tuple[int, int, list]:
    """``(count, input index of the first, its coordinates)`` of the points with a NaN/inf coordinate."""
    if not np.issubdtype(points.dtype, np.floating) or not len(points):
        return 0, -1, []
    bad = ~np.isfinite(points).all(axis=1)
    if not bad.any():
        return 0, -1, []
    first = int(np.argmax(bad))
    return int(bad.sum()), offset + first, points[first].tolist()


def nonfinite_error(where: str, count: int, first: int, row: list) -> DataPipeError:
    return DataPipeError(f"{where}: {count} point(s) have NaN or infinite coordinates, the first is input point "
                         f"{first} at {row}; fix or drop them before preparing (no prepared file was written)")


def duplicate_error(where: str, found: tuple[int, int, list]) -> DataPipeError:
    i, j, row = found
    return DataPipeError(
        f"{where}: input points {i} and {j} have the same coordinates {row}; cells on either side of such "
        "points share no node, so the mesh is cut there (e.g. .pvtu pieces that each repeat their shared "
        "nodes). Merge duplicate points first, or pass allow_duplicate_points=True (command line: "
        "--allow-duplicate-points) to keep them"
    )


def first_duplicate(keys: np.ndarray, points: np.ndarray, index: np.ndarray) -> tuple[int, int, list] | None:
    """Two input indices ``(i < j)`` of points with equal coordinates, and those coordinates, or None.

    ``keys`` are the rows' curve keys in ascending order, ``points`` and
    ``index`` (input positions) the same rows. Only rows in runs of equal keys
    are compared (sorted by run, then coordinates; adjacent rows tested).
    """
    n = len(keys)
    if n < 2:
        return None
    same = keys[1:] == keys[:-1]
    if not same.any():
        return None
    in_run = np.zeros(n, bool)
    in_run[1:] |= same
    in_run[:-1] |= same
    rows = np.flatnonzero(in_run)
    run = np.cumsum(np.r_[True, ~same])[rows]
    values = np.asarray(points[rows])
    order = np.lexsort((*values.T[::-1], run))  # primary: the run, then the coordinates
    values, run = values[order], run[order]
    equal = (run[1:] == run[:-1]) & (values[1:] == values[:-1]).all(axis=1)
    if not equal.any():
        return None
    k = int(np.argmax(equal))
    a, b = int(index[rows[order[k]]]), int(index[rows[order[k + 1]]])
    return min(a, b), max(a, b), values[k].tolist()


def edge_runs(keys: np.ndarray, points: np.ndarray, index: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The leading and trailing runs of equal keys (one run if all keys are equal) as ``(key, points, index)``."""
    if not len(keys):
        return []
    lead = int(np.searchsorted(keys, keys[0], side="right"))
    runs = [(int(keys[0]), np.asarray(points[:lead]), np.asarray(index[:lead]))]
    if lead < len(keys):
        trail = int(np.searchsorted(keys, keys[-1], side="left"))
        runs.append((int(keys[-1]), np.asarray(points[trail:]), np.asarray(index[trail:])))
    return runs


def across_edges(runs: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[int, int, list] | None:
    """A duplicate among runs of equal keys from consecutive blocks (or ranks), runs of one key merged."""
    by_key: dict[int, list] = {}
    for key, points, index in runs:
        by_key.setdefault(key, []).append((points, index))
    for key in sorted(by_key):
        parts = by_key[key]
        if len(parts) > 1:
            points = np.concatenate([p for p, _ in parts])
            index = np.concatenate([i for _, i in parts])
            found = first_duplicate(np.full(len(points), key, np.uint64), points, index)
            if found is not None:
                return found
    return None


class DuplicateScan:
    """:func:`first_duplicate` over consecutive blocks of key-sorted rows (the last run carried over)."""

    def __init__(self) -> None:
        self._carry: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, keys: np.ndarray, points: np.ndarray, index: np.ndarray) -> tuple[int, int, list] | None:
        if self._carry is not None and len(keys):
            keys, points, index = (np.concatenate([c, x]) for c, x in zip(self._carry, (keys, points, index)))
        if not len(keys):
            return None
        found = first_duplicate(keys, points, index)
        start = int(np.searchsorted(keys, keys[-1], side="left"))
        self._carry = (keys[start:], np.asarray(points[start:]), np.asarray(index[start:]))
        return found
