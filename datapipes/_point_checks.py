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

from typing import Callable

import numpy as np

from .errors import DataPipeError

__all__ = ["DuplicateScan", "across_edges", "check_finite", "duplicate_error", "edge_runs", "first_duplicate",
           "nonfinite", "nonfinite_error", "run_rows"]


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


def run_rows(keys: np.ndarray) -> np.ndarray:
    """Positions of the rows of ascending ``keys`` that share their key with a neighbour (runs of two or more)."""
    if len(keys) < 2:
        return np.empty(0, np.int64)
    same = keys[1:] == keys[:-1]
    in_run = np.zeros(len(keys), bool)
    in_run[1:] |= same
    in_run[:-1] |= same
    return np.flatnonzero(in_run)


def first_duplicate(keys: np.ndarray, index: np.ndarray, points_of: Callable[[np.ndarray], np.ndarray]):
    """Two input indices ``(i < j)`` of points with equal coordinates, and those coordinates, or None.

    ``keys`` are the rows' curve keys in ascending order, ``index`` their
    input positions, ``points_of(rows)`` the coordinates of the rows at
    positions ``rows`` (only rows in runs of equal keys are asked for, so no
    copy of all points is made). Rows are sorted by run, then coordinates;
    adjacent rows are compared.
    """
    rows = run_rows(keys)
    if not len(rows):
        return None
    run = np.cumsum(np.r_[True, keys[1:] != keys[:-1]])[rows]
    values = np.asarray(points_of(rows))
    order = np.lexsort((*values.T[::-1], run))  # primary: the run, then the coordinates
    values, run = values[order], run[order]
    equal = (run[1:] == run[:-1]) & (values[1:] == values[:-1]).all(axis=1)
    if not equal.any():
        return None
    k = int(np.argmax(equal))
    a, b = int(index[rows[order[k]]]), int(index[rows[order[k + 1]]])
    return min(a, b), max(a, b), values[k].tolist()


Run = tuple  # (key, points, index): one run of equal keys


def edge_runs(keys: np.ndarray, index: np.ndarray, points_of) -> list[Run]:
    """The leading and trailing runs of equal keys (one run if all keys are equal)."""
    if not len(keys):
        return []
    lead = int(np.searchsorted(keys, keys[0], side="right"))
    runs = [(int(keys[0]), np.asarray(points_of(np.arange(lead))), np.asarray(index[:lead]))]
    if lead < len(keys):
        trail = int(np.searchsorted(keys, keys[-1], side="left"))
        runs.append((int(keys[-1]), np.asarray(points_of(np.arange(trail, len(keys)))), np.asarray(index[trail:])))
    return runs


def across_edges(runs: list[Run]):
    """A duplicate among runs of equal keys from consecutive blocks (or ranks), runs of one key merged."""
    by_key: dict[int, list] = {}
    for key, points, index in runs:
        by_key.setdefault(key, []).append((points, index))
    for key in sorted(by_key):
        parts = by_key[key]
        if len(parts) > 1:
            points = np.concatenate([p for p, _ in parts])
            index = np.concatenate([i for _, i in parts])
            found = first_duplicate(np.full(len(index), key, np.uint64), index, lambda rows: points[rows])
            if found is not None:
                return found
    return None


class DuplicateScan:
    """:func:`first_duplicate` over consecutive blocks of key-sorted rows: the trailing run of equal keys
    is carried into the next block (it may continue there)."""

    def __init__(self) -> None:
        self._carry: Run | None = None

    def add(self, keys: np.ndarray, index: np.ndarray, points_of):
        if not len(keys):
            return None
        found = first_duplicate(keys, index, points_of)
        runs = edge_runs(keys, index, points_of)
        carried = self._carry is not None and self._carry[0] == runs[0][0]
        if found is None and carried:
            found = across_edges([self._carry, runs[0]])
        if carried and len(runs) == 1:  # the whole block continues the carried run
            self._carry = (runs[0][0], *(np.concatenate([a, b]) for a, b in zip(self._carry[1:], runs[0][1:])))
        else:
            self._carry = runs[-1]
        return found
