"""The spectral block of an FNO on a grid sharded along H: communication and the mode-truncation pattern.

``rfft2`` of ``x`` sharded along ``H`` leaves the half spectrum sharded along
its last dim (``W // 2 + 1``); ``irfft2`` brings it back. Each costs exactly
one all-to-all (per mesh dim that shards ``H``), moving exactly the bytes of
the transpose. The FNO pattern in between (``x_ft[..., :m1, :m2]``,
``x_ft[..., -m1:, :m2]``, a zero spectrum filled by slice assignment,
``irfft2(out_ft, s=(H, W))``) moves nothing else.
"""

import inspect

import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import ShardTensor, count_collectives, implicit_gathers
from physicsnemo_dp._gathers import FIX_PLAIN_BUFFER, listening
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._check import _close, cotangent, full

B, C, H, W = 2, 3, 11, 9  # H prime, W odd: W // 2 + 1 = 5 frequencies over up to 4 ranks
M1, M2 = 3, 3


def _grid(dtype=torch.float64, seed=0):
    return torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _h_sharded(mesh):
    return (Shard(2),) if mesh.ndim == 1 else (Shard(0), Shard(2))


def _transpose_bytes(spec_from, spec_to, d_from, d_to, shape, itemsize):
    """Bytes this rank must send to move ``shape`` from sharding ``d_from`` to sharding ``d_to``."""
    mine_from = spec_from.local_shape[d_from]
    keep_to = spec_to.local_shape[d_to]
    rest = 1
    for d, n in enumerate(shape):
        if d not in (d_from, d_to):
            rest *= spec_from.local_shape[d] if d != d_to else n
    return mine_from * (shape[d_to] - keep_to) * rest * itemsize


@distributed
def test_rfft2_irfft2_pair_moves_only_the_transposes(ctx):
    for kind in ("chunk", "uneven"):
        g = _grid()
        spec = make_spec(ctx.mesh, _h_sharded(ctx.mesh), tuple(g.shape), kind)
        x = shard_from_global(g, spec)
        with count_collectives() as fwd:
            x_ft = torch.fft.rfft2(x)
        with count_collectives() as inv:
            y = torch.fft.irfft2(x_ft, s=(H, W))
        _close(full(x_ft), torch.fft.rfft2(g), f"{kind} rfft2")
        _close(full(y), g, f"{kind} round trip")
        moved = ctx.mesh.size(ctx.mesh.ndim - 1) > 1  # the mesh dim sharding H splits it: transposes
        if moved:
            assert x_ft._spec.placements[-1] == Shard(3), x_ft._spec  # left transposed: frequency-sharded
        assert y._spec.placements == x._spec.placements
        assert set(fwd.calls) == set(inv.calls) == ({"all_to_all"} if moved else set()), (fwd.summary(), inv.summary())
        assert fwd.calls["all_to_all"] == inv.calls["all_to_all"] == int(moved)
        shape = tuple(x_ft.shape)
        minimum = _transpose_bytes(x._spec, x_ft._spec, 2, 3, shape, 16) + _transpose_bytes(
            x_ft._spec, y._spec, 3, 2, shape, 16
        )
        sent = fwd.total_sent + inv.total_sent
        assert sent <= 1.1 * minimum, (sent, minimum)
        if moved and kind == "chunk":
            assert minimum > 0


class _Records:
    def __init__(self):
        self.found = []

    def implicit_gather(self, record):
        self.found.append(record)


def _spectral(x, w1, w2, zeros):
    """The FNO spectral convolution of Li et al. (fourier_2d.py), with a pluggable zero spectrum."""
    h, w = x.shape[-2:]
    x_ft = torch.fft.rfft2(x)
    out_ft = zeros(x_ft)
    out_ft[:, :, :M1, :M2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :M1, :M2], w1)
    out_ft[:, :, -M1:, :M2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -M1:, :M2], w2)
    return torch.fft.irfft2(out_ft, s=(h, w))


def _weights(dtype=torch.complex128):
    gen = torch.Generator().manual_seed(7)
    re = torch.randn(2, C, C, M1, M2, generator=gen, dtype=torch.float64)
    im = torch.randn(2, C, C, M1, M2, generator=gen, dtype=torch.float64)
    return torch.complex(re, im).to(dtype)


ZEROS = {
    "zeros_like": lambda x_ft: torch.zeros_like(x_ft),
}


@distributed(timeout=120)
def test_fno_mode_truncation_and_assembly(ctx):
    for name, zeros in ZEROS.items():
        for kind in ("uneven", "chunk"):
            w = _weights()
            w1 = torch.nn.Parameter(w[0].clone())
            w2 = torch.nn.Parameter(w[1].clone())
            r1 = w[0].clone().requires_grad_(True)
            r2 = w[1].clone().requires_grad_(True)
            fn = lambda x: _spectral(x, w1, w2, zeros)  # noqa: E731
            ref_fn = lambda x: _spectral(x, r1, r2, zeros)  # noqa: E731
            g = _grid()
            ref_in = g.clone().requires_grad_(True)
            ref = ref_fn(ref_in)
            spec = make_spec(ctx.mesh, _h_sharded(ctx.mesh), tuple(g.shape), kind)
            x = shard_from_global(g, spec, requires_grad=True)
            with count_collectives() as fwd:
                y = fn(x)
            _close(full(y).detach(), ref.detach(), f"{name} {kind} forward")
            moved = ctx.mesh.size(ctx.mesh.ndim - 1) > 1
            assert set(fwd.calls) == ({"all_to_all"} if moved else set()), fwd.summary()  # no gather anywhere
            assert fwd.calls["all_to_all"] == 2 * moved, fwd.summary()  # one each way
            ct = cotangent(ref.shape, ref.dtype)
            ref.backward(ct)
            y.backward(shard_from_global(ct, y._spec))
            _close(full(x.grad), ref_in.grad, f"{name} {kind} grad x")
            _close(w1.grad, r1.grad, f"{name} {kind} grad w1")
            _close(w2.grad, r2.grad, f"{name} {kind} grad w2")


@distributed(world_sizes=(2, 3), mesh_2d=True, timeout=120)
def test_fno_plain_zero_spectrum(ctx):
    """Public FNO code builds ``out_ft`` with a plain ``torch.zeros`` of the global shape.

    Assigning the sharded modes into it makes every rank hold the whole
    (replicated) spectrum: correct values and gradients, at the price of an
    all-gather of the retained modes (never the full spectrum) and a
    replicated inverse transform.
    """
    w = _weights()
    w1, w2 = torch.nn.Parameter(w[0].clone()), torch.nn.Parameter(w[1].clone())
    r1, r2 = w[0].clone().requires_grad_(True), w[1].clone().requires_grad_(True)
    zeros = lambda x_ft: torch.zeros(tuple(x_ft.shape), dtype=x_ft.dtype, device=x_ft.device)  # noqa: E731
    g = _grid()
    ref_in = g.clone().requires_grad_(True)
    ref = _spectral(ref_in, r1, r2, zeros)
    x = shard_from_global(g, make_spec(ctx.mesh, _h_sharded(ctx.mesh), tuple(g.shape), "uneven"), requires_grad=True)
    with count_collectives() as fwd, implicit_gathers("allow"), listening(_Records()) as sink:
        y = _spectral(x, w1, w2, zeros)
    assert not isinstance(y, ShardTensor) and y.requires_grad  # replicated from the plain buffer on
    # reported (issue 27 point 1): one implicit gather per written block, at the line that writes it
    lines = inspect.getsource(_spectral).splitlines()
    first = _spectral.__code__.co_firstlineno
    writes = [f"{__file__}:{first + i}" for i, text in enumerate(lines) if text.lstrip().startswith("out_ft[")]
    assert len(writes) == 2 and [r.source for r in sink.found] == writes, [str(r) for r in sink.found]
    assert all(
        r.fix == FIX_PLAIN_BUFFER and r.kind.startswith("sharded values written into a plain tensor")
        for r in sink.found
    )
    _close(y.detach(), ref.detach(), "forward")
    modes = 2 * B * C * M1 * M2 * 16  # the two written blocks, complex128
    assert fwd.bytes_received["all_gather"] <= modes, fwd.summary()  # never the full spectrum
    ct = cotangent(ref.shape, ref.dtype)
    ref.backward(ct)
    y.backward(ct)
    _close(full(x.grad), ref_in.grad, "grad x")
    _close(w1.grad, r1.grad, "grad w1")
    _close(w2.grad, r2.grad, "grad w2")
