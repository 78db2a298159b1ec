"""Random ops on ShardTensors equal the single-process counter-based reference for every layout.

Every layout of every world size (1-4, 2x2) is compared with the same plain
reference, so the draws are equal across decompositions (bitwise: ``torch.equal``):
uneven splits with empty shards, chunked splits, every sharded dim, nested
sharding on the 2x2 mesh, Replicate (every rank computes the whole tensor) and
Partial inputs.
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor
from tests._harness import EVERY_WORLD_SIZE, distributed

from ..ops._diff import layouts
from ._ref import reference, reference_words, sharded

SHAPE = (7, 5, 3)
SEED = 11

#: (label, op on a tensor, reference kind, params)
OPS = [
    ("randn_like", lambda x: torch.randn_like(x), "normal", {}),
    ("rand_like", lambda x: torch.rand_like(x), "uniform", {}),
    ("randint_like", lambda x: torch.randint_like(x, 3, 10), "integers", {"low": 3, "high": 10}),
    ("randint_like(high)", lambda x: torch.randint_like(x, 6), "integers", {"low": 0, "high": 6}),
    ("normal_", lambda x: x.normal_(2.0, 3.0), "normal", {"mean": 2.0, "std": 3.0}),
    ("uniform_", lambda x: x.uniform_(-1.0, 2.0), "uniform", {"from": -1.0, "to": 2.0}),
    ("bernoulli_", lambda x: x.bernoulli_(0.3), "bernoulli", {"p": 0.3}),
    ("bernoulli(p)", lambda x: torch.bernoulli(x, 0.7), "bernoulli", {"p": 0.7}),
    ("exponential_", lambda x: x.exponential_(2.0), "exponential", {"lambd": 2.0}),
    ("cauchy_", lambda x: x.cauchy_(1.0, 0.5), "cauchy", {"median": 1.0, "sigma": 0.5}),
    ("log_normal_", lambda x: x.log_normal_(0.5, 0.25), "log_normal", {"mean": 0.5, "std": 0.25}),
    ("geometric_", lambda x: x.geometric_(0.2), "geometric", {"p": 0.2}),
    ("random_(from,to)", lambda x: x.random_(-4, 7), "integers", {"low": -4, "high": 7}),
    ("random_(to)", lambda x: x.random_(9), "integers", {"low": 0, "high": 9}),
]


def _global(dtype, seed=0):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _run(ctx, fn, placements, dtype, kind="uneven", salt=0):
    x = sharded(_global(dtype).to(ctx.device), ctx.mesh, placements, kind, salt)
    torch.manual_seed(SEED)
    out = fn(x)
    assert isinstance(out, ShardTensor)
    assert not any(p.is_partial() for p in out.placements)
    assert tuple(out._local_tensor.shape) == tuple(out._spec.local_shape)
    return out.full_tensor()


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_random_ops_equal_the_reference_on_every_layout(ctx):
    every = layouts(ctx.mesh, 3, partial=True)
    for label, fn, kind, params in OPS:
        # float64 on every layout with uneven sizes and empty shards; float32 and the chunk split on a few
        for dtype, split, cases in ((torch.float64, "uneven", every), (torch.float32, "chunk", every[:2] + every[-2:])):
            expected = reference(kind, SHAPE, dtype, SEED, ctx.device, **params)
            for placements in cases:
                got = _run(ctx, fn, placements, dtype, split)
                assert torch.equal(got, expected), f"{label} {placements} {split} {dtype}"


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_half_complex_and_integer_dtypes(ctx):
    for dtype in (torch.float16, torch.bfloat16):
        expected = reference("uniform", SHAPE, dtype, SEED, ctx.device)
        for placements in layouts(ctx.mesh, 3)[:3]:
            x = sharded(_global(torch.float32).to(dtype), ctx.mesh, placements)
            torch.manual_seed(SEED)
            got = torch.rand_like(x).full_tensor()
            assert torch.equal(got, expected), f"{dtype} {placements}"
            assert got.max() < 1
    z_ref = reference("normal", SHAPE, torch.complex64, SEED, ctx.device)
    for placements in layouts(ctx.mesh, 3)[:3]:
        x = sharded(_global(torch.float32).to(torch.complex64), ctx.mesh, placements)
        torch.manual_seed(SEED)
        assert torch.equal(torch.randn_like(x).full_tensor(), z_ref), placements
        xi = sharded(torch.zeros(SHAPE, dtype=torch.int64), ctx.mesh, placements)
        torch.manual_seed(SEED)
        ints = xi.random_(0, 50).full_tensor()
        assert torch.equal(ints, reference("integers", SHAPE, torch.int64, SEED, ctx.device, low=0, high=50))


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_generator_argument_and_tensor_parameters(ctx):
    probs = torch.rand(SHAPE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mean, std = _global(torch.float64, 4), _global(torch.float64, 5).abs()
    u = reference_words(SHAPE, SEED, ctx.device)
    z = reference("normal", SHAPE, torch.float64, SEED, ctx.device)
    for placements in layouts(ctx.mesh, 3):
        x = sharded(_global(torch.float64), ctx.mesh, placements)
        g = torch.Generator(device=ctx.device).manual_seed(SEED)
        state = torch.get_rng_state()
        got = torch.randn_like(x, generator=g).full_tensor()
        assert torch.equal(torch.get_rng_state(), state), "a generator= draw advanced the default generator"
        assert torch.equal(got, z)
        # p as a tensor: sharded like x, sharded otherwise, plain, broadcast
        for p in (sharded(probs, ctx.mesh, placements), sharded(probs, ctx.mesh, layouts(ctx.mesh, 3)[0], salt=3), probs):
            torch.manual_seed(SEED)
            got = torch.bernoulli(p if isinstance(p, ShardTensor) else sharded(probs, ctx.mesh, placements)).full_tensor()
            assert torch.equal(got, (u < probs).to(torch.float64)), placements
            torch.manual_seed(SEED)
            got = x.clone().bernoulli_(p).full_tensor()
            assert torch.equal(got, (u < probs).to(torch.float64)), placements
        column = probs[:, :1, :1].contiguous()
        torch.manual_seed(SEED)
        got = x.clone().bernoulli_(column).full_tensor()
        assert torch.equal(got, (u < column).to(torch.float64))
        # normal with tensor mean / std
        ms, ss = sharded(mean, ctx.mesh, placements), sharded(std, ctx.mesh, placements, salt=2)
        for a, b, ra, rb in ((ms, ss, mean, std), (ms, 2.0, mean, 2.0), (0.5, ss, 0.5, std), (ms, std, mean, std)):
            torch.manual_seed(SEED)
            got = torch.normal(a, b).full_tensor()
            assert torch.allclose(got, z * rb + ra, rtol=0, atol=1e-12), placements


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_bad_arguments_raise_torchs_error_on_every_rank(ctx):
    x = sharded(_global(torch.float32), ctx.mesh, layouts(ctx.mesh, 3)[0])
    before = torch.get_rng_state()
    for fn, message in (
        (lambda: x.normal_(0, -1), "std >= 0"),
        (lambda: x.uniform_(2, 1), "from=2"),
        (lambda: x.bernoulli_(1.5), "p to be in"),
        (lambda: x.exponential_(-1), "lambda > 0"),
        (lambda: x.geometric_(2.0), "p to be in"),
        (lambda: torch.randint_like(x, 5, 2), "random_ expects"),
        (lambda: x.bernoulli_(torch.full(SHAPE, 2.0)), "probability"),
    ):
        with pytest.raises(RuntimeError, match=message):
            fn()
    assert torch.equal(torch.get_rng_state(), before), "a refused call advanced the generator"
    # a probability out of range on one rank only: every rank raises the same error
    probs = torch.full(SHAPE, 0.5)
    probs[-1, -1, -1] = 1.5
    with pytest.raises(RuntimeError, match="probability"):
        torch.bernoulli(sharded(probs, ctx.mesh, layouts(ctx.mesh, 3)[0]))


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_native_dropout_matches_formula_and_gradient(ctx):
    p = 0.3
    G = _global(torch.float64)
    keep = reference_words(SHAPE, SEED, ctx.device) < 1 - p
    for placements in layouts(ctx.mesh, 3, partial=True):
        x = sharded(G, ctx.mesh, placements, requires_grad=True)
        torch.manual_seed(SEED)
        out, mask = torch.native_dropout(x, p, True)
        assert torch.equal(mask.full_tensor(), keep), placements
        assert torch.allclose(out.full_tensor(), G * keep / (1 - p), rtol=0, atol=1e-12)
        w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        out.backward(sharded(w, ctx.mesh, tuple(Replicate() if q.is_partial() else q for q in placements)))
        assert torch.allclose(x.grad.full_tensor(), w * keep / (1 - p), rtol=0, atol=1e-12)
        out, mask = torch.native_dropout(x, p, False)
        assert torch.equal(out.full_tensor(), G) and bool(mask.full_tensor().all())


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_empty_shards_and_empty_tensors(ctx):
    mesh = ctx.mesh
    x = sharded(torch.zeros(1, 4), mesh, (Shard(0),) * mesh.ndim, kind="chunk")  # ranks past the first hold nothing
    torch.manual_seed(SEED)
    assert torch.equal(torch.randn_like(x).full_tensor(), reference("normal", (1, 4), torch.float32, SEED, ctx.device))
    e = sharded(torch.zeros(0, 3), mesh, (Shard(1),) * mesh.ndim, kind="chunk")
    state = torch.get_rng_state()
    assert torch.randn_like(e).full_tensor().shape == (0, 3)
    assert not torch.equal(torch.get_rng_state(), state), "an empty draw must still take its key (ranks stay in step)"
