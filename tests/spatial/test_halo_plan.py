"""The halo plan and the window geometry, checked without processes.

A simulated exchange runs every rank's plan on slices of one global tensor
and compares each window with the padded global tensor, for random shard
sizes (thin and empty shards included) and every boundary mode.
"""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_dp.spatial import _geometry
from physicsnemo_dp.spatial._halo_plan import plan_dim
from physicsnemo_dp.split import offsets_from_sizes

MODES = ["zeros", "replicate", "reflect", "circular"]


def _random_sizes(rng, total, parts):
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


def _simulate(sizes, windows, mode, value=0.0):
    """Every rank's window built from its plan, with the all-to-all done by hand."""
    extent = sum(sizes)
    data = torch.arange(1.0, extent + 1)
    starts = offsets_from_sizes(sizes)
    plans = [plan_dim(sizes, windows, r, mode, 0, 0) for r in range(len(sizes))]
    locals_ = [data[s : s + n] for s, n in zip(starts, sizes)]
    sent = []
    for r, p in enumerate(plans):
        sent.append(locals_[r][p.send_index].split(list(p.send_splits)))
        # the peer lists are the dense tables' non-zero entries, in group order, never this rank
        assert p.send_peers == tuple((q, n) for q, n in enumerate(p.send_splits) if n) and p.send_splits[r] == 0
        assert p.recv_peers == tuple((q, n) for q, n in enumerate(p.recv_splits) if n) and p.recv_splits[r] == 0
    out, volume = [], 0
    for j, p in enumerate(plans):
        received = torch.cat([sent[r][j] for r in range(len(sizes))])
        assert len(received) == p.received_rows
        volume += len(received)
        source = torch.cat([locals_[j], received])
        # the segments tile the window in order; each is a slice of the local and received rows, or fill
        assert [pos for pos, _, _ in p.segments] == [sum(n for _, _, n in p.segments[:k]) for k in range(len(p.segments))]
        pieces = [torch.full((n,), value) if src < 0 else source[src : src + n] for _, src, n in p.segments]
        out.append(torch.cat(pieces) if pieces else torch.empty(0))
    return out, volume


def _reference(sizes, windows, mode, value=0.0):
    extent = sum(sizes)
    data = torch.arange(1.0, extent + 1)
    pad = max([extent, *(max(-lo, hi - extent, 0) for lo, hi in windows)])
    torch_mode = {"zeros": "constant"}.get(mode, mode)
    if mode == "reflect":  # torch limits reflect padding to extent - 1; tile by hand
        period = torch.cat([data, data.flip(0)[1:-1]]) if extent > 1 else data
        index = torch.arange(-pad, extent + pad).remainder(len(period))
        padded = period[index]
    elif mode == "circular":
        padded = data[torch.arange(-pad, extent + pad).remainder(extent)]
    else:
        kw = {"value": value} if torch_mode == "constant" else {}
        padded = F.pad(data[None, None], (pad, pad), mode=torch_mode, **kw)[0, 0]
    return [padded[lo + pad : hi + pad] for lo, hi in windows]


@pytest.mark.parametrize("mode", MODES)
def test_widths_windows_match_padded_tensor_and_move_only_halo_rows(mode):
    rng = random.Random(0)
    for _ in range(150):
        parts = rng.randint(1, 5)
        extent = rng.randint(2 if mode == "reflect" else 1, 12)
        sizes = _random_sizes(rng, extent, parts)
        left, right = rng.randint(0, 4), rng.randint(0, 4)
        windows = tuple((s - left, s + n + right) for s, n in zip(offsets_from_sizes(sizes), sizes))
        got, volume = _simulate(sizes, windows, mode)
        for g, r in zip(got, _reference(sizes, windows, mode)):
            assert torch.equal(g, r), (sizes, windows, mode)
        # received rows = distinct in-range foreign rows each window reads
        expected = 0
        for (lo, hi), s, n in zip(windows, offsets_from_sizes(sizes), sizes):
            rows = set(_reference([extent], [(lo, hi)], mode)[0].long().tolist()) - {0}
            expected += len({i - 1 for i in rows} - set(range(s, s + n)))
        assert volume == expected


def test_constant_fill_value_and_empty_shards_send_nothing():
    sizes = (0, 3, 0, 0, 2)
    windows = tuple((s - 2, s + n + 2) for s, n in zip(offsets_from_sizes(sizes), sizes))
    got, _ = _simulate(sizes, windows, "constant", value=-7.0)
    assert got[1].tolist() == [-7, -7, 1, 2, 3, 4, 5]
    assert got[0].tolist() == [-7, -7, 1, 2]  # an empty shard's window: the rows around its position
    for r in (0, 2, 3):
        assert plan_dim(sizes, windows, r, "constant", 0, 0).send_splits == (0,) * 5


def _conv_out(n, k, s, d, pl, pr):
    return (n + pl + pr - d * (k - 1) - 1) // s + 1


def test_conv_ownership_rule():
    # stride 1, symmetric padding: the output keeps the input's shard sizes
    for k in (1, 3, 5):
        m = _geometry.Strided(11, 11, k, 1, 1, k // 2)
        assert _geometry.out_sizes(m, (3, 0, 2, 6)) == (3, 0, 2, 6)
    # even kernel, "same": left pad = total // 2
    m = _geometry.Strided(11, 11, 4, 1, 1, 1)
    assert _geometry.out_sizes(m, (3, 0, 2, 6)) == (3, 0, 2, 6)
    # stride 2 (k=3, p=1): output o anchored at input 2o
    m = _geometry.Strided(11, 6, 3, 2, 1, 1)
    assert _geometry.out_sizes(m, (4, 4, 3)) == (2, 2, 2)
    assert _geometry.out_sizes(m, (5, 0, 6)) == (3, 0, 3)
    # transposed 2x (k=2, s=2) maps input i to outputs 2i, 2i+1
    t = _geometry.Transposed(6, 12, 2, 2, 1, 0)
    assert _geometry.out_sizes(t, (3, 0, 3)) == (6, 0, 6)


def test_windows_cover_every_read_row():
    rng = random.Random(1)
    for _ in range(300):
        k, s, d = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 2)
        n = rng.randint(d * (k - 1) + 1, 14)
        pl = pr = rng.randint(0, k // 2)
        out = _conv_out(n, k, s, d, pl, pr)
        m = _geometry.Strided(n, out, k, s, d, pl)
        sizes = _random_sizes(rng, n, rng.randint(1, 4))
        ranges = _geometry.out_ranges(m, sizes)
        assert ranges[0][0] == 0 and ranges[-1][1] == out
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        for (o0, o1), (lo, hi) in zip(ranges, _geometry.windows(m, sizes)):
            for o in range(o0, o1):
                taps = [o * s - pl + j * d for j in range(k)]
                assert lo <= min(taps) and max(taps) < hi
            if o1 > o0:
                assert hi - lo == (o1 - o0 - 1) * s + d * (k - 1) + 1


def test_transposed_windows_cover_contributing_inputs():
    for k, s, d, p in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (0, 1)):
        n = 7
        out = (n - 1) * s - 2 * p + d * (k - 1) + 1
        if out <= 0:
            continue
        t = _geometry.Transposed(n, out, k, s, d, p)
        sizes = (2, 0, 1, 4)
        for (o0, o1), (lo, hi) in zip(_geometry.out_ranges(t, sizes), _geometry.windows(t, sizes)):
            for o in range(o0, o1):
                for i in range(n):
                    if any(i * s - p + j * d == o for j in range(k)):
                        assert lo <= i < hi


def test_adaptive_windows():
    m = _geometry.adaptive(10, 4)
    assert list(zip(m.lo, m.hi)) == [(0, 3), (2, 5), (5, 8), (7, 10)]
    assert sum(_geometry.out_sizes(m, (3, 0, 4, 3))) == 4


@pytest.mark.parametrize("mode", MODES)
def test_plans_built_from_neighbours_only_match_the_padded_tensor(mode):
    """Plans look only at the ranks that can read this rank's rows: many thin, empty and strided shards.

    Windows from a strided map (pooling-like, ceil mode) reach past several
    thin neighbours and the boundary; the group-wide ``exchange`` flag, found
    by arithmetic alone, must agree with the rows that actually move.
    """
    rng = random.Random(1)
    for _ in range(60):
        parts = rng.randint(2, 9)
        extent = rng.randint(2, 20)
        sizes = _random_sizes(rng, extent, parts)
        k, s, pad = rng.randint(1, min(5, extent)), rng.randint(1, 3), rng.randint(0, 2)
        pad = min(pad, k // 2)
        m = _geometry.Strided(extent, _conv_out(extent, k, s, 1, pad, pad), k, s, 1, pad)
        windows = _geometry.windows(m, sizes)
        got, volume = _simulate(sizes, windows, mode)
        for g, r in zip(got, _reference(sizes, windows, mode)):
            assert torch.equal(g, r), (sizes, windows, mode)
        flags = {plan_dim(sizes, windows, r, mode, 0, 0).exchange for r in range(parts)}
        assert flags == {volume > 0}, (sizes, windows, mode)
