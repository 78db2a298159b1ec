"""Layout pictures render (Agg) and show the right boxes for a 3-rank uneven case."""

import matplotlib

matplotlib.use("Agg")

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from physicsnemo_dp import ShardTensorSpec
from physicsnemo_dp.debug.viz import plot_layout, plot_point_partition, rank_boxes
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


def test_halo_windows_name_rows_owners_and_messages():
    from physicsnemo_dp.debug.viz import halo_windows

    zero, empty, last = halo_windows((5, 0, 4), 1, 1)
    assert zero["rows"] == [None, 0, 1, 2, 3, 4, 5] and zero["owners"][-1] == 2 and zero["received"] == {2: 1}
    assert empty["rows"] == [4, 5] and empty["received"] == {0: 1, 2: 1}  # an empty shard still has a window
    assert last["rows"][-1] is None and last["received"] == {0: 1}
    thin = halo_windows((7, 1, 6), 2, 2)  # rank 1 is thinner than the halo: rank 0 reads rank 2's row 8
    assert thin[0]["rows"][-2:] == [7, 8] and thin[0]["owners"][-2:] == [1, 2]
    assert [w["received"] for w in thin] == [{1: 1, 2: 1}, {0: 2, 2: 2}, {0: 1, 1: 1}]
    circular = halo_windows((3, 1, 4), 2, 2, "circular")
    assert circular[0]["rows"][:2] == [6, 7] and circular[0]["received"] == {1: 1, 2: 3}


@distributed(world_sizes=(3,), mesh_2d=False)
def test_halo_windows_match_the_exchange(ctx):
    from physicsnemo_dp import ShardTensor, count_collectives
    from physicsnemo_dp.spatial import halo_exchange
    from physicsnemo_dp.debug.viz import halo_windows

    for sizes, (left, right), mode in [((5, 0, 4), (1, 1), "zeros"), ((7, 1, 6), (2, 2), "zeros"),
                                       ((3, 1, 4), (2, 1), "circular"), ((2, 4, 3), (2, 2), "reflect")]:
        full = torch.arange(sum(sizes) * 3, dtype=torch.float64).reshape(sum(sizes), 3)
        start = sum(sizes[: ctx.rank])
        x = ShardTensor.from_local(full[start : start + sizes[ctx.rank]], ctx.mesh, [Shard(0)],
                                   sharding_shapes={0: [(n, 3) for n in sizes]})
        with count_collectives() as c:
            window = halo_exchange(x, {0: (left, right)}, mode)
        mine = halo_windows(sizes, left, right, mode)[ctx.rank]
        expected = torch.stack([full[r] if r is not None else torch.zeros(3, dtype=full.dtype) for r in mine["rows"]])
        assert torch.equal(window, expected), (sizes, mode)
        assert c.bytes_received.get("halo", 0) == sum(mine["received"].values()) * 3 * 8, (sizes, mode)


def test_halo_exchange_picture_has_one_cell_per_window_position(tmp_path):
    from physicsnemo_dp.debug.viz import halo_windows, plot_halo_exchange

    ax = plot_halo_exchange((7, 1, 6), 2)
    assert len(ax.patches) == sum(len(w["rows"]) for w in halo_windows((7, 1, 6), 2, 2))
    assert "1 from rank 2" in ax.get_xticklabels()[0].get_text()
    ax.figure.savefig(tmp_path / "halo.png")
    assert (tmp_path / "halo.png").read_bytes()[:4] == b"\x89PNG"


@distributed(world_sizes=(3,), mesh_2d=False)
def test_layout_summary_pickles_and_draws_like_the_spec(ctx):
    import pickle

    from torch.distributed.tensor.placement_types import Replicate

    from physicsnemo_dp.debug.viz import layout_of

    spec = ShardTensorSpec.from_sizes(ctx.mesh, [Shard(0)], (9, 4), torch.float32, ((5, 0, 4), None))
    layout = pickle.loads(pickle.dumps(layout_of(spec)))
    assert layout["shape"] == (9, 4) and layout["placements"] == ("S(0)",) and layout["mesh_shape"] == (3,)
    drawn = lambda ax: [(p.get_y(), p.get_height()) for p in ax.patches]  # noqa: E731
    assert drawn(plot_layout(layout)) == drawn(plot_layout(spec)) == [(0, 5), (5, 4)]
    replicated = plot_layout(ShardTensorSpec.chunked(ctx.mesh, [Replicate()], (9, 4), torch.float32))
    assert len(replicated.patches) == 1 and "ranks 0, 1, 2" in replicated.texts[0].get_text()


@distributed(world_sizes=(3,), mesh_2d=False)
def test_field_pieces_tile_the_field(ctx, tmp_path):
    from physicsnemo_dp import ShardTensor
    from physicsnemo_dp.debug.viz import field_piece, plot_field_pieces

    sizes = (4, 0, 3)
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(1, 7, 5)
    start = sum(sizes[: ctx.rank])
    x = ShardTensor.from_local(full[:, start : start + sizes[ctx.rank]], ctx.mesh, [Shard(1)])
    box, values = field_piece(x)
    assert box["start"] == (start, 0) and box["shape"] == (sizes[ctx.rank], 5)
    assert (values == full[0, start : start + sizes[ctx.rank]].numpy()).all()
    pieces = [None] * 3
    torch.distributed.all_gather_object(pieces, (box, values))
    ax = plot_field_pieces(pieces, (7, 5))
    assert len(ax.images) == 2 and "empty: rank 1" in ax.get_title()
    if ctx.rank == 0:
        ax.figure.savefig(tmp_path / "pieces.png")
        assert (tmp_path / "pieces.png").stat().st_size > 1000
