"""Swin-style window attention (timm's window_partition / window_reverse, relative position bias, shifted
windows with torch.roll and the attention mask) on a feature map sharded along H, with shard boundaries
that cut windows: values and every gradient equal one process, and only the rows of the cut windows move.

``window_partition`` views ``(B, H, W, C)`` as ``(B, H // ws, ws, W // ws, ws, C)``; on shards that are
not whole windows the view moves each shard boundary to the nearest window edge (``_reshape.rounded_table``:
one all-to-all of fewer than ``ws / 2`` rows per boundary), so every rank holds whole windows and the
attention (``q @ k.transpose(-2, -1)``, softmax, ``attn @ v``) runs on local windows.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import count_collectives, implicit_gathers
from physicsnemo_dp._gathers import listening
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import OP_WORLD_SIZES, check
from ._swin import swin_pair

WS, C, HEADS = 4, 8, 2


def _full(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class _Records:
    def __init__(self):
        self.found = []

    def implicit_gather(self, record):
        self.found.append(record)


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_swin_blocks_match_one_process_on_shards_that_cut_windows(ctx):
    """A regular and a shifted block; uneven H shards (empty ones too) cut windows. 2 and 4 ranks: the
    traffic test below, which checks the values and every gradient too."""
    h, w = 20, 8
    if ctx.mesh.ndim == 1:
        cases = [(1, (Shard(1),))]
    else:  # domain along H with the ddp dim replicated, H nested over both mesh dims, batch x domain
        cases = [(1, (Replicate(), Shard(1))), (1, (Shard(1), Shard(1))), (2, (Shard(0), Shard(1)))]
    for b, placements in cases:
        with implicit_gathers("allow"):
            check(
                lambda m, x: m(x),
                [(_full((b, h, w, C)), placements)],
                ctx.mesh,
                module=swin_pair(C, (h, w), HEADS, WS),
                label=f"swin B={b}",
                salt=1,
            )


ROW_BYTES = 8 * C * 8  # one row of H: W x C float64 (W = 8)


@distributed(world_sizes=(2, 4), mesh_2d=False, timeout=120)
def test_swin_blocks_move_only_the_rows_of_cut_windows(ctx):
    """H = 108 = 27 windows: chunk shards of 54 (P=2) and 27 (P=4) rows both cut windows. Bytes each rank
    receives (forward + backward, both blocks) stay under one P-independent bound of rows, which is below
    a quarter of the feature map; no all-gather, no implicit gather; all-reduces only for parameter
    gradients. Values and every gradient equal one process."""
    b, h, w = 1, 108, 8
    model = swin_pair(C, (h, w), HEADS, WS)
    full = _full((b, h, w, C))
    spec = make_spec(ctx.mesh, (Shard(1),), full.shape, "chunk")
    assert any(s % WS for s in spec.dim_sizes[1])  # the shards cut windows
    x = shard_from_global(full, spec, requires_grad=True)
    with count_collectives() as counter, implicit_gathers("raise"), listening(_Records()) as sink:
        y = model(x)
        y.backward(torch.ones_like(y))
    assert sink.found == []
    assert set(counter.calls) <= {"all_to_all", "all_reduce"}, counter.summary()
    received = counter.bytes_received["all_to_all"]
    # A rank receives rows on its two boundaries: each window view (partition, and its reverse back to
    # the shortcut's layout) moves the rows of a cut window, <= WS / 2 per boundary; the shifted block's
    # two rolls move `shift` = WS / 2 rows each. Two blocks, forward and backward: a bound without P in it.
    views = 2 * 2 * 2 * (WS // 2) * 2  # blocks x views x boundaries x rows x (forward, backward)
    rolls = 2 * (WS // 2) * 2  # rolls x rows x (forward, backward)
    bound_rows = views + rolls
    assert received <= bound_rows * ROW_BYTES, (received / ROW_BYTES, counter.summary())
    assert received <= full.numel() * 8 / 4, counter.summary()
    # All-reduces: parameter gradients, and per block the gradient of the relative position bias as the
    # attention adds it (heads x N x N, N = WS * WS tokens; gathered from its table after the reduction):
    # sizes of the model, not of the feature map, counted as a ring moves them (2 (P - 1) / P).
    reduced = (sum(p.numel() for p in model.parameters()) + 2 * HEADS * (WS * WS) ** 2) * 8
    assert counter.bytes_received["all_reduce"] <= 2 * reduced, counter.summary()
    ref_model, ref_x = swin_pair(C, (h, w), HEADS, WS), full.clone().requires_grad_()
    ref = ref_model(ref_x)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y.full_tensor(), ref)
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
