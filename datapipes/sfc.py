"""Space-filling-curve keys: sort points so that contiguous ranges are compact in space.

A mesh whose points are sorted by these keys can be split into contiguous
index ranges, one per rank, and each range is a spatially compact piece of
the domain (few neighbours across partition boundaries). Hilbert order keeps
ranges more compact than Morton (Z) order, whose ranges can jump across the
domain; Morton is cheaper to compute.

Points are quantized on the smallest axis-aligned *cube* holding them (one
scale for every axis, so the curve does not stretch a long thin domain).
Everything is vectorized over points with numpy and returns ``uint64`` keys;
``bits * ndim`` must stay below 64.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CURVES", "bounding_cube", "curve_order", "hilbert_keys", "morton_keys", "quantize"]

DEFAULT_BITS = 16


def bounding_cube(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, float]:
    """``(corner, edge)`` of the cube :func:`quantize` uses for points with these per-axis bounds.

    A mesh read in pieces (on several ranks, or in chunks) reduces the
    pieces' minima and maxima first: min and max are exact, so the cube and
    hence every key equal those of the whole mesh in one array.
    """
    low = np.asarray(low, dtype=np.float64)
    return low, float((np.asarray(high, dtype=np.float64) - low).max()) or 1.0


def quantize(points: np.ndarray, bits: int = DEFAULT_BITS, cube: tuple[np.ndarray, float] | None = None) -> np.ndarray:
    """Integer cell coordinates in ``[0, 2**bits)`` of ``(n, ndim)`` points on their bounding cube.

    ``cube`` (from :func:`bounding_cube`) fixes the cube instead, for points
    that are a part of a larger mesh.
    """
    points = np.asarray(points, dtype=np.float64)
    if points.ndim != 2 or points.shape[1] < 1:
        raise ValueError(f"points must have shape (n, ndim), got {points.shape}")
    if not 1 <= bits or bits * points.shape[1] > 63:
        raise ValueError(f"bits={bits} with {points.shape[1]} dims does not fit a 64-bit key")
    if len(points) == 0:
        return np.zeros(points.shape, dtype=np.uint64)
    lo, extent = cube if cube is not None else bounding_cube(points.min(axis=0), points.max(axis=0))
    cells = np.floor((points - lo) / extent * (1 << bits))
    return np.clip(cells, 0, (1 << bits) - 1).astype(np.uint64)


def _interleave(axes: list[np.ndarray], bits: int) -> np.ndarray:
    """Key whose bits are, from the top, bit ``bits-1`` of every axis, then bit ``bits-2``, ..."""
    key = np.zeros(axes[0].shape, dtype=np.uint64)
    one = np.uint64(1)
    for bit in range(bits - 1, -1, -1):
        for x in axes:
            key = (key << one) | ((x >> np.uint64(bit)) & one)
    return key


def morton_keys(points: np.ndarray, bits: int = DEFAULT_BITS, cube=None) -> np.ndarray:
    """Morton (Z-order) key of each point: the interleaved bits of its cell coordinates."""
    cells = quantize(points, bits, cube)
    return _interleave([cells[:, i] for i in range(cells.shape[1])], bits)


def hilbert_keys(points: np.ndarray, bits: int = DEFAULT_BITS, cube=None) -> np.ndarray:
    """Hilbert key of each point (Skilling's transpose algorithm, any number of dims).

    J. Skilling, "Programming the Hilbert curve", AIP Conf. Proc. 707 (2004):
    the cell coordinates are turned into the curve's "transposed" index by
    bitwise exchanges and a Gray code, then the bits are interleaved.
    """
    cells = quantize(points, bits, cube)
    x = [cells[:, i].copy() for i in range(cells.shape[1])]
    n = len(x)
    q = 1 << (bits - 1)
    while q > 1:  # undo excess work: invert or exchange low bits, per axis
        p, bit = np.uint64(q - 1), np.uint64(q)
        for i in range(n):
            high = (x[i] & bit) != 0
            x[0] = np.where(high, x[0] ^ p, x[0])
            t = np.where(high, np.uint64(0), (x[0] ^ x[i]) & p)
            x[0] ^= t
            x[i] ^= t
        q >>= 1
    for i in range(1, n):  # Gray encode
        x[i] ^= x[i - 1]
    t = np.zeros_like(x[0])
    q = 1 << (bits - 1)
    while q > 1:
        t = np.where((x[n - 1] & np.uint64(q)) != 0, t ^ np.uint64(q - 1), t)
        q >>= 1
    for i in range(n):
        x[i] ^= t
    return _interleave(x, bits)


CURVES = {"hilbert": hilbert_keys, "morton": morton_keys}


def curve_order(points: np.ndarray, curve: str = "hilbert", bits: int = DEFAULT_BITS) -> np.ndarray:
    """Permutation that sorts ``points`` along the curve (stable for equal keys)."""
    if curve not in CURVES:
        raise ValueError(f"curve must be one of {sorted(CURVES)}, got {curve!r}")
    return np.argsort(CURVES[curve](points, bits), kind="stable")
