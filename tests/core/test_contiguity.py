"""Local memory layouts: is_contiguous/contiguous reflect the local tensor; gathers return contiguous tensors."""

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_dp import ShardTensor, collectives
from tests._harness import distributed

from ..ops._diff import layouts
from ._util import integer_tensor, make_spec, shard_from_global

SHAPE = (5, 4, 6, 3)
aten = torch.ops.aten


def _restored(local, storage):
    """``local``'s values in another memory layout (a new leaf-free tensor)."""
    if storage == "transposed":
        return local.transpose(-1, -2).contiguous().transpose(-1, -2)
    if storage == "permuted":
        return local.permute(3, 1, 0, 2).contiguous().permute(2, 1, 3, 0)
    if storage == "offset":
        buf = local.new_zeros([n + 2 for n in local.shape])
        return buf[tuple(slice(1, 1 + n) for n in local.shape)].copy_(local)
    return local


def _sharded(mesh, placements, storage, requires_grad=False):
    """The integer tensor of SHAPE in an uneven layout (empty shards where possible), local stored as ``storage``."""
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, placements, SHAPE, "uneven")
    x = shard_from_global(G, spec)
    return ShardTensor(_restored(x._local_tensor, storage), spec, requires_grad=requires_grad), G


@pytest.mark.parametrize("storage", ["transposed", "permuted", "offset", "contiguous"])
@distributed
def test_is_contiguous_and_contiguous_follow_the_local_tensor(ctx, storage):
    mesh = ctx.mesh
    placements = (Shard(1),) if mesh.ndim == 1 else (Shard(1), Shard(2))
    x, G = _sharded(mesh, placements, storage, requires_grad=True)
    local = x._local_tensor
    for fmt in (torch.contiguous_format, torch.channels_last):
        assert x.is_contiguous(memory_format=fmt) == local.is_contiguous(memory_format=fmt)
    assert x.is_contiguous() == local.is_contiguous()

    y = x.contiguous()
    assert y._local_tensor.is_contiguous() and y.is_contiguous()
    assert y._spec == x._spec and torch.equal(y._local_tensor, local)
    assert (y is x) == local.is_contiguous()  # a no-op when already contiguous, like torch
    if not local.is_contiguous():
        assert y.grad_fn is not None
    w = integer_tensor(SHAPE, seed=1)
    (y * w).sum().backward()
    assert torch.equal(x.grad.full_tensor(), w)

    z = x.detach().contiguous(memory_format=torch.channels_last)
    assert z._local_tensor.is_contiguous(memory_format=torch.channels_last)
    assert z.is_contiguous(memory_format=torch.channels_last) and torch.equal(z.full_tensor(), G)

    # nothing to record (no grad wanted, or grad mode off: AOTAutograd's tangents): no autograd Function
    from physicsnemo_dp._conversion import Contiguous

    applied, apply = [], Contiguous.apply
    Contiguous.apply = lambda *a: applied.append(1) or apply(*a)
    try:
        with torch.no_grad():
            n = x.contiguous()
        d = x.detach().contiguous()
        recorded = x.contiguous()
    finally:
        Contiguous.apply = apply
    for t in (n, d):
        assert t.grad_fn is None and t._spec == x._spec and t._local_tensor.is_contiguous()
        assert torch.equal(t._local_tensor, local)
    assert applied == ([] if local.is_contiguous() else [1]) and (recorded.grad_fn is None) == local.is_contiguous()


@pytest.mark.parametrize("storage", ["contiguous", "transposed", "offset"])
@distributed
def test_full_tensor_is_contiguous_for_every_placement(ctx, storage):
    mesh = ctx.mesh
    for placements in layouts(mesh, len(SHAPE), partial=True):
        x, G = _sharded(mesh, placements, storage)
        full = x.full_tensor()
        assert full.is_contiguous(), f"{placements}: strides {full.stride()}"
        assert torch.equal(full.view(-1), G.view(-1)), placements  # .view works, as on DTensor's result
    # and through autograd
    x, G = _sharded(mesh, (Shard(2),) * mesh.ndim, "transposed", requires_grad=True)
    full = x.full_tensor()
    assert full.is_contiguous()
    full.view(-1).sum().backward()
    assert torch.equal(x.grad.full_tensor(), torch.ones(SHAPE, dtype=G.dtype))


@distributed(world_sizes=(2, 3, 4))
def test_redistributed_locals_are_contiguous(ctx):
    """Gathers (to Replicate) and reduce-scatters (Partial to Shard) write contiguous locals, along every dim.

    (Over a group of one nothing moves and the local keeps its memory layout.)
    """
    mesh = ctx.mesh
    for d in range(len(SHAPE)):
        for src, dst in (((Shard(d),), (Replicate(),)), ((Partial(),), (Shard(d),))):
            src, dst = src * mesh.ndim, dst * mesh.ndim
            x, G = _sharded(mesh, src, "transposed")
            y = x.redistribute(placements=dst)
            assert y._local_tensor.is_contiguous(), f"{src} -> {dst}: strides {y._local_tensor.stride()}"
            assert torch.equal(y.full_tensor(), G)


class _CountCopies(TorchDispatchMode):
    """Counts the ATen ops that write a new copy of their input's data."""

    OPS = {aten.clone.default, aten.copy_.default, aten.cat.default, aten._to_copy.default, aten.repeat.default}

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func in self.OPS
        return func(*args, **(kwargs or {}))


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_gather_copies_at_most_once(ctx):
    """``all_gather_v`` writes its contiguous result directly: no copy along dim 0, one ``cat`` along another dim.

    Unequal shard sizes add the one send buffer the all-to-all needs; nothing else is copied.
    """
    mesh, P = ctx.mesh, ctx.world_size
    wrong = []  # asserted after the loop: every rank makes every gather
    for dim in range(3):
        for sizes in ([2] * P, [2] * (P - 1) + [0]):
            shape = [3, 4, 5]
            shape[dim] = sizes[ctx.rank]
            local = torch.randn(shape)
            with _CountCopies() as mode:
                out = collectives.all_gather_v(local, sizes, dim, mesh, 0)
            send_buffer = len(set(sizes)) > 1
            expected = int(dim > 0) + int(send_buffer)
            ok = out.is_contiguous() and out.shape[dim] == sum(sizes)
            ok = ok and torch.equal(out.narrow(dim, 2 * ctx.rank, sizes[ctx.rank]), local)
            if mode.copies != expected or not ok:
                wrong.append((dim, sizes, mode.copies, expected, out.stride()))
    assert not wrong
