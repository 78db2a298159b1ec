"""The opt-in gather fallback for ops without a rule (``physicsnemo_dp.fallback``).

Four ATen ops that have no ShardTensor rule (``histc``, ``_cdist_forward`` and
its backward, ``grid_sampler_2d`` and its backward, ``renorm``) run under
``fallback("gather")`` and give the forward and gradients of one process;
outputs shaped like an operand keep its layout, others are Replicate. The
fallback is an implicit gather: warned once per op by the mesh's first rank,
refused on every rank under ``implicit_gathers("raise")`` before any
collective. Without it the clear error stays, naming the fallback. One job
per world size.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import physicsnemo_dp
from physicsnemo_dp import ImplicitGatherError, ImplicitGatherWarning, count_collectives, implicit_gathers
from physicsnemo_dp import _gathers
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts


def _first_rank(mesh) -> bool:
    return all(c == 0 for c in mesh.get_coordinate())


@distributed(world_sizes=OP_WORLD_SIZES, mesh_2d=True)
def test_fallback(ctx):
    mesh = ctx.mesh
    ctx.seed(0)
    x = torch.randn(7, 5, dtype=torch.float64)
    rows = (Shard(0),) * mesh.ndim
    sx = shard_from_global(x, make_spec(mesh, rows, (7, 5), "uneven", dtype=torch.float64))

    # Off by default: the clear error, which names the way out and its cost.
    with pytest.raises(NotImplementedError, match=r"has no rule for aten.histc.default.*fallback\('gather'\)"):
        torch.histc(sx, 5)
    with physicsnemo_dp.fallback("gather"), physicsnemo_dp.fallback(None):  # nested: the inner block wins
        with pytest.raises(NotImplementedError, match="memory on every rank, an implicit gather"):
            torch.histc(sx, 5)
    with pytest.raises(ValueError, match="fallback mode must be one of"):
        physicsnemo_dp.fallback("scatter").__enter__()

    with physicsnemo_dp.fallback("gather"), implicit_gathers("allow"):
        # forward and gradients against one process; backward ops without a rule take the fallback too
        for placements in layouts(mesh, 2, partial=True):
            out = check(lambda t: torch.renorm(t, 2, 0, 1.0), [(x, placements)], mesh, label="renorm")
            assert out.placements == tuple(Replicate() if p.is_partial() else p for p in placements)
        check(lambda t: torch.histc(t, 6, -2.0, 2.0), [(x.float(), rows)], mesh, grad=False, label="histc")
        assert torch.histc(sx.float(), 6).placements == (Replicate(),) * mesh.ndim  # another shape: Replicate
        y = torch.randn(4, 5, dtype=torch.float64)
        for placements in layouts(mesh, 2)[:3]:
            check(lambda a, b: torch.cdist(a, b), [(x, placements), (y, None)], mesh, label="cdist")
        img = torch.randn(2, 3, 7, 5, dtype=torch.float64)
        grid = torch.rand(2, 4, 6, 2, dtype=torch.float64) * 2 - 1
        img_rows = (Shard(2), Shard(3))[: mesh.ndim]
        check(
            lambda i, g: F.grid_sample(i, g, align_corners=False),
            [(img, img_rows), (grid, None)],
            mesh,
            label="grid_sample",
        )
        check(
            lambda i, g: F.grid_sample(i, g, align_corners=True),
            [(img, img_rows), (grid, (Shard(1),) * mesh.ndim)],
            mesh,
            label="grid_sample sharded grid",
        )

        # in-place and out= ops are refused, with the way out
        with pytest.raises(NotImplementedError, match=r"index_fill_.*writes into its argument\(s\) self"):
            sx.clone().index_fill_(0, torch.tensor([1]), 0.0)
        # random ops too: each rank would draw from its own generator
        with pytest.raises(NotImplementedError, match=r"poisson.*draws random numbers"):
            torch.poisson(sx.abs())

    # The environment variable turns it on outside any block (read at use).
    os.environ["PDP_FALLBACK"] = "gather"
    try:
        with implicit_gathers("allow"):
            assert torch.equal(torch.histc(sx, 5).full_tensor(), torch.histc(x, 5))
            with physicsnemo_dp.fallback("off"), pytest.raises(NotImplementedError, match="has no rule"):
                torch.histc(sx, 5)
    finally:
        del os.environ["PDP_FALLBACK"]

    # Warned once per op (by the mesh's first rank), with the bytes per rank.
    before = set(_gathers._WARNED)
    try:
        _gathers._WARNED.difference_update({("fallback", "aten.histc.default"), ("fallback", "aten.renorm.default")})
        with physicsnemo_dp.fallback("gather"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.histc(sx, 5)
            torch.histc(sx, 4)  # another line, the same op: no second warning
            torch.renorm(sx, 2, 0, 1.0)
        seen = [str(w.message) for w in caught if issubclass(w.category, ImplicitGatherWarning)]
        if _first_rank(mesh):
            assert len(seen) == 2, seen
            assert "no rule for aten.histc.default" in seen[0] and "280 B per rank" in seen[0], seen[0]
            assert "no rule for aten.renorm.default" in seen[1], seen[1]
        else:
            assert seen == []
    finally:
        _gathers._WARNED.clear()
        _gathers._WARNED.update(before)

    # Under "raise": every rank refuses before anything moves (no collective), naming the op and the bytes.
    with physicsnemo_dp.fallback("gather"), implicit_gathers("raise"), count_collectives() as counter:
        with pytest.raises(ImplicitGatherError, match=r"no rule for aten.histc.default.*280 B per rank"):
            torch.histc(sx, 5)
    assert counter.total_calls == 0

    # Operands already whole (replicated, or only pending) are no implicit gather: allowed under "raise".
    pending = physicsnemo_dp.ShardTensor.from_local(x / mesh.size(), mesh, [Partial()] * mesh.ndim)
    with physicsnemo_dp.fallback("gather"), implicit_gathers("raise"):
        out = torch.renorm(pending, 2, 0, 1.0)
    assert out.placements == (Replicate(),) * mesh.ndim
    torch.testing.assert_close(out.full_tensor(), torch.renorm(x, 2, 0, 1.0))
