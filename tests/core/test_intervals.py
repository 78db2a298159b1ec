"""Interval arithmetic for slicing and joining along a sharded dim (no processes)."""

import random

import pytest
import torch

from physicsnemo_dp._intervals import intersect, normalize_slice, owner, scatter_table, slice_table, tiles
from physicsnemo_dp.split import offsets_from_sizes


def _random_table(extent, shards, rng):
    cuts = sorted(rng.randint(0, extent) for _ in range(shards - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, extent]))


@pytest.mark.parametrize("size", [0, 1, 5, 9])
def test_normalize_slice_matches_torch(size):
    t = torch.arange(size)
    for start in (None, -12, -3, -1, 0, 2, 7, 20):
        for end in (None, -12, -2, 0, 3, 9, 20):
            for step in (1, 2, 3):
                s, e, st = normalize_slice(size, start, end, step)
                assert torch.equal(t[s:e:st], t[start:end:step])


def test_normalize_slice_rejects_non_positive_step():
    with pytest.raises(ValueError, match="positive"):
        normalize_slice(5, 0, 3, 0)


def test_slice_table_is_each_shards_part():
    rng = random.Random(0)
    for _ in range(300):
        size, shards = rng.randint(0, 12), rng.randint(1, 5)
        table = _random_table(size, shards, rng)
        start, end, step = normalize_slice(size, rng.randint(-14, 14), rng.randint(-14, 14), rng.randint(1, 4))
        g = torch.arange(size)
        expected = g[start:end:step]
        pieces = []
        for (first, count), off, n in zip(slice_table(table, start, end, step), offsets_from_sizes(table), table):
            local = g[off : off + n]
            pieces.append(local[first : first + (count - 1) * step + 1 : step] if count else local[:0])
            assert len(pieces[-1]) == count
        assert torch.equal(torch.cat(pieces), expected)


def test_owner_and_intersect():
    table = (2, 0, 3, 1)
    assert [owner(table, i) for i in range(6)] == [0, 0, 2, 2, 2, 3]
    with pytest.raises(IndexError):
        owner(table, 6)
    assert intersect(table, 1, 5) == (1, 0, 3, 0)
    assert intersect(table, 3, 3) == (0, 0, 0, 0)


def test_tiles_accepts_pieces_in_rank_order():
    # two slices of one tensor with slabs (2, 0, 3, 1), cut at 3
    assert tiles([(2, 0, 1, 0), (0, 0, 2, 1)], 4) == ((2, 0, 1, 0), (0, 0, 2, 1))
    # a whole piece goes to the shard before it, or the first shard with data when it leads
    assert tiles([4, (0, 2, 1, 0), 5], 4) == ((0, 4, 0, 0), (0, 2, 1, 0), (0, 0, 5, 0))
    # going back to an earlier shard is not free
    assert tiles([(1, 1, 0, 0), (1, 0, 0, 0)], 4) is None
    assert tiles([(0, 0, 0, 0), 3], 4) == ((0, 0, 0, 0), (3, 0, 0, 0))


def test_scatter_table_covers_every_gradient_entry():
    rng = random.Random(1)
    for _ in range(300):
        size, shards = rng.randint(0, 12), rng.randint(1, 5)
        start, end, step = normalize_slice(size, rng.randint(-14, 14), rng.randint(-14, 14), rng.randint(1, 4))
        count = len(range(start, end, step))
        grad_table = _random_table(count, shards, rng)
        result = scatter_table(grad_table, size, start, step)
        if count == 0:
            assert result is None
            continue
        table, starts = result
        assert sum(table) == size
        # rank k's entries sit inside its slab, at starts[k], every step
        for k, (off, n, g_off, g) in enumerate(zip(offsets_from_sizes(table), table, offsets_from_sizes(grad_table), grad_table)):
            if g:
                first = off + starts[k]
                assert first == start + step * g_off and first + (g - 1) * step < off + n
    # the zeros are spread like the split rule's slabs where the entries allow: the gradient of the
    # low modes [0, 12) held by shard 0 of 4 does not make shard 0 hold all 129 columns
    assert scatter_table((12, 0, 0, 0), 129, 0, 1) == ((33, 33, 33, 30), (0, 0, 0, 0))
    # a boundary moves only as far as the entries need: shard 1 holds 40, 50, 60 and shard 2 70, 80, 90,
    # so the split rule's boundaries 25 | 50 | 75 become 25 | 61 | 91
    assert scatter_table((0, 3, 3, 0), 100, 40, 10) == ((25, 36, 30, 9), (0, 15, 9, 0))
