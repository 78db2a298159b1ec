"""Sharded dot product: each rank sums its piece's products; the result is a pending sum (Partial) until read.

    python examples/minimal/dot_product.py                               # starts 4 ranks itself
    torchrun --standalone --nproc-per-node 4 examples/minimal/dot_product.py
"""

import sys
from pathlib import Path

import torch

from physicsnemo_dp import Shard, count_collectives, scatter_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import on_ranks  # noqa: E402  (torchrun's ranks, or ranks started here)


def main(mesh):
    torch.manual_seed(0)  # the same vectors on every rank, to check the answer
    u, v = torch.randn(1001, dtype=torch.float64), torch.randn(1001, dtype=torch.float64)
    # rank 0 holds the data and scatters it: 1001 over 4 ranks is 251, 251, 251, 248 (torch.chunk's rule)
    x = scatter_tensor(u.to(mesh.device_type), 0, mesh, [Shard(0)])
    y = scatter_tensor(v.to(mesh.device_type), 0, mesh, [Shard(0)])
    with count_collectives() as counter:
        dot = torch.dot(x, y)  # local dot products: no communication yet
    assert counter.total_calls == 0
    print(f"rank {mesh.get_local_rank()}: {x.to_local().numel()} elements, placement {dot.placements}")
    with count_collectives() as counter:
        value = dot.full_tensor()  # one all-reduce of a scalar
    assert counter.total_calls == 1 and torch.allclose(value.cpu(), u @ v)
    return value.item()


if __name__ == "__main__":
    on_ranks(main, show="u . v =")
