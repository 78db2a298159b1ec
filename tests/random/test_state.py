"""Generator state discipline: seeding, generator=, streams, fork_rng, checkpoints, recomputation, factories."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

import physicsnemo_dp as pdp
from physicsnemo_dp import PlacementError, ShardTensor, _philox, count_collectives
from physicsnemo_dp.checkpoint import load_checkpoint, save_checkpoint
from physicsnemo_dp.debug import checks
from tests._harness import EVERY_WORLD_SIZE, distributed

from ..ops._diff import layouts
from ._ref import reference, sharded

SHAPE = (9, 6)


def _x(ctx, placements, salt=0, requires_grad=False):
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(salt), dtype=torch.float64)
    return sharded(g.to(ctx.device), ctx.mesh, placements, salt=salt, requires_grad=requires_grad)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_draws_advance_every_ranks_generator_alike(ctx):
    torch.manual_seed(5)
    for i, placements in enumerate(layouts(ctx.mesh, 2)):
        x = _x(ctx, placements, salt=i)
        torch.randn_like(x)
        F.dropout(x, 0.5)
        x.uniform_()
    after = torch.get_rng_state()
    assert _same_on_every_rank(after), "ranks' generators diverged"
    # exactly one key per op, whatever the layout: the same state as the one-process count of keys
    torch.manual_seed(5)
    for _ in range(3 * len(layouts(ctx.mesh, 2))):
        _philox.draw_key("cpu")
    assert torch.equal(torch.get_rng_state(), after)
    torch.set_rng_state(after)
    layer = torch.nn.Linear(4, 3)  # weight init after sharded draws: the same everywhere
    assert _same_on_every_rank(layer.weight.detach())


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_fork_rng_and_manual_seed_replay(ctx):
    x = _x(ctx, layouts(ctx.mesh, 2)[0])
    torch.manual_seed(1)
    with torch.random.fork_rng():
        inside = torch.randn_like(x).full_tensor()
    outside = torch.randn_like(x).full_tensor()
    assert torch.equal(inside, outside)
    pdp.random.manual_seed(1, ctx.mesh)
    assert torch.equal(torch.randn_like(x).full_tensor(), outside)


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_checkpoint_resume_draws_the_same_numbers(ctx, tmp_path):
    x = _x(ctx, layouts(ctx.mesh, 2)[0])
    model = torch.nn.Linear(3, 2)
    torch.manual_seed(2)
    torch.randn_like(x)
    save_checkpoint(tmp_path, 1, model)
    expected = [torch.randn_like(x).full_tensor(), F.dropout(x, 0.3).full_tensor()]
    torch.manual_seed(99)  # anything in between
    torch.rand_like(x)
    restored = load_checkpoint(tmp_path, model)
    assert restored is not None and restored.rng_restored
    assert torch.equal(torch.randn_like(x).full_tensor(), expected[0])
    assert torch.equal(F.dropout(x, 0.3).full_tensor(), expected[1])


def _block(x):
    return F.dropout(x * 2.0, 0.4) * x


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_activation_checkpointing_replays_dropout(ctx):
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for placements in layouts(ctx.mesh, 2)[:3]:
        grads = []
        for mode in ("plain", "checkpoint", "no-rng-replay"):
            x = _x(ctx, placements, requires_grad=True)
            torch.manual_seed(4)
            if mode == "plain":
                y = _block(x)
            else:
                y = checkpoint(_block, x, use_reentrant=False, preserve_rng_state=mode == "checkpoint")
            y.backward(sharded(w, ctx.mesh, placements))
            grads.append(x.grad.full_tensor())
        assert torch.equal(grads[0], grads[1]), placements
        assert not torch.equal(grads[0], grads[2]), "the test must see a mask that is not replayed"


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_named_streams(ctx):
    x = _x(ctx, layouts(ctx.mesh, 2)[0])
    before = torch.get_rng_state()
    s = pdp.random.stream("noise", seed=3, device=ctx.device)
    a = torch.randn_like(x, generator=s.generator).full_tensor()
    assert torch.equal(torch.get_rng_state(), before), "a stream draw moved the default generator"
    again = pdp.random.stream("noise", seed=3, device=ctx.device)
    state = again.get_state()
    assert torch.equal(torch.randn_like(x, generator=again.generator).full_tensor(), a)
    other = pdp.random.stream("dropout", seed=3, device=ctx.device)
    assert not torch.equal(torch.randn_like(x, generator=other.generator).full_tensor(), a)
    # as a context manager the stream is the default generator inside the block (F.dropout has no generator=)
    again.set_state(state)
    with again:
        b = torch.randn_like(x).full_tensor()
        m = F.dropout(torch.ones_like(x), 0.5).full_tensor()
    assert torch.equal(b, a) and torch.equal(torch.get_rng_state(), before)
    ref = pdp.random.stream("noise", seed=3, device=ctx.device)
    torch.randn_like(x, generator=ref.generator)
    assert torch.equal(torch.ones_like(x).bernoulli_(0.5, generator=ref.generator).full_tensor() / 0.5, m)


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_factories_build_shards_without_communication(ctx):
    shape = (7, 5)
    mesh = ctx.mesh
    for placements in layouts(mesh, 2):
        torch.manual_seed(6)
        with count_collectives() as counter:
            z = pdp.randn(shape, mesh, placements, dtype=torch.float64, requires_grad=True)
            u = pdp.rand(shape, mesh, placements, dim_sizes=None)
            n = pdp.randint(-3, 4, shape, mesh, placements)
        assert counter.total_calls == 0, dict(counter.calls)
        assert isinstance(z, ShardTensor) and z.requires_grad and z.dtype == torch.float64
        assert tuple(z._local_tensor.shape) == tuple(z._spec.local_shape)
        torch.manual_seed(6)
        ref = [pdp.random.randn(shape, dtype=torch.float64), pdp.random.rand(shape), pdp.random.randint(-3, 4, shape)]
        for got, want in zip((z, u, n), ref):
            assert torch.equal(got.full_tensor().detach(), want)
    # explicit uneven sizes with an empty shard
    sizes = (0,) * (mesh.size(-1) - 1) + (7,)
    placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
    dim_sizes = (sizes, None)
    torch.manual_seed(6)
    z = pdp.randn(shape, mesh, placements, dim_sizes=dim_sizes)
    assert z._spec.dim_sizes == dim_sizes
    torch.manual_seed(6)
    assert torch.equal(z.full_tensor(), reference("normal", shape, torch.float32, 6))
    # randn_like of a plain tensor equals randn_like of any sharding of it
    x = _x(ctx, layouts(mesh, 2)[0])
    torch.manual_seed(8)
    plain = pdp.random.randn_like(torch.zeros(SHAPE, dtype=torch.float64))
    torch.manual_seed(8)
    assert torch.equal(pdp.random.randn_like(x).full_tensor(), plain)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_ranks_with_different_seeds_are_refused(ctx):
    with pytest.raises(PlacementError, match="different seeds"):
        pdp.random.manual_seed(ctx.rank, ctx.mesh)
    x = _x(ctx, layouts(ctx.mesh, 2)[0])
    ctx.seed(ctx.rank)  # a bug: ranks seeded differently
    torch.randn_like(x)  # unchecked by default (the check costs an all-gather per draw)
    with checks(), pytest.raises(PlacementError, match="generator differs across ranks"):
        torch.randn_like(x)
    ctx.seed(0)
    with checks():
        torch.randn_like(x)


def _noisy(x):
    return F.dropout(x * 2.0, 0.5) + torch.randn_like(x)


@distributed(world_sizes=(2,), mesh_2d=False, timeout=120)
def test_compiled_draws_equal_eager_draws(ctx):
    """Under torch.compile (aot_eager) the key draw stays in the graph: each call takes a fresh key, as eagerly."""
    x = _x(ctx, (Shard(0),))
    torch.manual_seed(0)
    eager = [_noisy(x).full_tensor() for _ in range(2)]
    compiled = torch.compile(_noisy, backend="aot_eager")
    torch.manual_seed(0)
    assert all(torch.equal(compiled(x).full_tensor(), e) for e in eager)
