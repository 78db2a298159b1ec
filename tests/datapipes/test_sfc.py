"""Space-filling-curve keys (pure, one process)."""

from __future__ import annotations

import numpy as np
import pytest

from datapipes.sfc import curve_order, hilbert_keys, morton_keys


def _grid(ndim: int, bits: int) -> np.ndarray:
    axes = np.meshgrid(*[np.arange(2**bits)] * ndim, indexing="ij")
    return np.stack(axes, -1).reshape(-1, ndim).astype(float)


@pytest.mark.parametrize("ndim,bits", [(2, 1), (2, 4), (3, 3)])
def test_hilbert_visits_every_cell_once_moving_to_a_neighbour_each_step(ndim, bits):
    cells = _grid(ndim, bits)
    keys = hilbert_keys(cells, bits)
    assert sorted(keys.tolist()) == list(range(len(cells)))
    path = cells[np.argsort(keys)]
    assert (np.abs(np.diff(path, axis=0)).sum(axis=1) == 1).all()


def test_morton_is_the_bit_interleaving():
    cells = np.array([[0, 0], [0, 1], [1, 0], [1, 1], [2, 3]], dtype=float)
    # x bits come first at each level: key = x1 y1 x0 y0
    assert morton_keys(cells, bits=2).tolist() == [0, 1, 2, 3, 0b1101]


def _volume(points: np.ndarray) -> float:
    """Volume of the bounding box."""
    return float((points.max(0) - points.min(0)).prod())


@pytest.mark.parametrize("curve", ["hilbert", "morton"])
def test_contiguous_ranges_of_the_order_are_compact(curve):
    rng = np.random.default_rng(0)
    points = rng.random((4000, 3))
    ordered = points[curve_order(points, curve)]
    curve_extent = np.mean([_volume(r) for r in np.array_split(ordered, 16)])
    random_extent = np.mean([_volume(r) for r in np.array_split(points, 16)])
    assert curve_extent < 0.35 * random_extent


def test_bad_arguments():
    with pytest.raises(ValueError, match="curve"):
        curve_order(np.zeros((3, 2)), "peano")
    with pytest.raises(ValueError, match="64-bit"):
        hilbert_keys(np.zeros((3, 3)), bits=22)
