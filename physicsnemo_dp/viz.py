"""Pictures of layouts: which rank holds which box, with halos; point-cloud partitions.

matplotlib is imported only when a function here is called (it is an optional
dependency: ``pip install physicsnemo-dp[plot]``). Every function draws on a
given ``ax`` or creates a figure, and returns the ``Axes`` so notebooks can
compose them. All of them work on any single rank: a ShardTensor's spec knows
every shard's box without communicating.
"""

from __future__ import annotations

from typing import Sequence

from . import _layout

__all__ = ["rank_boxes", "plot_layout", "plot_boxes", "plot_point_partition"]


def rank_boxes(spec_or_tensor) -> list[dict]:
    """Every rank's box of a ShardTensor (or its spec), in mesh order.

    Each entry has ``coord`` (mesh coordinate), ``rank`` (global rank),
    ``start`` and ``shape`` (per tensor dim), ``partial`` (whether the rank
    holds a pending contribution rather than final values).
    """
    spec = getattr(spec_or_tensor, "_spec", spec_or_tensor)
    ranks = spec.mesh.mesh.flatten().tolist()
    partial = any(p.is_partial() for p in spec.placements)
    return [
        {
            "coord": tuple(coord),
            "rank": ranks[i],
            "start": spec.local_offsets(coord),
            "shape": spec.local_shape_at(coord),
            "partial": partial,
        }
        for i, coord in enumerate(_layout.all_coords(spec.mesh_shape))
    ]


def _axes(ax, figsize=(5, 4)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def plot_boxes(
    boxes: Sequence[dict],
    extent: Sequence[int],
    ax=None,
    halo: Sequence[int] | int = 0,
    title: str | None = None,
):
    """Draw rectangles ``{"rank", "start": (r, c), "shape": (h, w)}`` over a grid of ``extent`` (rows, cols).

    ``halo`` (per dim, or one int) draws each box's halo as a dashed outline,
    clipped at the global boundary. Empty boxes are listed in the legend.
    """
    from matplotlib.patches import Rectangle

    ax = _axes(ax)
    halo = (halo, halo) if isinstance(halo, int) else tuple(halo)
    cmap = __import__("matplotlib").colormaps["tab20"]
    rows, cols = extent
    empty = []
    for i, box in enumerate(boxes):
        (r0, c0), (h, w) = box["start"], box["shape"]
        if h == 0 or w == 0:
            empty.append(str(box["rank"]))
            continue
        color = cmap(i % 20)
        ax.add_patch(Rectangle((c0, r0), w, h, facecolor=color, edgecolor="k", alpha=0.55,
                               hatch="//" if box.get("partial") else None))
        ax.text(c0 + w / 2, r0 + h / 2, f"rank {box['rank']}\n{h}×{w}", ha="center", va="center", fontsize=8)
        if any(halo):
            hr0, hc0 = max(r0 - halo[0], 0), max(c0 - halo[1], 0)
            hr1, hc1 = min(r0 + h + halo[0], rows), min(c0 + w + halo[1], cols)
            ax.add_patch(Rectangle((hc0, hr0), hc1 - hc0, hr1 - hr0, fill=False, edgecolor=color,
                                   linestyle="--", linewidth=1.5))
    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)
    ax.set_aspect("equal" if rows and cols and max(rows, cols) / max(min(rows, cols), 1) < 8 else "auto")
    ax.set_xlabel("dim 1")
    ax.set_ylabel("dim 0")
    label = title or "layout"
    if empty:
        label += f"  (empty: rank {', '.join(empty)})"
    ax.set_title(label, fontsize=9)
    return ax


def plot_layout(tensor, dims: tuple[int, int] = (0, 1), ax=None, halo: Sequence[int] | int = 0, title=None):
    """Draw which rank holds which box of a ShardTensor, projected on two tensor dims.

    A 1-D tensor is drawn as one row. Partial layouts are hatched (each rank
    holds a contribution to the whole box).
    """
    spec = getattr(tensor, "_spec", tensor)
    shape = spec.global_shape
    if len(shape) == 1:
        dims, extent = (None, 0), (1, shape[0])
    else:
        extent = (shape[dims[0]], shape[dims[1]])
    boxes = []
    for box in rank_boxes(spec):
        if len(shape) == 1:
            start, size = (0, box["start"][0]), (1, box["shape"][0])
        else:
            start = (box["start"][dims[0]], box["start"][dims[1]])
            size = (box["shape"][dims[0]], box["shape"][dims[1]])
        boxes.append({**box, "start": start, "shape": size})
    placements = ", ".join(str(p) for p in spec.placements)
    return plot_boxes(boxes, extent, ax=ax, halo=halo, title=title or f"{tuple(shape)} as ({placements})")


def plot_point_partition(points, owner, ax=None, title: str = "point partition", max_points: int = 20000):
    """Scatter points (N, 2 or 3; the first two coordinates are drawn) coloured by owning rank."""
    import numpy as np

    ax = _axes(ax)
    points, owner = np.asarray(points), np.asarray(owner)
    if len(points) > max_points:
        keep = np.random.default_rng(0).choice(len(points), max_points, replace=False)
        points, owner = points[keep], owner[keep]
    scatter = ax.scatter(points[:, 0], points[:, 1], c=owner, s=2, cmap="tab20",
                         vmin=0, vmax=max(int(owner.max(initial=0)), 19))
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=9)
    ax.legend(*scatter.legend_elements(), title="rank", fontsize=7, loc="best")
    return ax
