"""Order statistics (median/nanmedian/mode/kthvalue), the native norm entry points and the ``*_copy`` ops.

Against one process on uneven shards (forward and every gradient), one distributed job per world size:
``rules/dim_ops/order_stats.py`` along sharded and unsharded dims (global indices), the global median
(gathered); ``torch.native_batch_norm``/``native_group_norm`` (``spatial/norm.py``, all three outputs);
each ``*_copy`` op (``rules/copies.py``) through its view's rule.
"""

import pytest
import torch

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 6, 5)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _with_nans():
    x = _g()
    x[1, 2, :3] = float("nan")
    x[4, :, 1] = float("nan")
    return x


def _ties():
    return torch.randint(0, 3, SHAPE, generator=torch.Generator().manual_seed(2)).to(torch.float64)


ORDER = [
    lambda x: torch.median(x, 0),
    lambda x: x.median(1, keepdim=True),
    lambda x: torch.median(x, -1),
    lambda x: torch.kthvalue(x, 3, 0),
    lambda x: x.kthvalue(2, dim=2, keepdim=True),
    lambda x: torch.median(x),
]
ON_TIES = [lambda x: torch.mode(x, 0), lambda x: x.mode(-1, True), lambda x: torch.median(x, 1)]
ON_NANS = [lambda x: torch.nanmedian(x, 0), lambda x: x.nanmedian(2), torch.nanmedian]

W, B = _g((6,), 3), _g((6,), 4)
NORMS = [
    lambda x: torch.native_batch_norm(x, W, B, None, None, True, 0.1, 1e-5),
    lambda x: torch.native_batch_norm(x, None, None, W.abs(), W.abs() + 1, False, 0.1, 1e-5)[0],
    lambda x: torch.native_group_norm(x, W, B, 7, 6, 5, 3, 1e-5),
    lambda x: torch.native_layer_norm(x, (5,), None, None, 1e-5),
]

COPIES = [
    lambda x: torch.permute_copy(x, (2, 0, 1)),
    lambda x: torch.transpose_copy(x, 0, 2),
    lambda x: torch.t_copy(x[0]),
    lambda x: torch.view_copy(x, (7, 30)),
    lambda x: torch.expand_copy(x.unsqueeze(1), (7, 2, 6, 5)),
    lambda x: torch.unsqueeze_copy(x, 1),
    lambda x: torch.squeeze_copy(x.unsqueeze(2), 2),
    lambda x: torch.slice_copy(x, 0, 1, 6),
    lambda x: torch.select_copy(x, 1, 2),
    lambda x: torch.split_copy(x, 2, 0),
    lambda x: torch.split_with_sizes_copy(x, [1, 4], 2),
    lambda x: torch.unbind_copy(x, 1),
    torch.alias_copy,
    lambda x: torch.detach_copy(x.detach()) * x,
]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_order_copies_norms(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3, partial=True):
        for i, fn in enumerate(ORDER):
            check(fn, [(_g(), placements)], mesh, label=f"order[{i}]")
        for i, fn in enumerate(COPIES):
            check(fn, [(_g(), placements)], mesh, label=f"copies[{i}]")
    for placements in layouts(mesh, 3):
        for i, fn in enumerate(ON_TIES):
            check(fn, [(_ties(), placements)], mesh, label=f"ties[{i}]")
        for i, fn in enumerate(ON_NANS):
            check(fn, [(_with_nans(), placements)], mesh, label=f"nans[{i}]")
        for i, fn in enumerate(NORMS):
            check(fn, [(_g(), placements)], mesh, label=f"norms[{i}]")

    # along an unsharded dim: no communication, and the indices are global
    placements = layouts(mesh, 3, dims=(0,))[0]
    x = shard_from_global(_g(), make_spec(mesh, placements, SHAPE))
    with count_collectives() as counter:
        values, indices = torch.median(x, 1)
        torch.kthvalue(x, 2, 2), torch.mode(x, 1)
    assert counter.total_calls == 0, counter.summary()
    assert indices.placements == x.placements

    # running statistics of torch.native_batch_norm in training: updated from every rank's data
    rm, rv = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    ref_m, ref_v = rm.clone(), rv.clone()
    torch.native_batch_norm(_g(), None, None, ref_m, ref_v, True, 0.1, 1e-5)
    torch.native_batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5)
    torch.testing.assert_close(rm, ref_m)
    torch.testing.assert_close(rv, ref_v)

    # the ATen op called directly (below torch-function): a clear error naming what to call, on every rank
    with pytest.raises(NotImplementedError, match="F.batch_norm"):
        torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
