"""Pictures of layouts: which rank holds which box, with halos; halo exchanges; point-cloud partitions.

matplotlib is imported only when a function here is called (it is an optional
dependency: ``pip install physicsnemo-dp[plot]``). Every function draws on a
given ``ax`` or creates a figure, and returns the ``Axes`` so notebooks can
compose them. All of them work on any single rank: a ShardTensor's spec knows
every shard's box without communicating.

A ShardTensor cannot leave its rank, so a function run by
:func:`physicsnemo_dp.launch` returns :func:`layout_of` (plain Python data)
and the notebook draws it: every plotting function that takes a tensor also
takes that summary.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Partial

import bisect
from typing import Sequence

from .. import _layout

__all__ = [
    "rank_boxes",
    "layout_of",
    "plot_layout",
    "plot_boxes",
    "field_piece",
    "plot_field_pieces",
    "halo_windows",
    "plot_halo_exchange",
    "plot_point_partition",
]


def rank_boxes(spec_or_tensor) -> list[dict]:
    """Every rank's box of a ShardTensor (or its spec), in mesh order.

    Each entry has ``coord`` (mesh coordinate), ``rank`` (global rank),
    ``start`` and ``shape`` (per tensor dim), ``partial`` (whether the rank
    holds a pending contribution rather than final values).
    """
    spec = getattr(spec_or_tensor, "_spec", spec_or_tensor)
    ranks = spec.mesh.mesh.flatten().tolist()
    partial = any(issubclass(type(p), Partial) for p in spec.placements)
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


def layout_of(spec_or_tensor) -> dict:
    """A picklable summary of a ShardTensor's layout: return it from a launched function to draw it.

    Keys: ``shape`` (global), ``placements`` (strings), ``mesh_shape``,
    ``mesh_dim_names`` and ``boxes`` (:func:`rank_boxes`).
    """
    spec = getattr(spec_or_tensor, "_spec", spec_or_tensor)
    return {
        "shape": tuple(spec.global_shape),
        "placements": tuple(str(p) for p in spec.placements),
        "mesh_shape": tuple(spec.mesh_shape),
        "mesh_dim_names": tuple(spec.mesh.mesh_dim_names or ()),
        "boxes": rank_boxes(spec),
    }


def _as_layout(tensor_or_layout) -> dict:
    return tensor_or_layout if isinstance(tensor_or_layout, dict) else layout_of(tensor_or_layout)


def _color(rank: int):
    """One colour per rank, the same in every picture."""
    return __import__("matplotlib").colormaps["tab10"](rank % 10)


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
    face: bool = True,
    dims: Sequence[int] = (0, 1),
):
    """Draw rectangles ``{"rank", "start": (r, c), "shape": (h, w)}`` over a grid of ``extent`` (rows, cols).

    ``halo`` (per dim, or one int) draws each box's halo as a dashed outline,
    clipped at the global boundary. Empty boxes are listed in the legend.
    ``face=False`` draws outlines only (over an image); ``dims`` names the
    tensor dims on the axes.
    """
    from matplotlib.patches import Rectangle

    ax = _axes(ax)
    halo = (halo, halo) if isinstance(halo, int) else tuple(halo)
    rows, cols = extent
    empty, drawn = [], {}
    for box in boxes:  # boxes several ranks share (replicated mesh dims) are drawn once
        (h, w) = box["shape"]
        if h == 0 or w == 0:
            empty.append(str(box["rank"]))
        else:
            drawn.setdefault((tuple(box["start"]), tuple(box["shape"])), []).append(box)
    for ((r0, c0), (h, w)), group in drawn.items():
        color = _color(group[0]["rank"])
        if face:
            ax.add_patch(Rectangle((c0, r0), w, h, facecolor=color, edgecolor="k", alpha=0.55,
                                   hatch="//" if group[0].get("partial") else None))
        else:
            ax.add_patch(Rectangle((c0, r0), w, h, fill=False, edgecolor="w", linewidth=2))
        ranks = ", ".join(str(b["rank"]) for b in group)
        ax.text(c0 + w / 2, r0 + h / 2, f"rank{'s' if len(group) > 1 else ''} {ranks}\n{h}×{w}", ha="center",
                va="center", fontsize=8, bbox=None if face else {"facecolor": "w", "alpha": 0.7, "linewidth": 0})
        if any(halo):
            hr0, hc0 = max(r0 - halo[0], 0), max(c0 - halo[1], 0)
            hr1, hc1 = min(r0 + h + halo[0], rows), min(c0 + w + halo[1], cols)
            ax.add_patch(Rectangle((hc0, hr0), hc1 - hc0, hr1 - hr0, fill=False, edgecolor=color,
                                   linestyle="--", linewidth=1.5))
    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)
    ax.set_aspect("equal" if rows and cols and max(rows, cols) / max(min(rows, cols), 1) < 8 else "auto")
    ax.set_xlabel(f"dim {dims[1]}")
    ax.set_ylabel("" if dims[0] is None else f"dim {dims[0]}")
    label = title or "layout"
    if empty:
        label += f"  (empty: rank {', '.join(empty)})"
    ax.set_title(label, fontsize=9)
    return ax


def _boxes_2d(layout: dict, dims: tuple[int, int]) -> tuple[list[dict], tuple[int, int]]:
    """The layout's boxes projected on two tensor dims (a 1-D tensor is one row)."""
    shape = layout["shape"]
    if len(shape) == 1:
        return [{**b, "start": (0, b["start"][0]), "shape": (1, b["shape"][0])} for b in layout["boxes"]], (1, shape[0])
    boxes = [
        {**b, "start": (b["start"][dims[0]], b["start"][dims[1]]), "shape": (b["shape"][dims[0]], b["shape"][dims[1]])}
        for b in layout["boxes"]
    ]
    return boxes, (shape[dims[0]], shape[dims[1]])


def plot_layout(tensor, dims: tuple[int, int] = (0, 1), ax=None, halo: Sequence[int] | int = 0, title=None):
    """Draw which rank holds which box of a ShardTensor (its spec, or :func:`layout_of`), on two tensor dims.

    A 1-D tensor is drawn as one row. Partial layouts are hatched (each rank
    holds a contribution to the whole box).
    """
    layout = _as_layout(tensor)
    boxes, extent = _boxes_2d(layout, dims)
    placements = ", ".join(layout["placements"])
    return plot_boxes(boxes, extent, ax=ax, halo=halo, title=title or f"{tuple(layout['shape'])} as ({placements})",
                      dims=dims if len(layout["shape"]) > 1 else (None, 0))


def field_piece(tensor, dims: tuple[int, int] = (-2, -1)) -> tuple[dict, object]:
    """This rank's box and local values of a ShardTensor on two dims, for :func:`plot_field_pieces`.

    Other dims are indexed at 0 (of the local tensor: keep them unsharded).
    Return it from a launched function with ``return_all=True``; the ranks'
    pieces tile the field.
    """
    spec = tensor._spec
    d0, d1 = (d % tensor.ndim for d in dims)
    box = next(b for b in rank_boxes(spec) if b["coord"] == spec.coordinate)
    local = tensor.to_local().detach()
    if any(local.shape[d] == 0 for d in range(tensor.ndim) if d not in (d0, d1)):
        values = local.new_zeros(0, 0)
    else:
        values = local[tuple(slice(None) if d in (d0, d1) else 0 for d in range(tensor.ndim))]
        values = values if d0 < d1 else values.T
    start, shape = (box["start"][d0], box["start"][d1]), (box["shape"][d0], box["shape"][d1])
    return {**box, "start": start, "shape": shape}, values.cpu().numpy()


def plot_field_pieces(pieces: Sequence[tuple[dict, object]], extent: Sequence[int], ax=None, title=None,
                      cmap: str = "viridis"):
    """Draw each rank's local 2-D data where it sits in the global grid, outlined and labelled by rank.

    ``pieces`` are ``(box, array)`` pairs as :func:`field_piece` returns them
    (a box has ``rank``, ``start`` and ``shape`` on the two drawn dims); all
    pieces share one colour scale. Use it to check a decomposition by eye:
    the pieces must tile the field without seams.
    """
    import numpy as np
    from matplotlib.colors import Normalize

    ax = _axes(ax)
    arrays = [np.asarray(a, dtype=float) for _, a in pieces]
    filled = [a for a in arrays if a.size]
    norm = Normalize(min(a.min() for a in filled), max(a.max() for a in filled)) if filled else None
    for (box, _), a in zip(pieces, arrays):
        (r0, c0), (h, w) = box["start"], box["shape"]
        if a.size:
            ax.imshow(a, extent=(c0, c0 + w, r0 + h, r0), cmap=cmap, norm=norm, interpolation="nearest")
    ax = plot_boxes([{**box, "partial": False} for box, _ in pieces], extent, ax=ax, title=title or "local pieces",
                    face=False)
    return ax


def halo_windows(sizes: Sequence[int], left: int, right: int, mode: str = "zeros") -> list[dict]:
    """What a halo exchange of widths ``(left, right)`` gives each shard of a dim split into ``sizes``.

    One entry per shard (coordinate ``r`` along the mesh dim): ``start``/``size`` of its rows,
    ``rows`` (the global row read at each window position, ``None`` for a
    fill value), ``owners`` (the rank owning each of those rows) and
    ``received`` (``{source rank: number of distinct rows}``, exactly the
    message sizes the exchange uses, see :mod:`physicsnemo_dp.spatial.halo`).
    Shards thinner than the halo read from ranks further away; empty shards
    own nothing and are skipped as sources.
    """
    from ..spatial._halo_plan import plan_dim, source_rows
    from ..split import offsets_from_sizes

    sizes = tuple(int(n) for n in sizes)
    starts = offsets_from_sizes(sizes)
    ends = [s + n for s, n in zip(starts, sizes)]
    windows = tuple((s - left, s + n + right) for s, n in zip(starts, sizes))
    out = []
    for r, (lo, hi) in enumerate(windows):
        rows = [None if i < 0 else i for i in source_rows(lo, hi, sum(sizes), mode).tolist()]
        owners = [None if i is None else bisect.bisect_right(ends, i) for i in rows]
        plan = plan_dim(sizes, windows, r, mode, 0, 0)
        received = {src: n for src, n in enumerate(plan.recv_splits) if n}
        out.append({"rank": r, "start": starts[r], "size": sizes[r], "window": (lo, hi), "rows": rows,
                    "owners": owners, "received": received})
    return out


def plot_halo_exchange(sizes: Sequence[int], left: int, right: int | None = None, mode: str = "zeros", ax=None,
                       title=None):
    """Draw a halo exchange along one sharded dim: which rows each rank receives from whom.

    Global rows run down the picture (as dim 0 of :func:`plot_layout`); each
    rank is a column showing its window: its own rows solid, received rows
    in the owner's colour with an arrow from the owner's column, rows a
    boundary mode copies from the rank itself pale without an arrow, and
    fill values (``zeros``/``constant`` mode) grey. Returns the ``Axes``.
    """
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    right = left if right is None else right
    windows = halo_windows(sizes, left, right, mode)
    ax = _axes(ax, figsize=(1.4 * len(windows) + 1.5, 4))
    for w in windows:
        r, x = w["rank"], w["rank"] * 1.6
        for pos, (row, owner) in enumerate(zip(w["rows"], w["owners"]), start=w["window"][0]):
            own = owner == r and w["start"] <= pos < w["start"] + w["size"]
            if row is None:
                ax.add_patch(Rectangle((x, pos), 1, 1, facecolor="0.9", edgecolor="0.5", hatch="xx"))
                continue
            ax.add_patch(Rectangle((x, pos), 1, 1, facecolor=_color(owner), edgecolor="k",
                                   alpha=0.8 if own else 0.35, linewidth=0.5))
            ax.text(x + 0.5, pos + 0.5, str(row), ha="center", va="center", fontsize=7)
            if owner != r:  # rows a rank reads from itself (reflect, replicate, circular) are copied locally
                ax.annotate("", xy=(x + (0 if owner < r else 1), pos + 0.5),
                            xytext=(owner * 1.6 + (1 if owner < r else 0), row + 0.5),
                            arrowprops={"arrowstyle": "->", "color": _color(owner), "lw": 1.2})
    labels = [
        f"rank {w['rank']}: {w['size']} rows\n" + ("\n".join(f"{n} from rank {s}" for s, n in w["received"].items())
                                                 or "receives nothing")
        for w in windows
    ]
    lo = min(min(w["window"][0] for w in windows), 0)
    hi = max(max(w["window"][1] for w in windows), sum(sizes))
    ax.set_xlim(-0.3, 1.6 * len(windows))
    ax.set_ylim(hi + 0.2, lo - 0.2)
    ax.xaxis.tick_top()
    ax.set_xticks([1.6 * w["rank"] + 0.5 for w in windows], labels, fontsize=7)
    ax.tick_params(axis="x", length=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("global row (numbers: row each window position reads)")
    ax.set_title(title or f"halo ({left}, {right}), {mode} boundary, shards {tuple(sizes)}", fontsize=9)
    return ax


def plot_point_partition(points, owner, ax=None, title: str = "point partition", max_points: int = 20000):
    """Scatter points (N, 2 or 3; the first two coordinates are drawn) coloured by owning rank."""
    import numpy as np
    from matplotlib.lines import Line2D

    ax = _axes(ax)
    points, owner = np.asarray(points), np.asarray(owner)
    if len(points) > max_points:
        keep = np.random.default_rng(0).choice(len(points), max_points, replace=False)
        points, owner = points[keep], owner[keep]
    ax.scatter(points[:, 0], points[:, 1], c=[_color(int(r)) for r in owner], s=2)
    handles = [Line2D([], [], marker="o", linestyle="", color=_color(int(r))) for r in np.unique(owner)]
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=9)
    ax.legend(handles, [str(r) for r in np.unique(owner)], title="rank", fontsize=7, loc="best")
    return ax
