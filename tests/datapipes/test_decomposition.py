"""DomainDecomposition: boxes, halos, explicit sizes and errors (pure, one process)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from datapipes import DecompositionError, DomainDecomposition, balanced_sizes
from physicsnemo_dp import Shard


def _torch_chunk_sizes(n: int, parts: int) -> list[int]:
    pieces = list(torch.arange(n).chunk(parts))
    return [len(p) for p in pieces] + [0] * (parts - len(pieces))


@pytest.mark.parametrize("n,parts", [(6, 4), (9, 4), (10, 3), (7, 7), (64, 2), (5, 1)])
def test_split_rule_is_torch_chunk(n, parts):
    dec = DomainDecomposition((n, 3), (parts,))
    assert list(dec.sizes[0]) == _torch_chunk_sizes(n, parts)
    assert [dec.local_shape(r)[0] for r in range(parts)] == _torch_chunk_sizes(n, parts)


@pytest.mark.parametrize("mesh_shape,split_dims", [((3,), (1,)), ((2, 2), (0, 1)), ((2, 3), (2, 0))])
def test_boxes_tile_the_array_exactly_once(mesh_shape, split_dims):
    shape = (7, 9, 5)
    dec = DomainDecomposition(shape, mesh_shape, split_dims)
    hits = np.zeros(shape, dtype=int)
    for rank in range(dec.num_ranks):
        hits[dec.box(rank)] += 1
        assert dec.offsets(rank) == tuple(s.start for s in dec.box(rank))
    assert (hits == 1).all()


def test_rank_and_coordinate_follow_row_major_mesh_order():
    dec = DomainDecomposition((8, 8), (2, 3), (0, 1))
    assert dec.coordinates() == list(itertools.product(range(2), range(3)))
    assert dec.box(4) == dec.box((1, 1))
    with pytest.raises(IndexError):
        dec.box(6)


def test_halo_is_clipped_at_the_boundary_and_interior_sits_inside():
    dec = DomainDecomposition((10, 4), (3,), halo=2)
    assert dec.sizes == ((4, 4, 2),)
    assert [dec.box(r, halo=True)[0] for r in range(3)] == [slice(0, 6), slice(2, 10), slice(6, 10)]
    assert [dec.halo_widths(r)[0] for r in range(3)] == [(0, 2), (2, 2), (2, 0)]
    data = np.arange(40).reshape(10, 4)
    for r in range(3):
        padded = data[dec.box(r, halo=True)]
        assert np.array_equal(padded[dec.interior(r)], data[dec.box(r)])


def test_halo_per_mesh_dim():
    dec = DomainDecomposition((8, 8), (2, 2), (0, 1), halo=(1, 0))
    assert dec.local_shape((0, 1), halo=True) == (5, 4)


def test_explicit_sizes_replace_the_rule_and_feed_sharding_shapes():
    dec = DomainDecomposition((10, 6), (3,), sizes=[(5, 3, 2)])
    assert dec.sizes == ((5, 3, 2),)
    assert dec.box(1) == (slice(5, 8), slice(0, 6))
    assert dec.sharding_shapes(1, leading=(2,)) == {0: [(2, 5, 6), (2, 3, 6), (2, 2, 6)]}
    assert dec.placements(1) == (Shard(1),)
    mapped = DomainDecomposition((10, 6), (2, 2), (0, 1), sizes={1: (1, 5)})
    assert mapped.sizes == ((5, 5), (1, 5))
    assert mapped.sharding_shapes((1, 0)) == {0: [(5, 1), (5, 1)], 1: [(5, 1), (5, 5)]}


def test_accepts_a_device_mesh_like_object():
    class FakeMesh:
        shape = (2, 2)

        def get_coordinate(self):
            return (0, 0)

    assert DomainDecomposition((4, 4), FakeMesh()).mesh_shape == (2, 2)


def test_balanced_sizes_differ_by_at_most_one():
    assert balanced_sizes(10, 4) == (3, 3, 2, 2)
    assert balanced_sizes(3, 3) == (1, 1, 1)
    for n, p in itertools.product(range(0, 30), range(1, 7)):
        sizes = balanced_sizes(n, p)
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(global_shape=(3, 8), mesh_shape=(4,)), r"dim 0 has 3 cells, fewer than the 4 ranks"),
        (dict(global_shape=(9, 8), mesh_shape=(3,), halo=4), r"halo of 4 along dim 0 is wider than the shard"),
        (dict(global_shape=(6, 8), mesh_shape=(3,), sizes=[(3, 0, 3)], halo=1), r"rank 1 .*0 cells"),
        (dict(global_shape=(6, 8), mesh_shape=(2,), sizes=[(3, 2)]), r"adding up to 6"),
        (dict(global_shape=(6, 8), mesh_shape=(2, 2), split_dims=(0, 0)), r"several mesh dims"),
        (dict(global_shape=(6, 8), mesh_shape=(2,), split_dims=(2,)), r"out of range"),
        (dict(global_shape=(6, 8), mesh_shape=(2,), halo=-1), r"halo"),
    ],
)
def test_errors_name_the_array_and_the_problem(kwargs, match):
    with pytest.raises(DecompositionError, match=match) as info:
        DomainDecomposition(label="'p' in f.h5", **kwargs)
    assert "'p' in f.h5" in str(info.value)
    assert "global shape" in str(info.value)


def test_empty_trailing_shard_of_the_rule_is_allowed_with_a_halo():
    dec = DomainDecomposition((6, 2), (4,), halo=1)
    assert dec.sizes == ((2, 2, 2, 0),)
    assert dec.box(3, halo=True)[0] == slice(5, 6)  # only the halo row
    assert dec.local_shape(3) == (0, 2)
