"""SampleOrder: every ddp rank derives its samples from the shared seed (pure, one process)."""

from __future__ import annotations

import itertools

import pytest

from datapipes import SampleOrder


def _all_ranks(n, ddp, batch, drop_last, epoch, seed=0, shuffle=True):
    orders = [SampleOrder(n, batch, ddp, r, shuffle, seed, drop_last) for r in range(ddp)]
    return [o.batches(epoch) for o in orders], orders


@pytest.mark.parametrize("n,ddp,batch", list(itertools.product([1, 7, 12], [1, 2, 3], [1, 2, 4])))
def test_without_drop_last_each_epoch_is_a_partition(n, ddp, batch):
    for epoch in range(3):
        per_rank, orders = _all_ranks(n, ddp, batch, False, epoch)
        seen = [i for batches in per_rank for b in batches for i in b]
        assert sorted(seen) == list(range(n))
        assert all(len(b) <= batch for batches in per_rank for b in batches)
        assert [len(b) for b in per_rank] == [o.num_batches() for o in orders]


@pytest.mark.parametrize("n,ddp,batch", [(10, 3, 2), (12, 2, 4), (7, 2, 1), (9, 4, 2)])
def test_drop_last_gives_every_rank_the_same_full_batches(n, ddp, batch):
    per_rank, orders = _all_ranks(n, ddp, batch, True, epoch=1)
    counts = {len(b) for b in per_rank}
    assert counts == {n // (ddp * batch)}
    assert all(len(b) == batch for batches in per_rank for b in batches)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen))


def test_order_depends_on_seed_and_epoch_only():
    a = SampleOrder(50, seed=3)
    assert a.batches(0) == SampleOrder(50, seed=3).batches(0)
    assert a.batches(0) != a.batches(1)
    assert a.batches(0) != SampleOrder(50, seed=4).batches(0)
    assert SampleOrder(5, shuffle=False).batches(7) == [(0,), (1,), (2,), (3,), (4,)]


def test_drop_last_that_leaves_nothing_is_an_error():
    with pytest.raises(ValueError, match="leaves no full batch"):
        SampleOrder(3, batch_size=2, ddp_size=2, drop_last=True)
