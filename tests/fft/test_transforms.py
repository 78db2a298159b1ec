"""Every torch.fft transform on ShardTensors against one process: forward and backward.

Inputs are sharded on each transformed dim and on a batch dim, with uneven
sizes and empty shards (``make_spec(kind="uneven")``) and the split rule's
sizes; odd and prime extents; ``n``/``s`` padding and cropping, ``dim`` and
the three ``norm`` modes; float64/complex128 and float32/complex64.
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global

from ..ops._diff import layouts
from ._check import fft_check

F = torch.fft
SHAPE = (3, 7, 5)  # a batch dim and two odd (prime) transformed dims


def _g(dtype, shape=SHAPE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        x = torch.complex(x, torch.randn(shape, generator=gen, dtype=torch.float64))
    return x.to(dtype)


REAL_IN = {  # name -> fn of a real input
    "fft": lambda x: F.fft(x, dim=1),
    "fft n pad": lambda x: F.fft(x, n=9, dim=1, norm="ortho"),
    "ifft": lambda x: F.ifft(x, dim=-1, norm="forward"),
    "rfft": lambda x: F.rfft(x, dim=1),
    "rfft n crop": lambda x: F.rfft(x, n=4, dim=-1, norm="ortho"),
    "ihfft": lambda x: F.ihfft(x, dim=1),
    "fft2": lambda x: F.fft2(x),
    "fft2 s": lambda x: F.fft2(x, s=(4, 8), norm="forward"),
    "ifft2": lambda x: F.ifft2(x, norm="ortho"),
    "rfft2": lambda x: F.rfft2(x),
    "rfft2 s": lambda x: F.rfft2(x, s=(8, 6), norm="ortho"),
    "rfft2 dims": lambda x: F.rfft2(x, dim=(-1, -2)),
    "ihfft2": lambda x: F.ihfft2(x),
    "fftn": lambda x: F.fftn(x, dim=(0, 2)),
    "ifftn": lambda x: F.ifftn(x),
    "rfftn": lambda x: F.rfftn(x, norm="forward"),
    "rfftn s": lambda x: F.rfftn(x, s=(2, 9), dim=(0, 1)),
    "ihfftn": lambda x: F.ihfftn(x, dim=(1, 2), norm="ortho"),
}

COMPLEX_IN = {  # name -> fn of a complex input
    "fft": lambda x: F.fft(x, dim=1, norm="ortho"),
    "ifft n crop": lambda x: F.ifft(x, n=4, dim=1),
    "irfft": lambda x: F.irfft(x, dim=1),
    "irfft n": lambda x: F.irfft(x, n=9, dim=-1, norm="forward"),
    "hfft": lambda x: F.hfft(x, dim=1),
    "hfft n": lambda x: F.hfft(x, n=6, dim=-1, norm="ortho"),
    "fft2": lambda x: F.fft2(x, dim=(0, 1)),
    "ifft2 s": lambda x: F.ifft2(x, s=(9, 4)),
    "irfft2": lambda x: F.irfft2(x),
    "irfft2 s": lambda x: F.irfft2(x, s=(7, 9), norm="ortho"),
    "hfft2": lambda x: F.hfft2(x, norm="forward"),
    "fftn": lambda x: F.fftn(x, s=(4, 6), dim=(1, 2)),
    "ifftn": lambda x: F.ifftn(x, norm="ortho"),
    "irfftn": lambda x: F.irfftn(x, dim=(0, 1, 2)),
    "irfftn s": lambda x: F.irfftn(x, s=(6, 8), dim=(0, 2), norm="forward"),
    "hfftn": lambda x: F.hfftn(x, dim=(0, 1)),
}


def _all(ctx, table, dtype, kind):
    for name, fn in table.items():
        for i, placements in enumerate(layouts(ctx.mesh, 3)):
            fft_check(fn, _g(dtype), placements, ctx.mesh, kind=kind, salt=i, label=f"{name} {dtype}")


@pytest.mark.parametrize("kind", ["uneven", "chunk"])
@distributed(timeout=120)
def test_real_input_transforms(ctx, kind):
    _all(ctx, REAL_IN, torch.float64, kind)


@pytest.mark.parametrize("kind", ["uneven", "chunk"])
@distributed(timeout=120)
def test_complex_input_transforms(ctx, kind):
    _all(ctx, COMPLEX_IN, torch.complex128, kind)


@distributed(timeout=120)
def test_single_precision(ctx):
    for placements in layouts(ctx.mesh, 3):
        for name in ("rfft2", "fft", "ihfft2"):
            fft_check(REAL_IN[name], _g(torch.float32), placements, ctx.mesh, label=name)
        for name in ("irfft2 s", "hfft", "fftn"):
            fft_check(COMPLEX_IN[name], _g(torch.complex64), placements, ctx.mesh, label=name)


@distributed(timeout=120)
def test_fftshift_ifftshift(ctx):
    """``fftshift``/``ifftshift`` are ``roll``: uneven and empty shards along the shifted dims."""
    for i, placements in enumerate(layouts(ctx.mesh, 3)):
        for fn in (F.fftshift, F.ifftshift, lambda x: F.fftshift(x, dim=(0, 1)), lambda x: F.ifftshift(x, dim=-2)):
            fft_check(fn, _g(torch.complex128), placements, ctx.mesh, salt=i, label="shift")
            fft_check(fn, _g(torch.float64, (2, 9, 4)), placements, ctx.mesh, salt=i + 1, label="shift real")


@distributed(world_sizes=(), mesh_2d=True, timeout=120)
def test_pencil_decomposition_moves_each_shard_once(ctx):
    """A 3-D transform with two transformed dims sharded on the 2x2 mesh: one all-to-all per mesh dim."""
    g = _g(torch.float64, (1, 6, 5, 7))
    for placements in [(Shard(1), Shard(2)), (Shard(2), Shard(1)), (Shard(3), Shard(1))]:
        for fn, label in ((lambda x: F.fftn(x, dim=(1, 2, 3)), "fftn"), (lambda x: F.rfftn(x, dim=(1, 2, 3)), "rfftn")):
            out, fwd, bwd = fft_check(fn, g, placements, ctx.mesh, label=f"pencil {label}")
            assert set(fwd.calls) == {"all_to_all"} and fwd.calls["all_to_all"] <= 3, fwd.summary()
            assert all(p.is_shard() for p in out._spec.placements), out._spec


@distributed(timeout=120)
def test_aten_ops_and_pending_sums(ctx):
    """The three ATen ops called directly, and a pending sum (Partial) transformed without reducing it."""
    aten = torch.ops.aten
    for i, placements in enumerate(layouts(ctx.mesh, 3, partial=True)):
        fft_check(lambda x: aten._fft_r2c(x, [1, 2], 1, True), _g(torch.float64), placements, ctx.mesh, salt=i, grad=False)
        fft_check(lambda x: aten._fft_c2c(x, [0, 1], 2, False), _g(torch.complex128), placements, ctx.mesh, salt=i, grad=False)
        fft_check(lambda x: aten._fft_c2r(x, [1], 0, 12), _g(torch.complex128), placements, ctx.mesh, salt=i, grad=False)
        if any(p.is_partial() for p in placements):
            fft_check(lambda x: F.rfft(x, dim=0), _g(torch.float64), placements, ctx.mesh, salt=i, label="partial")
            x = _g(torch.float64)
            st = shard_from_global(x, make_spec(ctx.mesh, placements, tuple(x.shape)))
            with count_collectives() as c:
                y = F.fft(st, dim=2)
            assert any(p.is_partial() for p in y._spec.placements)  # kept pending: FFTs are linear
            assert c.total_calls == (1 if any(p.is_shard() and p.dim == 2 for p in placements) else 0), c.summary()


@distributed(timeout=120)
def test_non_contiguous_locals(ctx):
    """Local tensors in another memory order (last two dims transposed in memory) give the same results."""
    from physicsnemo_dp import ShardTensor

    from ..core._util import local_piece
    from ._check import _close, full

    for i, placements in enumerate(layouts(ctx.mesh, 3)):
        for dtype, fn in ((torch.float64, REAL_IN["rfft2 s"]), (torch.complex128, COMPLEX_IN["irfft2"])):
            g = _g(dtype)
            spec = make_spec(ctx.mesh, placements, tuple(g.shape), salt=i, dtype=dtype)
            piece = local_piece(g, spec)
            strided = piece.transpose(-1, -2).contiguous().transpose(-1, -2)
            x = ShardTensor(strided, spec, requires_grad=False)
            _close(full(fn(x)), fn(g), f"strided {placements}")
