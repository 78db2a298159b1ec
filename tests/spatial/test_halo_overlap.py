"""The overlapped seam convolution (halo in flight while the interior computes) against one process.

``overlap("on")`` forces the overlapped order at sizes where "auto" would
not take it; the results must be the single-device ones (forward, input and
parameter gradients, uneven shards with empty ones, the 2x2 mesh) and the
same bits as the sequential order.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensorSpec
from physicsnemo_dp.collectives import overlap, wait_clock
from tests._harness import distributed

from ..core._util import shard_from_global
from ..ops._diff import check
from ._cases import grid, spatial_layouts

CASES = [  # (conv, input shape, weight shape, kwargs): stride-1 "same" convs, the seam path's domain
    (F.conv2d, (2, 4, 11, 9), (6, 4, 3, 3), dict(padding=1)),
    (F.conv2d, (2, 4, 13, 7), (4, 2, 5, 5), dict(padding=4, dilation=2, groups=2)),
    (F.conv1d, (4, 17), (3, 4, 3), dict(padding=1)),  # unbatched
]


@distributed(world_sizes=(1, 2, 3, 4))
def test_overlapped_seam_conv_matches_one_process(ctx):
    for conv, shape, wshape, kw in CASES:
        x, w, b = grid(shape), grid(wshape, 1), grid((wshape[0],), 2)
        k = len(wshape) - 2
        for placements in spatial_layouts(ctx.mesh, len(shape), k, batch=len(shape) == k + 2 and k == 2):
            with overlap("on"):
                check(lambda x, w, b: conv(x, w, b, **kw), [(x, placements), (w, None), (b, None)], ctx.mesh,
                      label=f"overlapped {conv.__name__} {kw}")  # fmt: skip


def _run(mode, x, w, b, spec):
    xs = shard_from_global(x, spec, requires_grad=True)
    ws, bs = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    with overlap(mode):
        out = F.conv2d(xs, ws, bs, padding=1)
        out.backward(shard_from_global(grid(tuple(out.shape), 3), out._spec))
    return out, xs.grad, ws.grad, bs.grad


@distributed(world_sizes=(3,), mesh_2d=False)
def test_overlapped_and_sequential_orders_give_the_same_bits(ctx):
    """Only the order of a rank's work changes: forward and every gradient are bitwise equal; the path is the
    seam convolution on ranks with enough rows (rank 1 holds none) and the wait clock sees the halo waits."""
    x, w, b = grid((2, 4, 12, 6)), grid((5, 4, 3, 3), 1), grid((5,), 2)
    spec = ShardTensorSpec.from_sizes(ctx.mesh, (Shard(2),), tuple(x.shape), x.dtype, (None, None, (7, 0, 5), None))
    with wait_clock() as clock:
        on = _run("on", x, w, b, spec)
    off = _run("off", x, w, b, spec)
    if ctx.rank != 1:
        assert type(on[0].grad_fn).__name__.startswith("SeamConvFunction"), type(on[0].grad_fn).__name__
    for a, c in zip(on, off):
        assert torch.equal(a.to_local() if hasattr(a, "to_local") else a, c.to_local() if hasattr(c, "to_local") else c)
    # the forward exchange and its mirror (rank 1 receives and sends nothing: nothing to wait for)
    assert clock.waits["halo"] == (0 if ctx.rank == 1 else 2) and clock.total >= 0
    assert clock.waits["all_reduce"] == 1  # the weight's and bias's gradients, summed together (the stall check's wait)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_bad_overlap_mode_raises(ctx):
    with pytest.raises(ValueError, match="overlap mode must be one of"):
        with overlap("always"):
            pass
