"""View and shape ops on uneven shards: the shard dim moves with the data; reshape across it stays exact."""

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import PlacementError, ShardTensor, ShardTensorSpec, count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global, uneven_table
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 5, 3)


def _g(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


RESHAPES = [
    lambda x: x.view(7, 15),
    lambda x: x.reshape(-1, 3),
    lambda x: x.reshape(105),
    lambda x: x.reshape(3, 35),
    lambda x: x.reshape(5, 7, 3),
    lambda x: x.reshape(7, 5, 3, 1),
    lambda x: x.view(1, 7, 15),
    lambda x: x.flatten(),
    lambda x: x.flatten(1),
    lambda x: x.flatten(0, 1),
    lambda x: x.unflatten(1, (5, 1)),
    lambda x: x.flatten(1).unflatten(1, (5, 3)),
    lambda x: x.flatten(1).unflatten(1, (3, -1)),
    lambda x: x.view_as(torch.empty(7, 15)),
    lambda x: x.reshape_as(torch.empty(35, 3)),
    lambda x: x.transpose(0, 1).reshape(5, 21),
    lambda x: torch.reshape(x.permute(2, 0, 1), (3, 35)) * 2,
    lambda x: torch.ops.aten._unsafe_view(x * 1, [7, 15]),
    lambda x: x.reshape(7, 5, 3) * 2,  # its own shape
    lambda x: x.view(7, -1, 3),  # its own shape through -1 (planned)
]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=300)
def test_reshapes(ctx):
    for i, fn in enumerate(RESHAPES):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(fn, [(_g(), placements)], ctx.mesh, label=f"reshape[{i}]")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_view_to_its_own_shape_keeps_the_spec_without_planning(ctx):
    """``view``/``_unsafe_view``/``reshape`` to the tensor's own shape (AOTAutograd's output views): the
    input's spec, its local memory viewed, gradients as the global op's; no plan is looked up."""
    from physicsnemo_dp.rules import views

    def refuse(*args):
        raise AssertionError("a view to the tensor's own shape was planned")

    planned = views.propagate
    views.propagate = refuse
    try:
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(lambda x: torch.ops.aten._unsafe_view(x * 1, [7, 5, 3]), [(_g(), placements)], ctx.mesh)
            x = shard_from_global(_g(), make_spec(ctx.mesh, placements, SHAPE), requires_grad=True)
            for op in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
                y = op(x, list(SHAPE))
                assert y._spec is x._spec, (op, placements)
                assert y._local_tensor is not x._local_tensor  # a view, as the global op gives
                assert y._local_tensor.data_ptr() == x._local_tensor.data_ptr()
                assert y._local_tensor.stride() == x._local_tensor.stride()
    finally:
        views.propagate = planned
    x = shard_from_global(_g(), make_spec(ctx.mesh, [Shard(0)] * ctx.mesh.ndim, SHAPE))
    with pytest.raises(RuntimeError, match="shape"):  # a wrong shape still meets torch's own check
        x.view(7, 5, 4)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_split_a_dim_and_size_one_dims(ctx):
    fns = [lambda x: x.view(4, 3, 2), lambda x: x.view(2, 6, 2), lambda x: x.view(24), lambda x: x.view(12, 1, 2)]
    for i, fn in enumerate(fns):
        for placements in layouts(ctx.mesh, 2):
            check(fn, [(_g((12, 2), 1), placements)], ctx.mesh, label=f"split-dim[{i}]")
    ones = [lambda x: x.view(7, 3), lambda x: x.view(21), lambda x: x.view(1, 7, 3, 1), lambda x: x.reshape(3, 7)]
    for i, fn in enumerate(ones):
        for placements in layouts(ctx.mesh, 3):
            check(fn, [(_g((7, 1, 3), 2), placements)], ctx.mesh, label=f"size-one[{i}]")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_views_of_empty_tensors(ctx):
    for placements in layouts(ctx.mesh, 2):
        check(lambda x: x.reshape(4, 0), [(_g((0, 4)), placements)], ctx.mesh, label="empty")
        check(lambda x: x.reshape(2, 2, 0).flatten(1), [(_g((4, 0)), placements)], ctx.mesh, label="empty2")


PERMUTES = [
    lambda x: x.permute(2, 0, 1),
    lambda x: x.permute(-1, 1, 0),
    lambda x: x.transpose(0, 2),
    lambda x: x.transpose(-1, 1),
    lambda x: torch.transpose(x, 0, 1),
    lambda x: x.swapaxes(0, 1),
    lambda x: x.movedim(0, -1),
    lambda x: torch.movedim(x, (0, 1), (2, 0)),
    lambda x: x[:, 0].t(),
    lambda x: x.flatten(1).T,
    lambda x: x.mT,
    lambda x: x.transpose(0, 1).contiguous(),
]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_permute_transpose_movedim(ctx):
    for i, fn in enumerate(PERMUTES):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(fn, [(_g(), placements)], ctx.mesh, label=f"permute[{i}]")


SQUEEZES = [
    lambda x: x.unsqueeze(0),
    lambda x: x.unsqueeze(-1),
    lambda x: x.unsqueeze(2),
    lambda x: x.squeeze(),
    lambda x: x.squeeze(1),
    lambda x: x.squeeze(-2),
    lambda x: x.squeeze(0),
    lambda x: x.squeeze((1, 2)),
    lambda x: torch.squeeze(x, dim=(0, 1)),
    lambda x: x.unsqueeze(1).squeeze(1),
    lambda x: x[None, :, None].squeeze(),
]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_squeeze_unsqueeze(ctx):
    for i, fn in enumerate(SQUEEZES):
        for placements in layouts(ctx.mesh, 3, partial=True):
            # dim 1 has size 1: sharding it leaves ranks with empty shards
            check(fn, [(_g((7, 1, 3), 3), placements)], ctx.mesh, label=f"squeeze[{i}]")
    for placements in layouts(ctx.mesh, 2):
        check(lambda x: x.squeeze(), [(_g((1, 1), 4), placements)], ctx.mesh, label="squeeze-to-0d")


EXPANDS = [
    lambda x: x.expand(7, 4, 3),
    lambda x: x.expand(2, 7, 4, 3),
    lambda x: x.expand(-1, 6, -1),
    lambda x: x.expand_as(torch.empty(7, 2, 3)),
    lambda x: torch.broadcast_to(x, (2, 7, 5, 3)),
    lambda x: x.expand(7, 1, 3),
]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_expand(ctx):
    for i, fn in enumerate(EXPANDS):
        for placements in layouts(ctx.mesh, 3, partial=True):
            check(fn, [(_g((7, 1, 3), 5), placements)], ctx.mesh, label=f"expand[{i}]")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_expand_of_replicate_is_a_stride_zero_view(ctx):
    mesh = ctx.mesh
    spec = ShardTensorSpec.chunked(mesh, [Replicate()] * mesh.ndim, (1, 3), torch.float64)
    x = shard_from_global(_g((1, 3)), spec)
    with count_collectives() as counter:
        y = x.expand(1000, 3)
    assert counter.total_calls == 0
    assert all(p == Replicate() for p in y.placements)
    assert y._local_tensor.stride() == (0, 1)
    assert y._local_tensor.data_ptr() == x._local_tensor.data_ptr()


@distributed(world_sizes=OP_WORLD_SIZES)
def test_views_that_keep_the_sharding_do_not_communicate(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3, partial=True):
        spec = make_spec(mesh, placements, SHAPE)
        x = shard_from_global(_g(), spec)
        with count_collectives() as counter:
            outs = [x.permute(2, 0, 1), x.transpose(0, 1), x.unsqueeze(1), x.unsqueeze(0).squeeze(0), x.movedim(2, 0)]
            if spec.dim_sizes[1] is None and spec.dim_sizes[2] is None:
                outs += [x.reshape(7, 15), x.flatten(), x.unflatten(2, (3, 1))]  # merge into / keep the head
            if spec.dim_sizes[0] is None and spec.dim_sizes[2] is None:
                outs += [x.flatten(1), x.view(7, 15)]  # dim 1 is the head of (5, 3) -> 15
        assert counter.total_calls == 0, placements
        for y in outs:
            assert y._local_tensor.numel() == x._local_tensor.numel()
    # splitting a sharded dim keeps it when every shard divides by the inner product
    rows = tuple(3 * s for s in uneven_table(8, mesh.size(), salt=1))  # uneven, with empty shards
    spec = ShardTensorSpec.from_sizes(mesh, [Shard(0)] * mesh.ndim, (24, 2), torch.float64, (rows, None))
    x = shard_from_global(_g((24, 2)), spec)
    with count_collectives() as counter:
        y = x.view(8, 3, 2)
    assert counter.total_calls == 0 and y.placements == x.placements
    assert torch.equal(y.full_tensor(), _g((24, 2)).view(8, 3, 2))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_as_strided_is_refused_clearly(ctx):
    spec = make_spec(ctx.mesh, layouts(ctx.mesh, 2)[0], (4, 4))
    x = shard_from_global(_g((4, 4)), spec)
    with pytest.raises(NotImplementedError, match="as_strided"):
        x.as_strided((2, 2), (1, 1))


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_reshape_that_cannot_keep_the_shard_moves_it_with_one_all_to_all(ctx):
    mesh = ctx.mesh
    # dim 2 is the inner dim of the merged group (5, 3) -> 15: its shard moves to dim 0
    x = shard_from_global(_g(), make_spec(mesh, [Shard(2)], SHAPE))
    with count_collectives() as counter:
        y = x.reshape(7, 15)
    assert dict(counter.calls) == {"all_to_all": 1}
    assert y.placements == (Shard(0),)
    assert torch.equal(y.full_tensor(), _g().reshape(7, 15))
    # a 1-D shard split into rows of 3 with shards that do not divide: rebalanced in place
    x = shard_from_global(_g((12,)), make_spec(mesh, [Shard(0)], (12,)))
    with count_collectives() as counter:
        y = x.view(4, 3)
    assert set(counter.calls) <= {"all_to_all"} and y.placements == (Shard(0),)
    assert torch.equal(y.full_tensor(), _g((12,)).view(4, 3))


# --------------------------------------------------------------------------- #
# view(dtype): each shard reinterpreted on its own
# --------------------------------------------------------------------------- #
def _bits(dtype):
    """An integer dtype to compare through, bit-exact (NaN patterns too): same size, or bytes for 2-byte
    dtypes (gloo has no int16 collectives, and full_tensor gathers)."""
    return {1: torch.uint8, 2: torch.uint8, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _typed(shape, dtype, seed=0):
    if dtype.is_floating_point or dtype.is_complex:
        return _g(shape, seed).to(dtype)
    return torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


#: (input dtype, view dtype): same size, narrower elements (last dim grows), wider ones (last dim shrinks)
SAME_OR_NARROWER = [
    (torch.float32, torch.int32), (torch.int32, torch.float32), (torch.float32, torch.float16),
    (torch.float32, torch.uint8), (torch.complex64, torch.float32),
]
WIDER = [(torch.int32, torch.float32), (torch.float16, torch.float32), (torch.uint8, torch.float32),
         (torch.float32, torch.complex64)]


@distributed(world_sizes=OP_WORLD_SIZES)
def test_view_dtype_reinterprets_every_shard(ctx):
    for src, dst in SAME_OR_NARROWER:  # every layout, the last dim sharded unevenly too (with empty shards)
        for placements in layouts(ctx.mesh, 3, partial=src.is_floating_point):
            check(lambda x: x.view(dst).view(_bits(dst)), [(_typed((7, 5, 3), src), placements)], ctx.mesh,
                  grad=False, label=f"view({src}->{dst})")
    for src, dst in WIDER:  # the last dim not sharded: its size shrinks on every rank alike
        for placements in layouts(ctx.mesh, 3, dims=(0, 1), partial=src.is_floating_point):
            check(lambda x: x.view(dst).view(_bits(dst)), [(_typed((7, 5, 8), src), placements)], ctx.mesh,
                  grad=False, label=f"view({src}->{dst})")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_view_dtype_of_a_sharded_last_dim_needs_whole_wide_elements(ctx):
    mesh = ctx.mesh
    g = _typed((3, 4 * mesh.size()), torch.uint8)
    # shard sizes that are multiples of 4 (one empty): viewed as float32 they shrink by 4, no communication
    sizes = tuple(4 * s for s in uneven_table(mesh.size(), mesh.size(), salt=1))
    spec = ShardTensorSpec.from_sizes(mesh, [Shard(1)] * mesh.ndim, tuple(g.shape), torch.uint8, (None, sizes))
    x = shard_from_global(g, spec)
    with count_collectives() as counter:
        y = x.view(torch.float32)
    assert counter.total_calls == 0
    assert y.placements == x.placements and y._spec.dim_sizes == (None, tuple(s // 4 for s in sizes))
    assert torch.equal(y.full_tensor().view(torch.int32), g.view(torch.int32))
    # shard sizes that are not: the same PlacementError on every rank (decided by the spec alone)
    if mesh.size() > 1:
        odd = (2,) + (0,) * (mesh.size() - 2) + (4 * mesh.size() - 2,)
        odd = ShardTensorSpec.from_sizes(mesh, [Shard(1)] * mesh.ndim, tuple(g.shape), torch.uint8, (None, odd))
        with pytest.raises(PlacementError, match=r"view\(dtype=torch.float32\).*multiple of 4"):
            shard_from_global(g, odd).view(torch.float32)


@distributed(world_sizes=(1, 3), mesh_2d=False)
def test_view_dtype_of_strided_local_memory(ctx):
    """A local piece whose memory torch cannot view as another element size (column-major) is copied, not refused."""
    g = _typed((6, 4), torch.float16)
    spec = make_spec(ctx.mesh, [Shard(0)], (6, 4), dtype=torch.float16)
    x = shard_from_global(g, spec)
    column_major = ShardTensor(x._local_tensor.t().contiguous().t(), spec, requires_grad=False)
    for dst in (torch.float32, torch.uint8):
        y = column_major.view(dst)
        assert torch.equal(y.full_tensor().view(_bits(dst)), g.view(dst).view(_bits(dst)))


@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_view_dtype_keeps_torchs_own_errors(ctx):
    x = shard_from_global(_typed((4, 3), torch.float16), make_spec(ctx.mesh, [Shard(0)], (4, 3), dtype=torch.float16))
    with pytest.raises(RuntimeError, match="divisible by 2"):
        x.view(torch.float32)  # 3 half elements do not make whole floats: torch's message
    s = shard_from_global(_g(()).float(), make_spec(ctx.mesh, [Replicate()], (), dtype=torch.float32))
    with pytest.raises(RuntimeError, match="cannot be 0"):
        s.view(torch.float16)
    assert torch.equal(s.view(torch.int32).full_tensor(), _g(()).float().view(torch.int32))
