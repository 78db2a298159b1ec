"""collectives.neighbour_exchange on real ranks: the sparse all_to_all_v of the halo exchange.

Peers come from real halo plans (uneven shards, an empty one, windows spanning
two or more ranks, wrapping boundaries), so the exchange is checked on the
patterns it serves. Each result is compared with the global rows it must hold
and with ``all_to_all_v`` (values and counted bytes), for dtypes that gloo
moves only as a same-size stand-in.
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import collectives, count_collectives
from physicsnemo_dp.spatial._halo_plan import plan_dim, source_rows
from physicsnemo_dp.split import offsets_from_sizes
from tests._harness import distributed

DTYPES = [torch.float32, torch.float64, torch.int16, torch.uint32, torch.bool, torch.complex64, torch.bfloat16]


def _layout(world_size):
    """Uneven sizes with an empty shard, and windows of 3 rows either side (thin shards: 2+ ranks away)."""
    sizes = {3: (5, 0, 2), 4: (1, 0, 6, 2)}[world_size]
    windows = tuple((s - 3, s + n + 3) for s, n in zip(offsets_from_sizes(sizes), sizes))
    return sizes, windows


def _global(extent, dtype):
    """Rows ``0..extent-1`` of shape (2, 3), distinct per row where the dtype allows it."""
    values = torch.arange(extent * 6).reshape(extent, 2, 3)
    if dtype is torch.bool:
        return values % 3 == 0
    if dtype.is_complex:
        return torch.complex(values.float(), -values.float()).to(dtype)
    return values.to(dtype)


@pytest.mark.parametrize("mode", ["zeros", "circular"])
@distributed(world_sizes=(3, 4), mesh_2d=False)
def test_planned_peers_move_the_halo_rows_like_all_to_all_v(ctx, mode):
    sizes, windows = _layout(ctx.world_size)
    me, start = ctx.rank, offsets_from_sizes(sizes)[ctx.rank]
    p = plan_dim(sizes, windows, me, mode, 0, 0)
    src = source_rows(*windows[me], sum(sizes), mode)
    wanted = torch.unique(src[(src >= 0) & ((src < start) | (src >= start + sizes[me]))])
    if ctx.world_size == 3:  # the pattern this test is about: the window of rank 2 reaches rank 0 past empty rank 1
        assert [q for q, _ in plan_dim(sizes, windows, 2, mode, 0, 0).recv_peers] == [0]
    for dtype in DTYPES:
        G = _global(sum(sizes), dtype)
        send = G[start : start + sizes[me]][p.send_index]
        with count_collectives() as sparse:
            got = collectives.neighbour_exchange(send, p.send_peers, p.recv_peers, ctx.mesh, 0, kind="halo")
        with count_collectives() as dense:
            ref = collectives.all_to_all_v(send, p.send_splits, p.recv_splits, ctx.mesh, 0, kind="halo")
        assert got.dtype == dtype and torch.equal(got, G[wanted]) and torch.equal(got, ref), (dtype, mode)
        assert sparse.summary() == dense.summary(), dtype
        # the backward direction: every rank gets back exactly the rows it sent
        back = collectives.neighbour_exchange(got, p.recv_peers, p.send_peers, ctx.mesh, 0, kind="halo")
        assert torch.equal(back, send), dtype


@distributed(world_sizes=(3,), mesh_2d=False)
def test_empty_rows_self_rows_and_meta_tensors(ctx):
    me, n = ctx.rank, ctx.world_size
    right, left = (me + 1) % n, (me - 1) % n
    # rows of zero elements: the peers still pair up, nothing is transmitted, shapes are right
    sends = tuple(sorted({(right, 2), (left, 1)}))
    recvs = tuple(sorted({(left, 2), (right, 1)}))
    rows = {q: r for q, r in sends}
    data = torch.cat([torch.full((rows[q], 0, 4), float(q)) for q, _ in sends])
    out = collectives.neighbour_exchange(data, sends, recvs, ctx.mesh, 0)
    assert out.shape == (3, 0, 4)
    # rows to this rank itself are a local copy, placed in group order among the received rows
    sends = tuple(sorted({(right, 2), (me, 1)}))
    recvs = tuple(sorted({(left, 2), (me, 1)}))
    data = torch.cat([torch.full((r, 3), 10.0 * me + q) for q, r in sends])
    with count_collectives() as counted:
        out = collectives.neighbour_exchange(data, sends, recvs, ctx.mesh, 0)
    assert torch.equal(out, torch.cat([torch.full((r, 3), 10.0 * q + me) for q, r in recvs]))
    assert counted.bytes_sent["neighbour_exchange"] == counted.bytes_received["neighbour_exchange"] == 2 * 3 * 4
    # meta tensors (debug.simulate) give the shape and the same counts, without communicating
    with count_collectives() as simulated:
        out = collectives.neighbour_exchange(data.to("meta"), sends, recvs, ctx.mesh, 0)
    assert out.is_meta and out.shape == (3, 3) and simulated.summary() == counted.summary()


@distributed(world_sizes=(2,), mesh_2d=False)
def test_bad_peer_lists_raise_naming_the_argument(ctx):
    me, other = ctx.rank, 1 - ctx.rank
    rows = torch.zeros(2, 3)
    for peers in (((other, 0),), ((2, 2),), ((-1, 2),), ((1, 1), (0, 1))):
        with pytest.raises(ValueError, match="send_peers must be"):
            collectives.neighbour_exchange(rows, peers, (), ctx.mesh, 0)
        with pytest.raises(ValueError, match="recv_peers must be"):
            collectives.neighbour_exchange(rows[:0], (), peers, ctx.mesh, 0)
    with pytest.raises(ValueError, match="chunks_in must hold the 3 rows"):
        collectives.neighbour_exchange(rows, ((other, 3),), (), ctx.mesh, 0)
    with pytest.raises(ValueError, match="sends itself 2 rows"):
        collectives.neighbour_exchange(rows, ((me, 2),), (), ctx.mesh, 0)


@distributed(world_sizes=(3,), mesh_2d=False)
def test_point_to_point_through_host_memory_where_gloo_needs_it(ctx):
    """gloo sends and receives CPU tensors only: ranks sharing a GPU over gloo stage halo and ring
    transfers through the host (``collectives._through_host``). Forced here on CPU tensors, the staged
    path must land the same rows in the caller's buffers, for the halo exchange and the ring's send_recv."""
    import torch.nn.functional as F

    from ..attention.test_ring import _inputs

    assert not collectives._through_host(ctx.mesh.get_group(0), torch.device("cpu"))
    assert not collectives._through_host(ctx.mesh.get_group(0), torch.device("meta"))
    sizes, windows = _layout(3)
    me, start = ctx.rank, offsets_from_sizes(sizes)[ctx.rank]
    p = plan_dim(sizes, windows, me, "circular", 0, 0)
    G = _global(sum(sizes), torch.float64)
    send = G[start : start + sizes[me]][p.send_index]
    direct = collectives.neighbour_exchange(send, p.send_peers, p.recv_peers, ctx.mesh, 0, kind="halo")
    (q, k, v), _ = _inputs(ctx.mesh, [(Shard(2),)] * 3)
    ring = F.scaled_dot_product_attention(q, k, v).to_local()
    staged = collectives._through_host
    collectives._through_host = lambda group, device: True
    try:
        landed = collectives.neighbour_exchange(send, p.send_peers, p.recv_peers, ctx.mesh, 0, kind="halo")
        nxt, prev = (me + 1) % 3, (me - 1) % 3
        mine = torch.full((2, 3), float(me), dtype=torch.float64)
        exchange = collectives.send_recv([mine], nxt, [((2, 3), torch.float64)], prev, ctx.mesh, 0)
        assert len(exchange.landing) == 1 and exchange.landing[0][0] is exchange.received[0]
        (got,) = exchange.wait()
        ring_staged = F.scaled_dot_product_attention(q, k, v).to_local()
    finally:
        collectives._through_host = staged
    assert torch.equal(landed, direct)
    assert torch.equal(got, torch.full((2, 3), float(prev), dtype=torch.float64))
    assert torch.equal(ring_staged, ring)
