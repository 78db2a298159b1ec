"""Acceptance: training on a (2, 2) ("ddp", "domain") mesh equals one process on the whole batch.

Each ddp rank takes half of the samples; each sample's tokens are split
unevenly over the two domain ranks (ShardTensor inputs). Every rank starts
from *different* random weights, so the parallelizer's synchronization is part
of what is tested. After a few SGD steps the parameters must equal those of a
single-process run on the concatenated batch from rank 0's initial weights,
and be bitwise identical on all four ranks.
"""

import pytest
import torch

from physicsnemo_dp.distributed import DDPConfig, FSDP2Config, MeshContext, MixedPrecisionPolicy, parallelize_model
from physicsnemo_dp.promotion import clear_gradient_buckets
from physicsnemo_dp import ShardTensor
from tests._harness import distributed

from ._models import (
    TokenNet,
    assert_close_states,
    assert_same_on_all_ranks,
    full_state,
    local_input,
    loss_of,
    sample_batch,
    train,
)

STEPS = 3
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# strategy, mixed precision, tolerance, gradient_bucket_mb (the domain reductions: 25 MiB buckets by
# default, here all parameters in one; None: one all-reduce per layer call; 0.001: a bucket per few layers)
CASES = {
    "ddp": (DDPConfig(), None, 1e-5, 25.0),
    "fsdp2-fp32": (FSDP2Config(), None, 1e-5, 25.0),
    "fsdp2-bf16": (FSDP2Config(), BF16, 1e-2, 25.0),
    "ddp-checkpointed": (DDPConfig(), None, 1e-5, 25.0),
    "fsdp2-bf16-checkpointed": (FSDP2Config(), BF16, 1e-2, 25.0),
    "ddp-per-call": (DDPConfig(), None, 1e-5, None),
    "ddp-per-call-checkpointed": (DDPConfig(), None, 1e-5, None),
    "ddp-small-buckets-checkpointed": (DDPConfig(), None, 1e-5, 0.001),
}


def _reference(batches):
    torch.manual_seed(0)  # rank 0's initial weights
    model = TokenNet()
    losses = train(model, batches)
    return full_state(model), losses


@pytest.mark.parametrize("case", list(CASES))
@distributed(world_sizes=(), timeout=120)
def test_training_matches_single_process(ctx, case):
    strategy, policy, tol, bucket_mb = CASES[case]
    context = MeshContext.from_mesh(
        ctx.mesh, strategy=strategy, mixed_precision=policy, activation_checkpointing=case.endswith("checkpointed"),
        gradient_bucket_mb=bucket_mb,
    )
    batches = [sample_batch(seed=s) for s in range(STEPS)]
    expected, expected_losses = _reference(batches)

    torch.manual_seed(ctx.rank)  # every rank starts elsewhere: parallelize must synchronize
    model = parallelize_model(TokenNet(), context)
    try:
        losses = train(model, [local_input(b, context, salt=s) for s, b in enumerate(batches)])  # salt 0: an empty shard
    finally:
        clear_gradient_buckets()

    inner = getattr(model, "module", model)
    checkpointed = case.endswith("checkpointed")
    assert [b.calls for b in inner.blocks] == [STEPS * (2 if checkpointed else 1)] * 2  # recomputed in backward
    actual = full_state(model)
    assert_close_states(actual, expected, atol=tol, rtol=tol)
    assert_same_on_all_ranks(actual)
    # this rank's loss is over its ddp half of the batch; the two halves average to the reference
    halves = torch.tensor(losses)
    gathered = [torch.empty_like(halves) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(gathered, halves)
    mean = (gathered[0] + gathered[2]) / 2  # ddp ranks 0 and 1 at domain rank 0
    assert torch.allclose(mean, torch.tensor(expected_losses), atol=tol, rtol=tol)


def _bf16_single_process(batch, ddp_size):
    """One process under bf16, as FSDP2's policy computes: bf16 weights and inputs, each ddp share's gradients
    in bf16, averaged over the shares in fp32 (``reduce_dtype``)."""
    torch.manual_seed(0)
    model = TokenNet().to(torch.bfloat16)
    grads = {}
    for share in batch.tensor_split(ddp_size):
        model.zero_grad()
        loss_of(model(share.to(torch.bfloat16))).backward()
        for name, p in model.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad.float() / ddp_size
    return grads


#: bf16 units in the last place, relative to a gradient's largest magnitude (measured: at most 0.74)
ULPS = 4


@pytest.mark.parametrize("salt", [0, 1])  # 0: domain rank 0's shard is empty; 1: both non-empty, uneven
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
@distributed(world_sizes=(), timeout=120)
def test_fsdp2_mixed_precision_policy_composes_with_the_domain(ctx, reduce_dtype, salt):
    """``MeshContext(mixed_precision=MixedPrecisionPolicy(bf16, reduce_dtype))`` on the 2x2 mesh, ShardTensor input.

    One step's gradients equal those of the same model under plain FSDP2 with the same policy (each ddp rank's
    samples whole, no domain) and of one process under bf16, within bf16 tolerance; the weights are bf16 in the
    forward and the input is cast to bf16; with ``reduce_dtype=float32`` the ddp average is taken in fp32 (the
    mean of two bf16 gradients is generally not a bf16 number), with bf16 every gradient is a bf16 number.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    context = MeshContext.from_mesh(ctx.mesh, strategy=FSDP2Config(), mixed_precision=policy)
    batch = sample_batch(seed=5)

    def step(x):
        torch.manual_seed(0)
        model = parallelize_model(TokenNet(), context)
        seen = []
        model.inp.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, args[0].dtype, type(out))))
        loss_of(model(x)).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        return seen, grads, {p.grad.dtype for p in model.parameters()}

    seen, grads, grad_dtypes = step(local_input(batch, context, salt=salt))
    assert seen == [(torch.bfloat16, torch.bfloat16, ShardTensor)]  # bf16 weights meet the cast ShardTensor input
    assert grad_dtypes == {torch.float32}  # the sharded gradients are the fp32 parameters' dtype
    plain_seen, plain, _ = step(batch.tensor_split(context.ddp_size)[context.ddp_rank])  # plain FSDP2, no domain
    assert plain_seen == [(torch.bfloat16, torch.bfloat16, torch.Tensor)]
    single = _bf16_single_process(batch, context.ddp_size)
    for name, g in grads.items():
        tol = ULPS * torch.finfo(torch.bfloat16).eps * max(single[name].abs().max().item(), 1e-3)
        for what, ref in (("plain FSDP2", plain[name]), ("one process", single[name])):
            diff = (g - ref).abs().max().item()
            assert diff <= tol, f"{name} vs {what}: max abs diff {diff:.3e} > {tol:.3e}"
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    off_grid = (flat != flat.to(torch.bfloat16).float()).sum().item()  # values a bf16 reduction cannot produce
    if reduce_dtype == torch.float32:
        assert off_grid > flat.numel() // 4, f"{off_grid} of {flat.numel()} gradients off the bf16 grid"
    else:
        assert off_grid == 0
    assert_same_on_all_ranks(grads)
