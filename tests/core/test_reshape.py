"""Reshape analysis on uneven layouts, checked by simulating every rank's box (no processes)."""

import random
from itertools import product
from math import prod

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import _layout
from physicsnemo_dp._reshape import compatible_layout, nested_chunks, output_layout, rounded_table, view_groups


def _random_table(extent, shards, rng):
    cuts = sorted(rng.randint(0, extent) for _ in range(shards - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, extent]))


def _tables(shape, mesh_shape, placements, rng):
    out = []
    for d, extent in enumerate(shape):
        dims = _layout.sharding_mesh_dims(placements, d)
        out.append(_random_table(extent, prod(mesh_shape[m] for m in dims), rng) if dims else None)
    return tuple(out)


def _box(shape, mesh_shape, placements, tables, coord):
    local = _layout.local_shape_of(shape, mesh_shape, placements, tables, coord)
    offs = [_layout.local_offset_of(mesh_shape, placements, tables, coord, d) for d in range(len(shape))]
    return tuple(slice(o, o + n) for o, n in zip(offs, local)), local


def _assert_reshape_exact(in_shape, out_shape, mesh_shape, placements, tables):
    """Every rank's local piece, reshaped to its output local shape, is its output box."""
    out = output_layout(in_shape, out_shape, placements, tables)
    assert out is not None
    out_placements, out_tables = out
    _layout.validate_dim_sizes(out_shape, mesh_shape, out_placements, out_tables)
    assert [sum(t) for t in out_tables if t is not None] == [out_shape[d] for d, t in enumerate(out_tables) if t is not None]
    g = torch.arange(prod(in_shape)).reshape(in_shape)
    go = g.reshape(out_shape)
    for coord in product(*(range(n) for n in mesh_shape)):
        ibox, _ = _box(in_shape, mesh_shape, placements, tables, coord)
        obox, oshape = _box(out_shape, mesh_shape, out_placements, out_tables, coord)
        assert torch.equal(g[ibox].reshape(oshape), go[obox]), (in_shape, out_shape, placements, tables, coord)


@pytest.mark.parametrize(
    "a,b,groups",
    [
        ((7, 5, 3), (7, 15), (((0,), (0,)), ((1, 2), (1,)))),
        ((4, 3), (2, 6), (((0, 1), (0, 1)),)),
        ((1, 6), (6,), (((0,), ()), ((1,), (0,)))),
        ((6,), (2, 3, 1), (((0,), (0, 1)), ((), (2,)))),
        ((2, 1, 3), (6,), (((0, 1, 2), (0,)),)),
        ((1, 1, 5), (1, 5), (((0,), (0,)), ((1,), ()), ((2,), (1,)))),
        ((), (1, 1), (((), (0,)), ((), (1,)))),
    ],
)
def test_view_groups(a, b, groups):
    assert view_groups(a, b) == groups


CASES = [
    ((8, 3), (24,)), ((24,), (8, 3)), ((6, 4), (4, 6)), ((7, 5, 3), (7, 15)), ((7, 15), (7, 5, 3)),
    ((7, 5, 3), (105,)), ((2, 1, 6), (12, 1)), ((1, 6), (6,)), ((6,), (1, 6, 1)), ((4, 6), (2, 2, 3, 2)),
    ((3, 1), (3,)), ((12,), (2, 3, 2)), ((5, 4), (20,)), ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, 12)),
]


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (4,), (2, 2)])
def test_kept_or_moved_layouts_are_exact(mesh_shape):
    rng = random.Random(len(mesh_shape) * 10 + mesh_shape[0])
    kept = moved = 0
    for in_shape, out_shape in CASES:
        options = [Shard(d) for d in range(len(in_shape))] + [Replicate(), Partial()]
        for placements in product(options, repeat=len(mesh_shape)):
            for _ in range(6):
                tables = _tables(in_shape, mesh_shape, placements, rng)
                if output_layout(in_shape, out_shape, placements, tables) is not None:
                    kept += 1
                    _assert_reshape_exact(in_shape, out_shape, mesh_shape, placements, tables)
                    assert compatible_layout(in_shape, out_shape, placements, tables, mesh_shape) == (placements, tables)
                    continue
                moved += 1
                new_p, new_t = compatible_layout(in_shape, out_shape, placements, tables, mesh_shape)
                _layout.validate_dim_sizes(in_shape, mesh_shape, new_p, new_t)
                for d, t in enumerate(new_t):
                    assert t is None or sum(t) == in_shape[d]
                # Pending reductions and replicated mesh dims never change.
                assert all(q == p for p, q in zip(placements, new_p) if not p.is_shard())
                _assert_reshape_exact(in_shape, out_shape, mesh_shape, new_p, new_t)
    assert kept and (moved or mesh_shape == (1,))


def test_merge_keeps_outermost_shard_and_scales_sizes():
    p, t = output_layout((7, 5, 3), (7, 15), (Shard(1),), (None, (2, 0, 3), None))
    assert p == (Shard(1),) and t == (None, (6, 0, 9))
    p, t = output_layout((7, 5, 3), (105,), (Shard(0),), ((4, 0, 3), None, None))
    assert p == (Shard(0),) and t == ((60, 0, 45),)


def test_split_keeps_when_divisible_else_rebalances_in_units():
    assert output_layout((12,), (4, 3), (Shard(0),), ((6, 0, 6),)) == ((Shard(0),), ((2, 0, 2), None))
    assert output_layout((12,), (4, 3), (Shard(0),), ((5, 1, 6),)) is None
    # the only head is dim 0 itself: each shard boundary moves to the nearest whole row of 3
    assert compatible_layout((12,), (4, 3), (Shard(0),), ((5, 1, 6),), (3,)) == ((Shard(0),), ((6, 0, 6),))


def test_windows_cut_by_shards_stay_on_their_dim_and_move_only_cut_rows():
    """Swin's window_partition view (B, H, W, C) -> (B, H // ws, ws, W // ws, ws, C) on H shards that cut
    windows: H stays sharded (not the 8 channels, which have more units) and each boundary moves to the
    nearest window edge, fewer than ws / 2 rows per boundary, whatever the number of shards."""
    in_shape, out_shape = (1, 44, 12, 8), (1, 11, 4, 3, 4, 8)
    for tables, want in [
        ((22, 22), (24, 20)),
        ((15, 15, 14), (16, 16, 12)),
        ((11, 11, 11, 11), (12, 12, 8, 12)),
        ((0, 13, 0, 31), (0, 12, 0, 32)),
    ]:
        placements = (Shard(1),)
        got = compatible_layout(in_shape, out_shape, placements, (None, tables, None, None), (len(tables),))
        assert got == (placements, (None, want, None, None))
        windows = tuple(w // 4 for w in want)
        assert output_layout(in_shape, out_shape, *got) == ((Shard(1),), (None, windows, None, None, None, None))
    # nested over a 2x2 mesh: the flat table is rounded the same way
    got = compatible_layout(in_shape, out_shape, (Shard(1), Shard(1)), (None, (11, 11, 11, 11), None, None), (2, 2))
    assert got == ((Shard(1), Shard(1)), (None, (12, 12, 8, 12), None, None))
    # fewer windows than shards: still on H when no other head keeps more shards busy than H does
    assert rounded_table((3, 3, 3, 3), 4) == (4, 4, 0, 4)


def test_inner_shard_moves_to_largest_head_or_replicates():
    # dim 2 is inner in group (5, 3) -> 15: moves to the largest head (dim 0, 7 rows)
    assert compatible_layout((7, 5, 3), (7, 15), (Shard(2),), (None, None, (1, 1, 1)), (3,)) == (
        (Shard(0),), ((3, 3, 1), None, None)
    )
    # (2, 3) -> (6) sharded on the inner dim: the head (2 rows) takes it
    assert compatible_layout((2, 3), (6,), (Shard(1),), (None, (1, 2)), (2,)) == ((Shard(0),), ((1, 1), None))
    # a sharded size-1 dim that the view drops, and no other dim: gather
    assert compatible_layout((1,), (), (Shard(0),), ((0, 1),), (2,)) == ((Replicate(),), (None,))


def test_empty_tensors_drop_sharding():
    assert output_layout((0, 4), (4, 0), (Shard(1),), (None, (1, 3))) == ((Replicate(),), (None, None))


def test_nested_chunks():
    assert nested_chunks(7, [2, 2]) == (2, 2, 2, 1)
    assert nested_chunks(3, [4]) == (1, 1, 1, 0)
