"""Ops along one dim on uneven shards: softmax, scans, sort/topk, flip/roll, layer_norm."""

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import integer_tensor, make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 5, 3)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _every_dim(ctx, fn, name, data=None, partial=False):
    """``fn(x, d)`` along each dim of a 3-d input, for every layout."""
    for d in range(-1, 3):
        for placements in layouts(ctx.mesh, 3, partial=partial):
            check(lambda x: fn(x, d), [(_g() if data is None else data, placements)], ctx.mesh, label=f"{name} dim={d}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_softmax_and_log_softmax(ctx):
    _every_dim(ctx, lambda x, d: F.softmax(x, d), "softmax", partial=True)
    _every_dim(ctx, lambda x, d: torch.log_softmax(x, d), "log_softmax")
    mask = torch.zeros(SHAPE, dtype=torch.float64).masked_fill(_g(seed=3) > 1.0, float("-inf"))
    mask[..., 0] = 0.0  # every row keeps a finite entry along the last dim
    for placements in layouts(ctx.mesh, 3):
        check(lambda x, m: F.softmax(x + m, -1) * 2, [(_g(), placements), (mask, None)], ctx.mesh, label="masked softmax")
        check(lambda x: x.softmax(0, dtype=torch.float64), [(_g().float(), placements)], ctx.mesh, label="softmax dtype")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_cumsum_cumprod_logcumsumexp(ctx):
    _every_dim(ctx, lambda x, d: torch.cumsum(x, d), "cumsum", partial=True)
    _every_dim(ctx, lambda x, d: torch.cumprod(x, d), "cumprod")
    _every_dim(ctx, lambda x, d: torch.logcumsumexp(x, d), "logcumsumexp")
    zeros = _g().masked_fill(_g(seed=4) > 0.8, 0.0)  # cumprod through zeros
    _every_dim(ctx, lambda x, d: x.cumprod(d), "cumprod zeros", data=zeros)
    for placements in layouts(ctx.mesh, 3):
        check(lambda x: x.cumsum(0, dtype=torch.float64), [(_g().float(), placements)], ctx.mesh, label="cumsum dtype")
        ints = integer_tensor(SHAPE, 5).long()
        check(lambda x: x.cumsum(0), [(ints, placements)], ctx.mesh, grad=False, label="int cumsum")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_cummax_cummin_with_ties_and_nan(ctx):
    ties = integer_tensor(SHAPE, 6) / 4  # many equal values: the later index must win
    _every_dim(ctx, lambda x, d: torch.cummax(x, d), "cummax", data=ties)
    _every_dim(ctx, lambda x, d: x.cummin(d), "cummin", data=ties)
    with_nan = ties.clone()
    with_nan[2, 1, 0] = with_nan[5, 3, 2] = with_nan[0, 4, 1] = float("nan")
    for d in range(3):
        for placements in layouts(ctx.mesh, 3):
            check(lambda x: x.cummax(d), [(with_nan, placements)], ctx.mesh, grad=False, label=f"cummax nan {d}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_sort_and_argsort(ctx):
    _every_dim(ctx, lambda x, d: torch.sort(x, d), "sort")
    _every_dim(ctx, lambda x, d: x.sort(dim=d, descending=True), "sort desc")
    ties = integer_tensor(SHAPE, 7)
    _every_dim(ctx, lambda x, d: torch.sort(x, dim=d, stable=True), "stable sort", data=ties)
    for placements in layouts(ctx.mesh, 3):
        check(lambda x: torch.argsort(x, 1), [(_g(), placements)], ctx.mesh, grad=False, label="argsort")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_topk(ctx):
    for k in (1, 3):
        _every_dim(ctx, lambda x, d: torch.topk(x, k, d), f"topk k={k}")
        _every_dim(ctx, lambda x, d: x.topk(k, dim=d, largest=False), f"topk smallest k={k}")
    for placements in layouts(ctx.mesh, 3):  # unsorted: the same set of entries
        check(lambda x: x.topk(3, 0, sorted=False).values.sort(0).values, [(_g(), placements)], ctx.mesh, label="unsorted")
        check(lambda x: x.topk(7, 0).values, [(_g(), placements)], ctx.mesh, label="k = n")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_topk_bad_k_raises_on_every_rank(ctx):
    x = shard_from_global(_g(), make_spec(ctx.mesh, layouts(ctx.mesh, 3)[0], SHAPE))
    with pytest.raises(RuntimeError, match="out of range"):
        x.topk(8, 0)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_flip_and_roll(ctx):
    for dims in ((0,), (1,), (0, 2), (-1, 0, 1)):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(lambda x: torch.flip(x, dims), [(_g(), placements)], ctx.mesh, label=f"flip {dims}")
    for shifts, dims in ((1, 0), (-2, 0), (9, 0), (3, 1), ((2, -1), (0, 2)), (4, None)):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(lambda x: torch.roll(x, shifts, dims), [(_g(), placements)], ctx.mesh, label=f"roll {shifts} {dims}")
    for placements in layouts(ctx.mesh, 1):
        check(lambda x: x.flip(0).roll(3), [(_g((9,)), placements)], ctx.mesh, label="1-d")


class _AtenLayerNorm(torch.nn.LayerNorm):
    """nn.LayerNorm through ``torch.layer_norm`` (the ATen op), whatever handles ``F.layer_norm``."""

    def forward(self, x):
        return torch.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_layer_norm(ctx):
    torch.manual_seed(0)
    for normalized in ((3,), (5, 3)):
        for affine in (True, False):
            norm = _AtenLayerNorm(normalized, elementwise_affine=affine).double()
            if affine:
                with torch.no_grad():
                    norm.weight.normal_()
                    norm.bias.normal_()
            for placements in layouts(ctx.mesh, 3, partial=True):
                check(lambda m, x: m(x), [(_g(), placements)], ctx.mesh, module=norm, label=f"layer_norm {normalized}")
                norm.zero_grad(set_to_none=True)
    w, b = _g((3,), 1), _g((3,), 2)
    for placements in layouts(ctx.mesh, 3):
        check(lambda x, w, b: torch.layer_norm(x, (3,), w, b, 1e-3), [(_g(), placements), (w, None), (b, None)], ctx.mesh, label="weight grads")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_what_moves(ctx):
    """Unsharded dims communicate nothing; sharded ones move only reduced-size data."""
    mesh = ctx.mesh
    sharded = layouts(mesh, 3, dims=(0,))[0]  # dim 0 sharded (on every mesh dim on the 2x2 mesh)
    x = shard_from_global(_g(), make_spec(mesh, sharded, SHAPE), requires_grad=True)
    norm = _AtenLayerNorm(3).double()
    for fn in (lambda t: F.softmax(t, -1), lambda t: t.cumsum(2), lambda t: t.flip(1), lambda t: norm(t),
               lambda t: t.sort(1).values, lambda t: t.topk(2, 2).values):
        with count_collectives() as c:
            y = fn(x)
        assert c.total_calls == 0, c.summary()
        assert y._spec.dim_sizes[0] == x._spec.dim_sizes[0]
    n = sum(p.is_shard() for p in sharded)
    with count_collectives() as c:
        F.softmax(x, 0)
    assert c.calls == {"all_reduce": 2 * n}, c.summary()  # row max, then row sum
    with count_collectives() as c:
        x.cumsum(0)
    assert c.calls == {"all_gather": n}, c.summary()  # one slice per shard
    assert c.total_received <= 5 * 3 * 8 * (mesh.size() - 1)
    with count_collectives() as c:
        x.topk(2, 0)
    assert c.calls == {"all_gather": 2 * n}, c.summary()  # candidates: values and indices
    if mesh.ndim == 1:
        with count_collectives() as c:
            x.flip(0)
        assert c.calls == {"all_to_all": 1}, c.summary()  # each element moves once


@distributed(world_sizes=OP_WORLD_SIZES)
def test_rms_norm_through_its_decomposition(ctx):
    """F.rms_norm does not reach the dispatcher as one op: it runs as pow/mean/rsqrt/mul."""
    torch.manual_seed(0)
    for placements in layouts(ctx.mesh, 3):
        norm = torch.nn.RMSNorm(3).double()
        with torch.no_grad():
            norm.weight.normal_()
        check(lambda m, x: m(x), [(_g(), placements)], ctx.mesh, module=norm, label="RMSNorm")
