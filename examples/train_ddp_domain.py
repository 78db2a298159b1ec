"""Train a small token model on a ("ddp", "domain") mesh: the whole training-script flow.

    torchrun --standalone --nproc-per-node 4 examples/train_ddp_domain.py               # (2, 2) mesh, DDP
    torchrun --standalone --nproc-per-node 4 examples/train_ddp_domain.py --strategy fsdp2 --bf16 --checkpointing
    python examples/train_ddp_domain.py                                                # one process, same code

Each ddp rank trains on different samples; each sample's tokens are split
over the domain ranks as a ShardTensor. The script only *describes* how to
run (one MeshContext) and calls ``parallelize_model``; the model never sees
meshes, wrappers or process groups.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from physicsnemo_dp import ShardTensor, Shard, chunk_sizes
from physicsnemo_dp.distributed import (
    MeshContext,
    MixedPrecisionPolicy,
    parallelize_model,
    query_capabilities,
)

if str(Path(__file__).resolve().parent) not in sys.path:  # also when loaded by path, not run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _flags  # noqa: E402  (the examples' checked flag types)


# ---------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + nn.functional.gelu(self.lin(x))


class TokenMLP(nn.Module):
    """Token-wise MLP over (batch, tokens, features): every op is exact on a token split."""

    @dataclass(frozen=True)
    class ModelCapabilities:  # verified by tests/distributed/test_training.py
        supports_domain: bool = True
        supports_ddp: bool = True
        supports_fsdp2: bool = True

    def __init__(self, features: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))  # FSDP units / checkpointing
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


# ----------------------------------------------------------------- the data
def global_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression batch (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.batch, args.tokens, args.features, generator=g)
    target = torch.sin(x.sum(-1, keepdim=True))
    return x, target


def shard_for_this_rank(t: torch.Tensor, context: MeshContext, device) -> ShardTensor:
    """This ddp rank's samples, with their tokens split over the domain axis (no communication).

    A real pipeline reads only this slab from disk; here it is cut from the
    global batch with the library's split rule.
    """
    mine = t.tensor_split(context.ddp_size)[context.ddp_rank]
    sizes = chunk_sizes(mine.shape[1], context.domain_size)
    start = sum(sizes[: context.domain_rank])
    local = mine[:, start : start + sizes[context.domain_rank]].to(device)
    return ShardTensor.from_local(
        local, context.domain_mesh, [Shard(1)], sharding_shapes="chunk", global_shape=tuple(mine.shape)
    )


# ----------------------------------------------------------------- the flow
def parse_args(argv=None):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain-size", type=_flags.integer(1), default=2 if world % 2 == 0 else 1,
                        help="ranks that split one sample (default 2 when the world size is even, else 1); "
                             "the ddp size is world size / domain size")  # fmt: skip
    parser.add_argument("--strategy", choices=["ddp", "fsdp2", "none"], default="ddp", help="data-parallel wrapper on the ddp axis")
    parser.add_argument("--bf16", action="store_true", help="FSDP2 only: bf16 compute, fp32 gradient reduction")
    parser.add_argument("--checkpointing", action="store_true", help="recompute block activations in backward")
    parser.add_argument("--steps", type=_flags.integer(1), default=5)
    parser.add_argument("--batch", type=_flags.integer(1), default=4, help="global batch (split over the ddp ranks)")
    parser.add_argument("--tokens", type=_flags.integer(1), default=33, help="tokens per sample (split over the domain ranks)")
    parser.add_argument("--features", type=_flags.integer(1), default=3)
    parser.add_argument("--hidden", type=_flags.integer(1), default=16)
    parser.add_argument("--depth", type=_flags.integer(1), default=2)
    parser.add_argument("--lr", type=_flags.real(0, inclusive=False), default=0.05)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="collective timeout in seconds: a rank that stops makes the others fail after it")
    args = parser.parse_args(argv)
    if args.bf16 and args.strategy != "fsdp2":
        parser.error("--bf16 needs --strategy fsdp2 (FSDP2 applies the mixed-precision policy)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # 1. one resolved runtime input: mesh + strategy + policies
    context = MeshContext.build(
        domain_size=args.domain_size,
        strategy=None if args.strategy == "none" else args.strategy,
        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None,
        activation_checkpointing=args.checkpointing,
        timeout=args.timeout,
    )
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"mesh (ddp={context.ddp_size}, domain={context.domain_size}), strategy={args.strategy}, "
              f"bf16={args.bf16}, checkpointing={args.checkpointing}", flush=True)  # fmt: skip

    # 2. build the model (any seed: parallelize synchronizes the weights), check what it supports
    torch.manual_seed(dist.get_rank())
    model = TokenMLP(args.features, args.hidden, args.depth).to(context.device)
    capabilities = query_capabilities(model)

    # 3. parallelize, then build the optimizer over the parallelized parameters
    model = parallelize_model(model, context)
    if capabilities.supports_compile:
        model = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # 4. train: each rank feeds its ddp share of the samples, tokens split over domain
    for step in range(args.steps):
        x, target = (shard_for_this_rank(t, context, context.device) for t in global_batch(step, args))
        loss = (model(x).float() - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.full_tensor().detach()  # this ddp rank's samples, all of their tokens
        dist.all_reduce(value, group=context.ddp_mesh.get_group())
        if rank0:
            print(f"step {step}: loss {value.item() / context.ddp_size:.6f}", flush=True)

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
