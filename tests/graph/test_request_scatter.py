"""Request-based writes with any sharded index: index_add, scatter_add, scatter_reduce, index_put(accumulate=True).

The target is row-sharded with uneven sizes (an empty shard from 3 ranks on)
or a plain tensor of the global size (torch_scatter's ``torch.zeros(N, F)``),
the index is sharded in another uneven layout. Values and every gradient are
compared with one process; the forward moves one all-to-all once the plan is
cached, and nothing is recorded as an implicit gather (``"raise"``).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

import physicsnemo_dp
from physicsnemo_dp import ShardTensor
from physicsnemo_dp.debug import count_collectives
from physicsnemo_dp.split import chunk_sizes
from tests._harness import distributed

from ._graphs import node_mesh_dim, shard_rows as _shard

N, FEAT, L = 11, 3, 17
X_SIZES = {1: (11,), 2: (4, 7), 3: (5, 0, 6), 4: (4, 0, 3, 4)}
I_SIZES = {1: (17,), 2: (9, 8), 3: (0, 10, 7), 4: (6, 5, 0, 6)}


# torch_scatter's python scatter_sum / scatter_mean, as written there
def _broadcast(src, other, dim):
    if dim < 0:
        dim = other.dim() + dim
    if src.dim() == 1:
        for _ in range(0, dim):
            src = src.unsqueeze(0)
    for _ in range(src.dim(), other.dim()):
        src = src.unsqueeze(-1)
    return src.expand(other.size())


def scatter_sum(src, index, dim=-1, out=None, dim_size=None):
    index = _broadcast(index, src, dim)
    if out is None:
        size = list(src.size())
        size[dim] = dim_size
        out = torch.zeros(size, dtype=src.dtype, device=src.device)
    return out.scatter_add_(dim, index, src)


def scatter_mean(src, index, dim=-1, out=None, dim_size=None):
    out = scatter_sum(src, index, dim, out, dim_size)
    dim_size = out.size(dim)
    index_dim = dim
    if index_dim < 0:
        index_dim = index_dim + src.dim()
    if index.dim() <= index_dim:
        index_dim = index.dim() - 1
    ones = torch.ones(index.size(), dtype=src.dtype, device=src.device)
    count = scatter_sum(ones, index, index_dim, None, dim_size)
    count[count < 1] = 1
    count = _broadcast(count, out, dim)
    return out.true_divide_(count)


def _cases(idx, idx2, gen):
    """(name, op(x, index, src), index, src shape): the writes, on any x of N rows."""
    rows = lambda i: i.view(-1, 1).expand(L, FEAT)  # noqa: E731 torch_scatter's broadcast index
    cases = [
        ("index_add", lambda x, i, s: x.index_add(0, i, s, alpha=2), idx, (L, FEAT)),
        ("index_put", lambda x, i, s: x.index_put((i - N,), s, accumulate=True), idx, (L, FEAT)),
        ("scatter_add rows", lambda x, i, s: x.scatter_add(0, rows(i), s), idx, (L, FEAT)),
        ("scatter_add elements", lambda x, i, s: x.scatter_add(0, i, s), idx2, (L, 2)),
    ]
    for reduce in ("sum", "mean", "amax", "amin", "prod"):
        for include_self in (True, False):
            cases.append(
                (
                    f"{reduce} {include_self} rows",
                    lambda x, i, s, r=reduce, k=include_self: x.scatter_reduce(0, rows(i), s, r, include_self=k),
                    idx,
                    (L, FEAT),
                )
            )
    for reduce in ("mean", "amax", "prod"):
        cases.append(
            (
                f"{reduce} elements",
                lambda x, i, s, r=reduce: x.scatter_reduce(0, i, s, r, include_self=False),
                idx2,
                (L, 2),
            )
        )
    return cases


def _values(shape, gen):
    """Small integers (ties for amax/amin, zeros for prod) plus a little noise on half of them."""
    v = torch.randint(-2, 3, shape, generator=gen).double()
    noise = torch.rand(shape, generator=gen, dtype=torch.float64)
    return torch.where(torch.rand(shape, generator=gen) < 0.5, v, v + noise)


@distributed
def test_request_writes(ctx):
    mesh = ctx.mesh
    md = node_mesh_dim(mesh)
    group = mesh.size(md)
    gen = torch.Generator().manual_seed(7)
    idx_full = torch.randint(0, N, (L,), generator=gen)
    idx2_full = torch.randint(0, N, (L, 2), generator=gen)
    x_full = _values((N, FEAT), gen)
    for name, op, i_full, s_shape in _cases(idx_full, idx2_full, gen):
        s_full = _values(s_shape, gen)
        w_full = torch.randn(N, FEAT, dtype=torch.float64, generator=gen)
        x = _shard(mesh, x_full, md, X_SIZES[group]).requires_grad_()
        s = _shard(mesh, s_full, md, I_SIZES[group]).requires_grad_()
        idx = _shard(mesh, i_full, md, I_SIZES[group])
        with physicsnemo_dp.implicit_gathers("raise"):
            y = op(x, idx, s)
        assert y.placements == x.placements and y._spec.dim_sizes == x._spec.dim_sizes, name
        ref_x, ref_s = x_full.clone().requires_grad_(), s_full.clone().requires_grad_()
        ref = op(ref_x, i_full, ref_s)
        torch.testing.assert_close(y.full_tensor(), ref, msg=name)
        w = ShardTensor.from_spec(_shard(mesh, w_full, md, X_SIZES[group])._local_tensor, y._spec)
        with physicsnemo_dp.implicit_gathers("raise"):
            try:
                (y * w).sum().backward()
            except Exception as e:
                raise AssertionError(name) from e
        (ref * w_full).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad, msg=name)
        torch.testing.assert_close(s.grad.full_tensor(), ref_s.grad, msg=name)
        if name in ("index_add", "scatter_add rows"):  # the plan is cached: one all-to-all of values
            with count_collectives() as counter:
                op(x.detach(), idx, s.detach())
            assert counter.total_calls == counter.calls["all_to_all"] == 1, (name, counter.summary())


@distributed
def test_request_write_index_sharded_along_columns(ctx):
    """An int32 index sharded along its dim 1 (uneven, empty shards), written element by element."""
    mesh = ctx.mesh
    md = node_mesh_dim(mesh)
    group = mesh.size(md)
    gen = torch.Generator().manual_seed(11)
    idx_full = torch.randint(0, N, (L, 2), generator=gen, dtype=torch.int32)
    s_full, x_full = _values((L, 2), gen), _values((N, FEAT), gen)
    w_full = torch.randn(N, FEAT, dtype=torch.float64, generator=gen)
    cols = {1: (2,), 2: (1, 1), 3: (1, 0, 1), 4: (0, 1, 0, 1)}[group]
    start = sum(cols[: mesh.get_coordinate()[md]])
    width = cols[mesh.get_coordinate()[md]]
    placements = [Shard(1) if m == md else Replicate() for m in range(mesh.ndim)]

    def by_columns(full):
        local = full[:, start : start + width].clone()
        return ShardTensor.from_local(local, mesh, placements, sharding_shapes={md: [(L, c) for c in cols]})

    for reduce in ("sum", "amax"):
        x = _shard(mesh, x_full, md, X_SIZES[group]).requires_grad_()
        s = by_columns(s_full).requires_grad_()
        with physicsnemo_dp.implicit_gathers("raise"):
            y = x.scatter_reduce(0, by_columns(idx_full), s, reduce, include_self=True)
        ref_x, ref_s = x_full.clone().requires_grad_(), s_full.clone().requires_grad_()
        ref = ref_x.scatter_reduce(0, idx_full.long(), ref_s, reduce, include_self=True)
        torch.testing.assert_close(y.full_tensor(), ref)
        w = ShardTensor.from_spec(_shard(mesh, w_full, md, X_SIZES[group])._local_tensor, y._spec)
        with physicsnemo_dp.implicit_gathers("raise"):
            (y * w).sum().backward()
        (ref * w_full).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
        torch.testing.assert_close(s.grad.full_tensor(), ref_s.grad)


@distributed
def test_plain_zero_target(ctx):
    """torch_scatter / torch_geometric: a plain (or new_zeros / full) target of N rows becomes node-sharded."""
    mesh = ctx.mesh
    md = node_mesh_dim(mesh)
    group = mesh.size(md)
    gen = torch.Generator().manual_seed(3)
    idx_full = torch.randint(0, N, (L,), generator=gen)
    s_full = _values((L, FEAT), gen)
    w_full = torch.randn(N, FEAT, dtype=torch.float64, generator=gen)
    chunks = chunk_sizes(N, group)
    cases = [
        ("scatter_sum", lambda s, i: scatter_sum(s, i, 0, dim_size=N)),
        ("scatter_mean", lambda s, i: scatter_mean(s, i, 0, dim_size=N)),
        ("new_zeros", lambda s, i: s.new_zeros(N, FEAT).scatter_add_(0, i.view(-1, 1).expand_as(s), s)),
        ("index_add_", lambda s, i: torch.zeros(N, FEAT, dtype=s.dtype).index_add_(0, i, s)),
        (
            "full amax",
            lambda s, i: torch.full((N, FEAT), 0.5, dtype=s.dtype).scatter_reduce_(
                0, i.view(-1, 1).expand_as(s), s, "amax", include_self=True
            ),
        ),
        ("index_put_", lambda s, i: torch.zeros(N, FEAT, dtype=s.dtype).index_put_((i,), s, accumulate=True)),
    ]
    for name, op in cases:
        s = _shard(mesh, s_full, md, I_SIZES[group]).requires_grad_()
        idx = _shard(mesh, idx_full, md, I_SIZES[group])
        with physicsnemo_dp.implicit_gathers("raise"):
            y = op(s, idx)
        assert isinstance(y, ShardTensor) and y.placements[md] == Shard(0) and y._spec.dim_sizes[0] == chunks, (
            name,
            type(y),
            getattr(y, "placements", None),
        )
        ref_s = s_full.clone().requires_grad_()
        ref = op(ref_s, idx_full)
        torch.testing.assert_close(y.full_tensor(), ref, msg=name)
        w = ShardTensor.from_spec(_shard(mesh, w_full, md, chunks)._local_tensor, y._spec)
        with physicsnemo_dp.implicit_gathers("raise"):
            (y * w).sum().backward()
        (ref * w_full).sum().backward()
        torch.testing.assert_close(s.grad.full_tensor(), ref_s.grad, msg=name)
    # the plain tensor itself holds this rank's rows of the result, its other rows keep their value
    plain = torch.full((N, FEAT), 7.0, dtype=torch.float64)
    s = _shard(mesh, s_full, md, I_SIZES[group])
    y = plain.scatter_add_(0, _shard(mesh, idx_full, md, I_SIZES[group]).view(-1, 1).expand_as(s), s)
    start = sum(chunks[: mesh.get_coordinate()[md]])
    mine = torch.zeros(N, dtype=torch.bool)
    mine[start : start + y._local_tensor.shape[0]] = True
    ref = torch.full((N, FEAT), 7.0, dtype=torch.float64).scatter_add_(0, idx_full.view(-1, 1).expand(L, FEAT), s_full)
    torch.testing.assert_close(plain[mine], ref[mine])
    assert (plain[~mine] == 7.0).all()


@distributed
def test_request_write_out_of_range_raises_everywhere(ctx):
    mesh = ctx.mesh
    md = node_mesh_dim(mesh)
    group = mesh.size(md)
    bad = torch.arange(L) % N
    bad[-1] = N + 4  # held by the last rank of the index's group only
    s = _shard(mesh, torch.ones(L, FEAT), md, I_SIZES[group])
    idx = _shard(mesh, bad, md, I_SIZES[group])
    with pytest.raises(IndexError, match=rf"index {N + 4} \(on rank \d\) is out of bounds .* size {N}"):
        scatter_sum(s, idx, 0, dim_size=N)
    x = _shard(mesh, torch.zeros(N, FEAT), md, X_SIZES[group])
    with pytest.raises(IndexError, match=rf"index_add: index {N + 4} \(on rank \d\) is out of bounds"):
        x.index_add(0, idx, s)


@distributed(world_sizes=(2, 4), mesh_2d=False)
def test_scatter_traffic_stays_local(ctx):
    """torch_scatter-style aggregation on a chain mesh: bytes received per rank <= 1/4 of the features, flat in P.

    Edges are split evenly (``torch.chunk``), nodes ``shift`` rows off that split, so each rank
    both reads and writes about ``shift`` rows of its neighbour, whatever the rank count.
    """
    mesh = ctx.mesh
    n, feat, k, shift = 4096, 16, 2, 50
    x_full = torch.randn(n, feat, generator=torch.Generator().manual_seed(0))
    dst = torch.arange(n).repeat_interleave(2 * k)
    src = (dst + torch.tensor([d for d in range(-k, k + 1) if d]).repeat(n)).clamp(0, n - 1)
    nodes = list(chunk_sizes(n, ctx.world_size))
    nodes[0], nodes[-1] = nodes[0] - shift, nodes[-1] + shift
    x = _shard(mesh, x_full, 0, tuple(nodes)).requires_grad_()
    e_sizes = chunk_sizes(len(dst), ctx.world_size)
    s_idx, d_idx = _shard(mesh, src, 0, e_sizes), _shard(mesh, dst, 0, e_sizes)
    ref = scatter_mean(2 * x_full[src], dst, 0, dim_size=n) + scatter_sum(2 * x_full[src], dst, 0, dim_size=n)
    for _ in range(2):  # the second step reuses the plans
        with count_collectives() as counter, physicsnemo_dp.implicit_gathers("raise"):
            msg = x[s_idx] * 2.0
            agg = scatter_mean(msg, d_idx, 0, dim_size=n) + scatter_sum(msg, d_idx, 0, dim_size=n)
            agg.sum().backward()
        torch.testing.assert_close(agg.full_tensor(), ref)
    features = n * feat * 4
    received = counter.total_received
    # rows of one neighbour, (shift + k) at most, in each of the step's exchanges (read, its gradient, three
    # scatters, the gradients' reads); ids and counts are int64: a bound that does not depend on P
    flat_bound = 6 * (shift + k) * (feat * 4 + 8)
    assert received <= features / 4 and received <= flat_bound, (received, flat_bound, counter.summary())
