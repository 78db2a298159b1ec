"""The EDM sampler and loss on ShardTensor latents equal one process, for every decomposition.

Each body runs the same seeded code twice on every rank: on ShardTensors cut
into deliberately uneven shards (empty ones on 4 ranks; rows on 1-D meshes,
rows and columns on the 2x2 mesh) and on the whole plain tensors. The random
draws (initial latents, churn noise, training noise) come from
``physicsnemo_dp.random``, whose values depend only on the generator state and
the global element index, so the sharded sample must equal the plain one — and
therefore every world size's sample equals every other's (ws1 is a ShardTensor
on a 1-rank mesh).
"""

from __future__ import annotations

import math

import pytest
import torch

import physicsnemo_dp
from physicsnemo_dp import ShardTensor
from physicsnemo_dp.pipelines import HeunSampler, edm_loss
from physicsnemo_dp.random import randn_like
from tests._harness import EVERY_WORLD_SIZE, distributed, run_job

from ._nets import SHAPE, denoiser, global_tensor, placements, shard

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-4)}
SAMPLER = HeunSampler(num_steps=4, S_churn=8.0, S_min=0.01, S_max=50.0)  # churn on 3 of the 4 steps


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@distributed(world_sizes=EVERY_WORLD_SIZE, timeout=120)
def test_sample_matches_one_process(ctx, dtype):
    """Latents drawn sharded (O(local)), churn noise every step: the plain run's sample, bitwise-close."""
    net = denoiser(dtype)
    cond_plain = global_tensor(1, dtype)
    cond = shard(cond_plain, ctx.mesh, salt=3)
    latents = randn_like(cond, generator=_generator(7))  # the condition's (uneven) layout
    assert isinstance(latents, ShardTensor) and latents.to_local().shape == cond.to_local().shape
    sample = SAMPLER.sample(net, latents, cond, generator=_generator(8))
    reference = SAMPLER.sample(net, randn_like(cond_plain, generator=_generator(7)), cond_plain,
                               generator=_generator(8))  # fmt: skip
    assert isinstance(sample, ShardTensor) and sample.placements == cond.placements
    assert sample.to_local().shape == cond.to_local().shape
    torch.testing.assert_close(sample.full_tensor(), reference, **TOL[dtype])
    assert not torch.equal(reference, SAMPLER.sample(net, randn_like(cond_plain, generator=_generator(7)), cond_plain,
                                                     generator=_generator(9)))  # the churn noise matters  # fmt: skip


@distributed(world_sizes=(4,), mesh_2d=True, timeout=120)
def test_latents_from_the_factory(ctx):
    """``physicsnemo_dp.randn(global_shape, mesh, placements)`` latents (chunk split) give the plain run's sample."""
    net = denoiser()
    cond_plain = global_tensor(1)
    latents = physicsnemo_dp.randn(SHAPE, ctx.mesh, placements(ctx.mesh), dtype=torch.float64, generator=_generator(7))
    cond = ShardTensor.from_local(cond_plain[tuple(slice(o, o + n) for o, n in
                                                   zip(latents._spec.local_offsets(), latents.to_local().shape))],
                                  ctx.mesh, placements(ctx.mesh), sharding_shapes="infer")  # fmt: skip
    sample = SAMPLER.sample(net, latents, cond, generator=_generator(8))
    plain_latents = physicsnemo_dp.randn(SHAPE, dtype=torch.float64, generator=_generator(7))
    reference = SAMPLER.sample(net, plain_latents, cond_plain, generator=_generator(8))
    torch.testing.assert_close(sample.full_tensor(), reference, **TOL[torch.float64])


def _sample_body(ctx):
    """One world size's sample, gathered (for the cross-world-size comparison in the test process)."""
    cond = shard(global_tensor(1, torch.float32), ctx.mesh, salt=1)
    latents = randn_like(cond, generator=_generator(7))
    return SAMPLER.sample(denoiser(torch.float32), latents, cond, generator=_generator(8)).full_tensor()


def test_same_sample_for_every_world_size():
    """P = 1, 2, 3, 4 and 2x2 in float32: the same sample (ws1 = a ShardTensor on a 1-rank mesh)."""
    samples = {shape: run_job(math.prod(shape), shape, __name__, "_sample_body", {}, timeout=120)[0].value
               for shape in [(1,), (2,), (3,), (4,), (2, 2)]}  # fmt: skip
    first = samples[(1,)]
    for shape, sample in samples.items():
        torch.testing.assert_close(sample, first, **TOL[torch.float32], msg=lambda m: f"mesh {shape}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@distributed(world_sizes=EVERY_WORLD_SIZE, timeout=120)
def test_loss_and_gradients_match_one_process(ctx, dtype):
    """EDM loss with its own draws (log-normal sigma, sharded noise): value and weight gradients of one process."""
    sharded_net, plain_net = denoiser(dtype), denoiser(dtype)
    target_plain, cond_plain = global_tensor(2, dtype), global_tensor(1, dtype)
    loss = edm_loss(sharded_net, shard(target_plain, ctx.mesh, salt=2), shard(cond_plain, ctx.mesh, salt=5),
                    generator=_generator(11))  # fmt: skip
    reference = edm_loss(plain_net, target_plain, cond_plain, generator=_generator(11))
    loss.backward()
    reference.backward()
    value = loss.full_tensor() if isinstance(loss, ShardTensor) else loss
    torch.testing.assert_close(value, reference, **TOL[dtype])
    for (name, p), q in zip(sharded_net.named_parameters(), plain_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL[dtype], msg=lambda m: f"{name}: {m}")
