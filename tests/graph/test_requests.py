"""Request-based reads with any sharded index: x[idx], index_select, embedding against one process.

``x`` is row-sharded with uneven sizes (an empty shard from 3 ranks on), the
index is sharded in another uneven layout; the output must be laid out like
the index, move two all-to-alls (ids out, rows back) and exactly the distinct
remote rows, record no implicit gather, reuse its plan on the next call (one
all-to-all, rows only) and make a new one after the index is edited in place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import physicsnemo_dp
from physicsnemo_dp import ShardTensor
from physicsnemo_dp.debug import count_collectives
from tests._harness import distributed

from ._graphs import node_mesh_dim, shard_rows as _shard

N, FEAT, L = 11, 3, 17
X_SIZES = {1: (11,), 2: (4, 7), 3: (5, 0, 6), 4: (4, 0, 3, 4)}
I_SIZES = {1: (17,), 2: (9, 8), 3: (0, 10, 7), 4: (6, 5, 0, 6)}
OPS = {
    "getitem": lambda x, i: x[i],
    "index_select": lambda x, i: x.index_select(0, i),
    "embedding": lambda x, i: F.embedding(i, x),
}


def _expected_bytes(idx_full, i_sizes, x_sizes, me, mine):
    """Bytes received: ids peers ask this rank for (int64) and the distinct remote rows it asked for."""

    def ids_of(c):  # a peer's local index (the index replicated over the rows' group: everyone's is mine)
        c = c if mine is None else mine
        start = sum(i_sizes[:c])
        return idx_full[start : start + i_sizes[c]] % N

    def box(c):
        return sum(x_sizes[:c]), sum(x_sizes[: c + 1])

    lo, hi = box(me)
    remote = torch.unique(ids_of(me)[(ids_of(me) < lo) | (ids_of(me) >= hi)])
    asked = sum(
        len(torch.unique(ids_of(c)[(ids_of(c) >= lo) & (ids_of(c) < hi)])) for c in range(len(x_sizes)) if c != me
    )
    return asked * 8 + len(remote) * FEAT * 8


@distributed
def test_request_reads(ctx):
    mesh = ctx.mesh
    md = node_mesh_dim(mesh)
    group = mesh.size(md)
    gen = torch.Generator().manual_seed(5)
    x_full = torch.randn(N, FEAT, dtype=torch.float64, generator=gen)
    w_full = torch.randn(L, FEAT, dtype=torch.float64, generator=gen)
    idx_full = torch.randint(0, N, (L,), generator=gen)
    # the index sharded along the rows' mesh dim, or (2x2 mesh) along the other one only
    for k in range(mesh.ndim):
        i_sizes = I_SIZES[mesh.size(k)]
        exchange = k == md
        for name, op in OPS.items():
            x = _shard(mesh, x_full, md, X_SIZES[group]).requires_grad_()
            idx = _shard(mesh, idx_full - (N if name == "getitem" else 0), k, i_sizes)  # negative ids for x[idx]
            expected = _expected_bytes(
                idx_full,
                i_sizes,
                X_SIZES[group],
                mesh.get_coordinate()[md],
                None if exchange else mesh.get_coordinate()[k],
            )
            with physicsnemo_dp.implicit_gathers("raise"), count_collectives() as counter:
                y = op(x, idx)
            assert counter.calls["all_to_all"] == 2, name
            assert counter.bytes_received["all_to_all"] == expected, name
            assert y.placements == idx.placements and y._spec.dim_sizes[0] == idx._spec.dim_sizes[0]
            assert tuple(y._local_tensor.shape) == (idx._local_tensor.shape[0], FEAT)
            ref_x = x_full.clone().requires_grad_()
            ref = ref_x[idx_full]
            torch.testing.assert_close(y.full_tensor(), ref)
            w = ShardTensor.from_spec(_shard(mesh, w_full, k, i_sizes)._local_tensor, y._spec)
            with physicsnemo_dp.implicit_gathers("raise"), count_collectives() as counter:
                (y * w).sum().backward()
            assert counter.calls["all_to_all"] == (1 if exchange else 0), name
            (ref * w_full).sum().backward()
            torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
            # the plan is cached on the index: the next call moves the rows only
            with count_collectives() as counter:
                again = op(x, idx)
            torch.testing.assert_close(again.full_tensor(), x_full[idx_full])
            assert counter.total_calls == counter.calls["all_to_all"] == 1, name
        # gather / take_along_dim (element by element), embedding with padding_idx, a 2-D index for x[idx]
        idx2_full = torch.randint(0, N, (L, 2), generator=gen)
        w2_full = torch.randn(L, 2, dtype=torch.float64, generator=gen)
        w3_full = torch.randn(L, 2, FEAT, dtype=torch.float64, generator=gen)
        cases = [
            (lambda x, i: torch.gather(x, 0, i), lambda x, i: torch.gather(x, 0, i), idx2_full, w2_full),
            (
                lambda x, i: x.take_along_dim(i, 0),
                lambda x, i: x.take_along_dim(i, 0),
                torch.cat([idx2_full, idx2_full[:, :1]], 1),
                w_full,
            ),
            (
                lambda x, i: F.embedding(i, x, padding_idx=3),
                lambda x, i: F.embedding(i, x, padding_idx=3),
                idx_full,
                w_full,
            ),
            (lambda x, i: x[i], lambda x, i: x[i], idx2_full, w3_full),
        ]
        for op, ref_op, i_full, wt in cases:
            x = _shard(mesh, x_full, md, X_SIZES[group]).requires_grad_()
            idx = _shard(mesh, i_full, k, i_sizes)
            with physicsnemo_dp.implicit_gathers("raise"), count_collectives() as counter:
                y = op(x, idx)
            assert counter.calls["all_to_all"] == 2 and y.placements == idx.placements
            ref_x = x_full.clone().requires_grad_()
            ref = ref_op(ref_x, i_full)
            torch.testing.assert_close(y.full_tensor(), ref)
            w = ShardTensor.from_spec(_shard(mesh, wt, k, i_sizes)._local_tensor, y._spec)
            with physicsnemo_dp.implicit_gathers("raise"):
                (y * w).sum().backward()
            (ref * wt).sum().backward()
            torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
        # an in-place edit of the index makes a new plan
        idx = _shard(mesh, idx_full, k, i_sizes)
        x = _shard(mesh, x_full, md, X_SIZES[group])
        x.index_select(0, idx)
        idx.add_(1)
        idx.remainder_(N)
        with count_collectives() as counter:
            y = x.index_select(0, idx)
        assert counter.calls["all_to_all"] == 2
        torch.testing.assert_close(y.full_tensor(), x_full[(idx_full + 1) % N])


@distributed
def test_request_read_out_of_range_raises_everywhere(ctx):
    mesh = ctx.mesh
    md = node_mesh_dim(mesh)
    x = _shard(mesh, torch.zeros(N, FEAT), md, X_SIZES[mesh.size(md)])
    bad = torch.arange(L) % N
    bad[-1] = N + 4  # held by the last rank of the index's group only
    idx = _shard(mesh, bad, md, I_SIZES[mesh.size(md)])
    with pytest.raises(IndexError, match=rf"index_select: index {N + 4} \(on rank \d\) is out of bounds .* size {N}"):
        x.index_select(0, idx)
    with pytest.raises(IndexError, match="out of bounds"):
        x[idx - 2 * N]
