"""Redistribution planning is pure: which collective handles each mesh dim, and in what order."""

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp._layout import chunk_dim_sizes
from physicsnemo_dp._plan import Layout, default_dst_sizes, marginal, plan


def layout(placements, shape, mesh_shape, sizes=None):
    return Layout(tuple(placements), sizes if sizes is not None else chunk_dim_sizes(shape, mesh_shape, placements))


def kinds(src, dst, mesh_shape):
    return [(s.kind, s.mesh_dim) for s in plan(src, dst, mesh_shape)]


def test_no_op_plan_is_empty():
    a = layout([Shard(0)], (7, 5), (3,), ((4, 0, 3), None))
    assert plan(a, a, (3,)) == []


@pytest.mark.parametrize(
    "src,dst,expected",
    [
        ([Shard(0)], [Replicate()], [("gather", 0)]),
        ([Shard(0)], [Shard(1)], [("all_to_all", 0)]),
        ([Partial()], [Shard(0)], [("reduce_scatter", 0)]),
        ([Partial()], [Replicate()], [("all_reduce", 0)]),
        ([Replicate()], [Shard(1)], [("slice", 0)]),
        ([Replicate()], [Partial()], [("partition", 0)]),
        ([Shard(0)], [Partial()], [("pad", 0)]),
        ([Partial("sum")], [Partial("max")], [("all_reduce", 0), ("partition", 0)]),
    ],
)
def test_one_collective_per_transition(src, dst, expected):
    shape, mesh = (7, 5), (3,)
    assert kinds(layout(src, shape, mesh), layout(dst, shape, mesh), mesh) == expected


def test_rebalance_is_one_all_to_all():
    src = layout([Shard(0)], (7, 5), (3,), ((4, 0, 3), None))
    dst = layout([Shard(0)], (7, 5), (3,))
    assert kinds(src, dst, (3,)) == [("rebalance", 0)]


def test_nested_sharding_unshards_inner_first_and_reshards_outer_first():
    shape, mesh = (9, 4), (2, 2)
    src = layout([Shard(0), Shard(0)], shape, mesh)
    dst = layout([Shard(1), Shard(0)], shape, mesh)
    steps = kinds(src, dst, mesh)
    assert steps == [("gather", 1), ("gather", 0), ("slice", 0), ("slice", 1)]


def test_2d_mixed_transition_keeps_untouched_dim():
    shape, mesh = (6, 5), (2, 2)
    src = layout([Shard(0), Shard(1)], shape, mesh)
    dst = layout([Shard(0), Replicate()], shape, mesh)
    assert kinds(src, dst, mesh) == [("gather", 1)]


def test_default_sizes_keep_existing_sharding_and_chunk_new():
    src = Layout((Shard(0),), ((4, 0, 3), None))
    assert default_dst_sizes(src, (Shard(0),), (7, 5), (3,)) == ((4, 0, 3), None)
    assert default_dst_sizes(src, (Shard(1),), (7, 5), (3,)) == (None, (2, 2, 1))
    src2 = Layout((Shard(0), Replicate()), ((4, 3), None))
    assert default_dst_sizes(src2, (Shard(0), Shard(0)), (7, 5), (2, 2)) == ((2, 2, 2, 1), None)


def test_marginal():
    # table over mesh dims (0, 1) of a (2, 3) mesh
    table = (1, 2, 3, 4, 5, 6)
    assert marginal(table, (0, 1), (2, 3), (0,)) == (6, 15)
    assert marginal(table, (0, 1), (2, 3), (1,)) == (5, 7, 9)
    assert marginal(table, (0, 1), (2, 3), ()) is None
