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
from tests._harness import distributed

from ._models import (
    TokenNet,
    assert_close_states,
    assert_same_on_all_ranks,
    full_state,
    local_input,
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
