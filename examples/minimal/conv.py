"""Sharded convolution: an unmodified ``nn.Conv2d`` on an image split by rows; only halo rows move.

    python examples/minimal/conv.py                                      # starts 4 ranks itself
    torchrun --standalone --nproc-per-node 4 examples/minimal/conv.py
"""

import sys
from pathlib import Path

import torch
from torch import nn

from physicsnemo_dp import Shard, count_collectives, scatter_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import on_ranks  # noqa: E402  (torchrun's ranks, or ranks started here)


def main(mesh):
    torch.manual_seed(0)  # the same image and weights on every rank
    image = torch.randn(1, 3, 30, 20, device=mesh.device_type)
    conv = nn.Conv2d(3, 8, kernel_size=3, padding=1).to(mesh.device_type)
    x = scatter_tensor(image, 0, mesh, [Shard(2)])  # rows: 8, 8, 8, 6
    with count_collectives() as counter:
        y = conv(x)  # each rank gets 1 neighbour row per side, then convolves locally
    y.sum().backward()  # the weight's gradient is summed over the ranks: a plain tensor, like the weight
    reference = nn.functional.conv2d(image, conv.weight, conv.bias, padding=1)
    assert torch.allclose(y.full_tensor(), reference, atol=1e-5)
    assert torch.allclose(conv.weight.grad, torch.autograd.grad(reference.sum(), conv.weight)[0], atol=1e-4)
    print(f"rank {mesh.get_local_rank()}: rows {x.to_local().shape[2]}, collectives {counter.summary()}")
    return tuple(y.shape), float(conv.weight.grad.abs().sum())


if __name__ == "__main__":
    on_ranks(main, show="output shape, |weight grad| =")
