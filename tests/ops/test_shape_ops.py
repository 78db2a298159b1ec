"""Shape ops of ``rules/shape_ops.py`` on uneven shards, against one process (forward and every gradient).

One distributed job per world size: tril/triu, repeat/tile, rot90, diagonal/diag_embed/trace, in-place
squeeze_/unsqueeze_, and the crash fixes found by the OpInfo sweep (tensor_split by a tensor of indices,
a backward that builds its gradient with a factory of the global shape).
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ImplicitGatherError, count_collectives, implicit_gathers
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (3, 7, 6)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _unsqueezed(x):
    y = x * 1
    y.unsqueeze_(1)
    return y


def _squeezed(x):
    y = x.unsqueeze(2) * 1
    y.squeeze_(2)
    return y.squeeze_()


OPS_3D = [
    lambda x: x.tril(2),
    lambda x: torch.triu(x, -1),
    lambda x: (x * 1).tril_(1),
    lambda x: x.repeat(1, 2, 1),
    lambda x: x.repeat(2, 1, 3),
    lambda x: x.repeat(2, 1, 1, 1),
    lambda x: x.repeat(1, 0, 1),
    lambda x: torch.tile(x, (2,)),
    lambda x: torch.rot90(x, 1, (1, 2)),
    lambda x: torch.rot90(x, 2, (0, 2)),
    lambda x: x.rot90(-1, (2, 1)),
    lambda x: x.diagonal(0, 1, 2),
    lambda x: x.diagonal(2, 1, 2),
    lambda x: torch.diagonal(x, -3, 2, 1),
    lambda x: torch.diagonal(x, 1, 0, 2),
    lambda x: torch.diag_embed(x),
    lambda x: torch.diag_embed(x, 1, 0, 2),
    lambda x: torch.diag_embed(x, -2, 3, 1),
    _unsqueezed,
    _squeezed,
    lambda x: x.tensor_split(torch.tensor([1, 4]), dim=1),
    lambda x: torch.tensor_split(x, torch.tensor(2), 2),
    lambda x: torch.sgn(x) * x,
]
OPS_2D = [torch.trace, lambda x: (x * x).trace(), lambda x: x.diag(), lambda x: torch.diag(x, -2)]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_shape_ops(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3, partial=True):
        for i, fn in enumerate(OPS_3D):
            check(fn, [(_g(), placements)], mesh, label=f"shape_ops[{i}]")
    for placements in layouts(mesh, 2, partial=True):
        for i, fn in enumerate(OPS_2D):
            check(fn, [(_g((7, 6), 1), placements)], mesh, label=f"2d[{i}]")
    check(torch.diag_embed, [(_g((5,), 2), layouts(mesh, 1)[0])], mesh, label="diag_embed 1-d")

    # exact layouts without communication: tril on uneven shards, a diagonal of sharded rows or columns
    for placements in layouts(mesh, 3)[:-1]:
        x = shard_from_global(_g(), make_spec(mesh, placements, SHAPE))
        sharded = [t is not None for t in x._spec.dim_sizes]
        with count_collectives() as counter:
            x.tril(1), x.triu(-2), x.repeat(1, 1, 1, 1)
            if not (sharded[0] and sharded[2]):
                x.diagonal(1, 0, 2)
            if not (sharded[1] and sharded[2]):  # both dims sharded: dim2's shard moves first (documented)
                x.diagonal(-1, 1, 2)
            if not sharded[1]:
                x.repeat(1, 3, 1)
        assert counter.total_calls == 0, (placements, counter.summary())
    if mesh.ndim == 1:
        x = shard_from_global(_g(), make_spec(mesh, (Shard(1),), SHAPE))
        d = x.diagonal(0, 1, 2)
        assert d.placements == (Shard(1),) and sum(d._spec.dim_sizes[1]) == 6
    # a plain gradient of the global shape (a backward factory) is read as the full gradient
    x = shard_from_global(_g(), make_spec(mesh, layouts(mesh, 3)[0], SHAPE), requires_grad=True)
    y = x.repeat(1, 0, 1)
    (g,) = torch.autograd.grad(y.sum() + (x * 0).sum(), x)
    assert g._local_tensor.shape == x._local_tensor.shape
    x.grad = torch.ones(SHAPE, dtype=torch.float64)
    if tuple(x._local_tensor.shape) != SHAPE:  # a whole gradient held by every rank is reported, on every rank
        with implicit_gathers("raise"), pytest.raises(ImplicitGatherError, match="plain gradient of the global shape"):
            x.grad
    assert x.grad._local_tensor.shape == x._local_tensor.shape
