"""Python values out of ShardTensors (``.item()``, ``float``, ``int``, ``bool``, ``.tolist()``, ``torch.equal``).

Each value is compared with the same call on the global tensor in one process,
on every layout (sharded with empty shards, replicated, pending sums) and dtype;
replicated tensors answer without communicating, and misuse raises the same
error on every rank.
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import count_collectives, scatter_tensor
from tests._harness import distributed

from ..core._util import integer_tensor, make_spec, shard_from_global
from ._diff import layouts

DTYPES = (torch.float64, torch.float32, torch.int64, torch.complex128, torch.bool)


def _global(shape, dtype, seed=0):
    t = integer_tensor(shape, seed=seed)
    if dtype == torch.bool:
        return t > 0
    return t.to(dtype)


def _converters(dtype):
    yield "item", lambda t: t.item()
    yield "bool", bool
    if not dtype.is_complex:
        yield "float", float
        yield "int", int
    else:
        yield "complex", complex


@distributed(world_sizes=(1, 2, 3, 4))
def test_scalar_conversions_match_one_process(ctx):
    for shape in ((1,), (1, 1), ()):
        for dtype in DTYPES:
            g = _global(shape, dtype, seed=3)
            partial = dtype not in (torch.bool,) and len(shape) > 0
            for placements in layouts(ctx.mesh, max(len(shape), 1), partial=partial):
                if len(shape) == 0 and any(p.is_shard() for p in placements):
                    continue
                x = shard_from_global(g, make_spec(ctx.mesh, placements, shape, dtype=dtype))
                for name, convert in _converters(dtype):
                    got, want = convert(x), convert(g)
                    assert type(got) is type(want) and got == want, (name, shape, dtype, placements, got, want)


@distributed(world_sizes=(1, 2, 3, 4))
def test_loss_item_and_comparison_in_a_training_loop(ctx):
    ctx.seed(0)
    field = torch.randn(13, 6, dtype=torch.float64)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    x = scatter_tensor(field, 0, ctx.mesh, [Shard(0)] + [Replicate()] * (ctx.mesh.ndim - 1))
    loss = ((x * w) ** 2).mean()
    if ctx.world_size > 1:  # a pending sum: .item() resolves it collectively
        assert any(p.is_partial() for p in loss.placements)
    want = ((field * w) ** 2).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    best = float("inf")
    if loss < best:  # bool() of a comparison with a Python number
        best = loss.item()
    assert best == pytest.approx(want.item(), rel=1e-12)
    loss.backward()  # .item() on a tensor that requires grad leaves autograd alone
    w_ref = w.detach().clone().requires_grad_()
    ((field * w_ref) ** 2).mean().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


@distributed
def test_replicated_scalar_reads_locally(ctx):
    x = shard_from_global(torch.tensor([2.5]), make_spec(ctx.mesh, (Replicate(),) * ctx.mesh.ndim, (1,),
                                                          dtype=torch.float32))
    with count_collectives() as counter:
        assert x.item() == 2.5 and float(x) == 2.5 and bool(x) and x.tolist() == [2.5]
    assert not counter.calls, counter.summary()


@distributed
def test_tolist_matches_one_process_on_strided_locals(ctx):
    for dtype in (torch.float64, torch.int64, torch.bool):
        g = _global((7, 5), dtype, seed=1)
        for placements in layouts(ctx.mesh, 2, partial=dtype != torch.bool):
            x = shard_from_global(g, make_spec(ctx.mesh, placements, (7, 5), dtype=dtype))
            assert x.tolist() == g.tolist(), (dtype, placements)
            assert x.t().tolist() == g.t().tolist(), (dtype, placements)  # a transposed local view
            assert x[1:6:2].tolist() == g[1:6:2].tolist(), (dtype, placements)  # offset and strided


@distributed
def test_item_of_many_elements_raises_on_every_rank(ctx):
    spec = make_spec(ctx.mesh, (Shard(0),) + (Replicate(),) * (ctx.mesh.ndim - 1), (5,))
    x = shard_from_global(torch.arange(5.0, dtype=torch.float64), spec)
    with pytest.raises(RuntimeError, match="a Tensor with 5 elements cannot be converted to Scalar"):
        x.item()
    with pytest.raises(ValueError, match="only one element tensors"):  # torch's check of the global shape
        float(x)


@distributed
def test_equal_matches_one_process(ctx):
    g = integer_tensor((7, 5), seed=2)
    for placements in layouts(ctx.mesh, 2, partial=True):
        spec = make_spec(ctx.mesh, placements, (7, 5))
        x = shard_from_global(g, spec)
        assert torch.equal(x, x) and torch.equal(x, shard_from_global(g, spec))
        other = g.clone()
        other[6, 4] += 1  # differs in one element only: the rank holding it must tell the others
        assert not torch.equal(x, shard_from_global(other, make_spec(ctx.mesh, placements, (7, 5), salt=1)))
        assert torch.equal(x, g) and not torch.equal(x, other)  # plain tensors: every rank holds them whole
        assert not torch.equal(x, shard_from_global(g[:6], make_spec(ctx.mesh, placements, (6, 5))))
        assert not torch.equal(x, shard_from_global(g.float(), make_spec(ctx.mesh, placements, (7, 5),
                                                                         dtype=torch.float32)))
