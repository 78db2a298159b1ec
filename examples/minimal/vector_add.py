"""Sharded vector add: every rank holds its own, unevenly sized piece; ``a + b`` adds pieces, no communication.

    python examples/minimal/vector_add.py                                # starts 4 ranks itself
    torchrun --standalone --nproc-per-node 4 examples/minimal/vector_add.py
"""

import sys
from pathlib import Path

import torch

from physicsnemo_dp import Shard, ShardTensor, count_collectives

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import on_ranks  # noqa: E402  (torchrun's ranks, or ranks started here)


def main(mesh):
    rank = mesh.get_coordinate()[0]  # position in the mesh, which shard sizes are indexed by
    start = sum(range(1, rank + 1))  # rank r holds r + 1 elements: 1, 2, 3, 4
    piece = torch.arange(start, start + rank + 1, dtype=torch.float64, device=mesh.device_type)
    a = ShardTensor.from_local(piece, mesh, [Shard(0)])  # learns every shard's size (one small all-gather)
    b = ShardTensor.from_local(10 * piece, mesh, [Shard(0)])
    with count_collectives() as counter:
        c = a + b  # ordinary torch code on the whole (global) vectors
    assert counter.total_calls == 0 and c.to_local().shape == piece.shape
    full = c.full_tensor()  # gathered: exactly the elements each rank holds, no padding
    assert torch.equal(full.cpu(), 11 * torch.arange(full.numel(), dtype=torch.float64))
    print(f"rank {rank}: local {c.to_local().tolist()}  global shape {tuple(c.shape)}")
    return full.tolist()


if __name__ == "__main__":
    on_ranks(main, show="a + b =")
