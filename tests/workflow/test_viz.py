"""Layout pictures render (Agg) and show the right boxes for a 3-rank uneven case."""

import matplotlib

matplotlib.use("Agg")

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from physicsnemo_dp import ShardTensorSpec
from physicsnemo_dp.viz import plot_layout, plot_point_partition, rank_boxes
from tests._harness import distributed


@distributed(world_sizes=(3,), mesh_2d=False)
def test_three_rank_uneven_boxes_and_png(ctx, tmp_path):
    spec = ShardTensorSpec.from_sizes(ctx.mesh, [Shard(0)], (9, 4), torch.float32, ((5, 0, 4), None))
    boxes = rank_boxes(spec)
    assert [(b["rank"], b["start"], b["shape"]) for b in boxes] == [
        (0, (0, 0), (5, 4)), (1, (5, 0), (0, 4)), (2, (5, 0), (4, 4))
    ]
    ax = plot_layout(spec, halo=1)
    patches = [p for p in ax.patches if p.get_fill()]
    assert [(p.get_y(), p.get_height()) for p in patches] == [(0, 5), (5, 4)]  # rank 1 is empty
    assert "empty: rank 1" in ax.get_title()
    if ctx.rank == 0:
        path = tmp_path / "layout.png"
        ax.figure.savefig(path)
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


@distributed(world_sizes=(), mesh_2d=True)
def test_2d_mesh_and_partial_layouts(ctx):
    spec = ShardTensorSpec.chunked(ctx.mesh, [Shard(0), Shard(1)], (5, 7), torch.float32)
    assert len(rank_boxes(spec)) == 4
    partial = ShardTensorSpec.chunked(ctx.mesh, [Partial(), Shard(1)], (5, 7), torch.float32)
    ax = plot_layout(partial)
    assert all(b["partial"] for b in rank_boxes(partial))
    assert any(p.get_hatch() for p in ax.patches)


def test_point_partition_plot():
    import numpy as np

    pts = np.random.default_rng(0).random((300, 3))
    ax = plot_point_partition(pts, (pts[:, 0] * 3).astype(int))
    assert len(ax.collections) == 1
