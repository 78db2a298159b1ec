"""Indexing on uneven shards: reads, boolean masks, writes and embedding, forward and backward.

Index tensors are tried plain (promoted to Replicate), Replicate and sharded.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 5, 3)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ints(high, shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _index_layouts(mesh, ndim=1):
    """None (plain), Replicate, and sharded placements for an index tensor."""
    rep = (Replicate(),) * mesh.ndim
    sharded = [p for p in layouts(mesh, ndim) if p != rep]
    return [None, rep] + sharded[: 3 if mesh.ndim == 2 else ndim]


IDX = torch.tensor([6, 0, 2, 2, 5, 1, 6])  # duplicates, first and last rows


@distributed(world_sizes=OP_WORLD_SIZES)
def test_index_select_along_every_dim(ctx):
    mesh = ctx.mesh
    for dim, size in enumerate(SHAPE):
        idx = IDX % size
        for px in layouts(mesh, 3):
            for pi in _index_layouts(mesh):
                check(lambda x, i: torch.index_select(x, dim, i), [(_g(), px), (idx, pi)], mesh, label=f"isel{dim}")
        check(lambda x, i: x.index_select(dim, i), [(_g(), layouts(mesh, 3)[0]), (torch.tensor(size - 1), None)],
              mesh, label="0-d index")
        for pi in _index_layouts(mesh)[2:]:  # a plain weight read with a sharded index
            check(lambda x, i: x.index_select(dim, i), [(_g(), None), (idx, pi)], mesh, label="plain x")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_reads_of_pending_integer_and_bool_data(ctx):
    mesh = ctx.mesh
    i = IDX
    m = _g(seed=5)[:, :, 0] > 0
    reads = [
        ("index_select", lambda x: x.index_select(0, i)),
        ("x[:, j]", lambda x: x[:, i % 5]),
        ("gather", lambda x: x.gather(0, _ints(7, (4, 5, 3), 1))),
        ("x[mask]", lambda x: x[m]),
    ]
    for name, fn in reads:
        for px in layouts(mesh, 3, partial=True):
            check(fn, [(_g(), px)], mesh, label=f"{name} pending")
            check(fn, [(_ints(9, SHAPE, 2), px)], mesh, label=f"{name} int64")
            if not any(p.is_partial() for p in px):
                check(fn, [(_g() > 0, px)], mesh, label=f"{name} bool")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_index_select_placements_and_no_forward_communication(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, (Shard(0),) * mesh.ndim, SHAPE)
    x = shard_from_global(_g(), spec, requires_grad=True)
    with count_collectives() as c:
        y = x.index_select(0, IDX)  # along the sharded dim, replicated index: pending sum
    assert c.total_calls == 0
    assert all(p == Partial("sum") for p in y.placements)
    w = shard_from_global(torch.ones(y.shape, dtype=torch.float64), spec.with_layout((Replicate(),) * mesh.ndim, (None,) * 3))
    with count_collectives() as c:
        torch.autograd.backward([y], [w])
    assert c.total_calls == 0  # each rank scatters into the rows it owns
    assert x.grad._spec.dim_sizes == spec.dim_sizes
    expected = torch.zeros(SHAPE, dtype=torch.float64).index_add_(0, IDX, torch.ones(len(IDX), 5, 3, dtype=torch.float64))
    assert torch.equal(x.grad.full_tensor(), expected)
    # replicated data, sharded index: the output is sharded like the index, still no communication
    rep = make_spec(mesh, (Replicate(),) * mesh.ndim, SHAPE)
    ispec = make_spec(mesh, (Shard(0),) * mesh.ndim, tuple(IDX.shape), dtype=torch.int64)
    idx = shard_from_global(IDX, ispec)
    with count_collectives() as c:
        z = shard_from_global(_g(), rep).index_select(1, idx % 5)
    assert c.total_calls == 0
    assert z.placements == (Shard(1),) * mesh.ndim and z._spec.dim_sizes[1] == ispec.dim_sizes[0]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_gather_along_sharded_and_unsharded_dims(ctx):
    mesh = ctx.mesh
    cases = [(0, (6, 4, 3)), (1, (7, 6, 2)), (2, (5, 5, 4))]
    for dim, ishape in cases:
        index = _ints(SHAPE[dim], ishape, seed=dim)
        for px in layouts(mesh, 3):
            for pi in _index_layouts(mesh, 3):
                check(lambda x, i: torch.gather(x, dim, i), [(_g(), px), (index, pi)], mesh, label=f"gather{dim}")


ADVANCED = [
    ("x[i]", lambda x, i, j: x[i]),
    ("x[:, j]", lambda x, i, j: x[:, j]),
    ("x[..., k]", lambda x, i, j: x[..., j % 3]),
    ("x[i, j] adjacent", lambda x, i, j: x[i, j]),
    ("x[:, j, k] adjacent", lambda x, i, j: x[:, j, j % 3]),
    ("x[i, :, k] separated", lambda x, i, j: x[i, :, j % 3]),
    ("x[negative]", lambda x, i, j: x[i - 7]),
    ("x[2-d index]", lambda x, i, j: x[:, torch.stack([j, (j + 2) % 5])]),
    ("x[broadcast pair]", lambda x, i, j: x[i[:, None], j[None, :3]]),
    ("x[None, i]", lambda x, i, j: x[None, i]),
    ("x[list]", lambda x, i, j: x[[0, 6, 3]]),
]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_advanced_indexing(ctx):
    mesh = ctx.mesh
    i, j = IDX, torch.tensor([4, 0, 1, 1, 3, 2, 4])
    for name, fn in ADVANCED:
        for px in layouts(mesh, 3):
            check(fn, [(_g(), px), (i, None), (j, None)], mesh, label=name)
        for pi in _index_layouts(mesh)[1:]:
            check(fn, [(_g(), layouts(mesh, 3)[-1]), (i, pi), (j, pi)], mesh, label=f"{name} sharded index")
            check(fn, [(_g(), layouts(mesh, 3)[0]), (i, pi), (j, pi)], mesh, label=f"{name} both sharded")
            check(fn, [(_g(), None), (i, pi), (j, pi)], mesh, label=f"{name} plain x")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_indexing_mixed_with_basic_indexing(ctx):
    """ints, slices and ``...`` go to the view rules, tensors to ``aten.index``; both compose."""
    mesh = ctx.mesh
    j = torch.tensor([2, 0, 2])
    cases = [
        ("x[i]", lambda x, j: x[1]),
        ("x[..., 1:3]", lambda x, j: x[..., 1:3]),
        ("x[0, :, j]", lambda x, j: x[0, :, j]),
        ("x[1:6, j]", lambda x, j: x[1:6, j]),
        ("x[j, 1:4]", lambda x, j: x[j, 1:4]),
        ("x[-1, j, 1:]", lambda x, j: x[-1, j, 1:]),
    ]
    for name, fn in cases:
        for px in layouts(mesh, 3):
            check(fn, [(_g(), px), (j, None)], mesh, label=name)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_boolean_masks(ctx):
    mesh = ctx.mesh
    full = _g(seed=5) > 0.2
    cases = [
        ("x[mask2]", lambda x, m: x[m], full[:, :, 0]),
        ("x[:, mask2]", lambda x, m: x[:, m], full[0]),
        ("x[mask3]", lambda x, m: x[m], full),
        ("x[..., mask1]", lambda x, m: x[..., m], full[0, 0]),
        ("masked_select", lambda x, m: torch.masked_select(x, m), full),
        ("masked_select bcast", lambda x, m: x.masked_select(m), full[0]),
    ]
    for name, fn, mask in cases:
        for px in layouts(mesh, 3):
            check(fn, [(_g(), px), (mask, None)], mesh, label=name)
        for pm in _index_layouts(mesh, mask.ndim)[1:]:
            check(fn, [(_g(), layouts(mesh, 3)[-1]), (mask, pm)], mesh, label=f"{name} sharded mask")
            check(fn, [(_g(), layouts(mesh, 3)[0]), (mask, pm)], mesh, label=f"{name} both sharded")
    check(lambda x: x[x > 0], [(_g(), layouts(mesh, 3)[0])], mesh, label="x[x > 0]")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_mask_output_layout_uses_rank_counts(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, (Shard(0),) * mesh.ndim, SHAPE)
    G = _g()
    x = shard_from_global(G, spec)
    mask = shard_from_global(G > 0, make_spec(mesh, (Shard(0),) * mesh.ndim, SHAPE, dtype=torch.bool))
    with count_collectives() as c:
        y = x[mask]
    assert c.total_calls == mesh.ndim and set(c.calls) == {"all_gather"}  # one int per rank, gathered once
    assert y._local_tensor.shape[0] == int((x._local_tensor > 0).sum())
    assert y.placements == (Shard(0),) * mesh.ndim and torch.equal(y.full_tensor(), G[G > 0])
    # a mask sharded along a later dim is moved to the leading one (row-major order kept)
    x1 = shard_from_global(G, make_spec(mesh, (Shard(1),) * mesh.ndim, SHAPE))
    assert torch.equal(x1[x1 > 0].full_tensor(), G[G > 0])


@distributed(world_sizes=OP_WORLD_SIZES)
def test_nonzero_and_where_with_one_argument(ctx):
    mesh = ctx.mesh
    G = _g(seed=2).round()
    for px in layouts(mesh, 3, partial=True):
        x = shard_from_global(G, make_spec(mesh, px, SHAPE))
        nz = torch.nonzero(x)
        assert torch.equal(nz.full_tensor(), torch.nonzero(G)), px
        for got, want in zip(torch.where(x), torch.where(G)):
            assert torch.equal(got.full_tensor(), want), px
        for got, want in zip(x.nonzero(as_tuple=True), G.nonzero(as_tuple=True)):
            assert torch.equal(got.full_tensor(), want), px


def _setitem(index, value_fn=None):
    def fn(x, v):
        y = x.clone()
        y[index] = v if value_fn is None else value_fn(v)
        return y * 1.0

    return fn


@distributed(world_sizes=OP_WORLD_SIZES)
def test_setitem_and_index_put(ctx):
    mesh = ctx.mesh
    mask2 = _g(seed=5)[:, :, 0] > 0
    count = int(mask2.sum())
    i = torch.tensor([6, 0, 3, 4])
    cases = [
        ("x[i] = v", _setitem(i), _g((4, 5, 3), 1), True),
        ("x[i] = row", _setitem(i), _g((3,), 1), True),
        ("x[:, j] = v", _setitem((slice(None), torch.tensor([4, 1]))), _g((7, 2, 3), 1), True),
        ("x[i, j] = v", _setitem((i, torch.tensor([4, 1, 0, 2]))), _g((4, 3), 1), True),
        ("x[mask] = v", _setitem(mask2), _g((count, 3), 1), True),
        ("x[mask] = row", _setitem(mask2), _g((3,), 1), True),
        ("x[mask] = 0", _setitem(mask2, lambda v: 0.0), _g((1,), 1), False),
        ("index_put acc", lambda x, v: x.index_put((i, torch.tensor([4, 4, 0, 4])), v, accumulate=True), _g((4, 3), 1), True),
        ("index_put dup", lambda x, v: torch.index_put(x, (torch.tensor([1, 1, 5]),), v, accumulate=True), _g((3, 5, 3), 1), True),
    ]
    for name, fn, v, v_sharded in cases:
        for px in layouts(mesh, 3):
            check(fn, [(_g(), px), (v, None)], mesh, label=name)
            if v_sharded:
                check(fn, [(_g(), px), (v, layouts(mesh, v.ndim)[0])], mesh, label=f"{name} sharded v")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_index_add_and_scatter_family(ctx):
    mesh = ctx.mesh
    idx = torch.tensor([6, 0, 2, 2, 5])
    scatter_idx = _ints(5, (6, 4, 3), seed=3)
    cases = [
        ("index_add 0", lambda x, s: x.index_add(0, idx, s, alpha=2.0), _g((5, 5, 3), 1)),
        ("index_add 1", lambda x, s: torch.index_add(x, 1, idx % 5, s), _g((7, 5, 3), 1)),
        ("scatter", lambda x, s: x.scatter(1, scatter_idx, s), _g((6, 4, 3), 1)),
        ("scatter value", lambda x, s: x.scatter(1, scatter_idx, 2.5) * s.sum(), _g((1,), 1)),
        ("scatter_add", lambda x, s: x.scatter_add(1, scatter_idx, s), _g((6, 4, 3), 1)),
        ("scatter_add 0", lambda x, s: x.scatter_add(0, scatter_idx % 7, s), _g((6, 4, 3), 1)),
        ("scatter_reduce sum", lambda x, s: x.scatter_reduce(1, scatter_idx, s, "sum"), _g((6, 4, 3), 1)),
        ("scatter_reduce mean", lambda x, s: x.scatter_reduce(1, scatter_idx, s, "mean", include_self=False), _g((6, 4, 3), 1)),
        ("scatter_reduce amax", lambda x, s: x.scatter_reduce(1, scatter_idx, s, "amax"), _g((6, 4, 3), 1)),
        ("scatter_reduce prod", lambda x, s: x.scatter_reduce(1, scatter_idx, s, "prod", include_self=False), _g((6, 4, 3), 1)),
    ]
    for name, fn, s in cases:
        for px in layouts(mesh, 3):
            check(fn, [(_g(), px), (s, None)], mesh, label=name)
        if s.ndim == 3:
            check(fn, [(_g(), layouts(mesh, 3)[-1]), (s, layouts(mesh, 3)[0])], mesh, label=f"{name} sharded source")
    # in place, into a pending sum
    for px in layouts(mesh, 3, partial=True):
        G, S = _g(), _g((6, 4, 3), 1)
        x = shard_from_global(G, make_spec(mesh, px, SHAPE))
        x.scatter_add_(1, scatter_idx, S).index_add_(0, idx, _g((5, 5, 3), 2))
        expected = G.scatter_add(1, scatter_idx, S).index_add(0, idx, _g((5, 5, 3), 2))
        assert torch.allclose(x.full_tensor(), expected), px


class _Embed(torch.nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4, padding_idx=padding_idx, dtype=torch.float64)

    def forward(self, scale, idx):
        return self.embedding(idx) * scale


@distributed(world_sizes=OP_WORLD_SIZES)
def test_embedding(ctx):
    mesh = ctx.mesh
    idx = _ints(10, (6, 4), seed=7)
    idx[0, 0] = 3
    scale = torch.full((1,), 1.5, dtype=torch.float64)
    for padding_idx in (None, 3):
        for pi in _index_layouts(mesh, 2):
            torch.manual_seed(0)
            module = _Embed(padding_idx)
            check(lambda m, s, i: m(s, i), [(scale, None), (idx, pi)], mesh, module=module, label=f"embedding pad={padding_idx}")
    weight = _g((10, 4), 3)
    for pw in layouts(mesh, 2):
        for pi in _index_layouts(mesh, 2):
            check(lambda w, i: F.embedding(i, w), [(weight, pw), (idx, pi)], mesh, label="sharded weight")
    check(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True), [(weight, None), (idx, layouts(mesh, 2)[0])],
          mesh, label="scale_grad_by_freq")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_embedding_with_sharded_indices_communicates_only_for_the_weight_gradient(ctx):
    mesh = ctx.mesh
    idx = _ints(10, (6, 4), seed=7)
    ispec = make_spec(mesh, (Shard(0),) * mesh.ndim, tuple(idx.shape), dtype=torch.int64)
    sidx = shard_from_global(idx, ispec)
    emb = torch.nn.Embedding(10, 4, dtype=torch.float64)
    with count_collectives() as c:
        out = emb(sidx)
    assert c.total_calls == 0
    assert out.placements == (Shard(0),) * mesh.ndim and out._spec.dim_sizes[0] == ispec.dim_sizes[0]
    with count_collectives() as c:
        torch.autograd.backward([out], [shard_from_global(torch.ones(6, 4, 4, dtype=torch.float64), out._spec)])
    assert set(c.calls) <= {"all_reduce"} and c.total_calls == mesh.ndim  # the promoted weight's pending sum
    assert not hasattr(emb.weight.grad, "_spec")
    expected = torch.zeros(10, 4, dtype=torch.float64).index_add_(0, idx.reshape(-1), torch.ones(24, 4, dtype=torch.float64))
    assert torch.equal(emb.weight.grad, expected)


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_errors_are_clear(ctx):
    mesh = ctx.mesh
    x = shard_from_global(_g(), make_spec(mesh, (Shard(0),) * mesh.ndim, SHAPE))
    with pytest.raises(IndexError, match="out of bounds for dim 0 with size 7"):
        x.index_select(0, torch.tensor([1, 7]))
    with pytest.raises(IndexError, match="out of bounds"):
        x[torch.tensor([-8])]
    with pytest.raises(NotImplementedError, match="nonzero"):
        x[x[:, :, 0] > 0, torch.tensor([0])]
    with pytest.raises(NotImplementedError, match="ShardTensor has no rule"):
        x.index_fill(0, torch.tensor([1]), 0.0)
