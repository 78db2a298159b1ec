"""Differential check of a (possibly complex) op on ShardTensors against one process.

``tests/ops/_diff.check`` compares real outputs and gradients; FFTs take and
return complex tensors, whose gradients follow torch's conjugate-Wirtinger
convention. This helper compares complex values too, drives the backward with
a random cotangent of the output's dtype laid out like the output, and can
return the collective counts of the sharded forward and backward.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate

from physicsnemo_dp import ShardTensor, count_collectives

from ..core._util import make_spec, on_mesh_device, shard_from_global

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.complex128: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.complex64: dict(rtol=1e-5, atol=1e-4),
}


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    tol = TOL[expected.dtype]
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    if not torch.allclose(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale):
        raise AssertionError(f"{what}: max abs diff {(actual - expected).abs().max().item():.3e} (scale {scale:.2e})")


def cotangent(shape, dtype, seed=1234):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(tuple(shape), generator=g, dtype=torch.float64)
    if dtype.is_complex:
        w = torch.complex(w, torch.randn(tuple(shape), generator=g, dtype=torch.float64))
    return w.to(dtype)


def full(t):
    return t.full_tensor() if isinstance(t, ShardTensor) else t


def fft_check(fn, g, placements, mesh, *, kind="uneven", salt=0, label="", grad=True):
    """Compare ``fn(x)`` for a ShardTensor ``x`` (``g`` cut in ``placements``) with ``fn(g)``.

    Returns ``(sharded output, forward counter, backward counter)``.
    """
    where = f"{label} placements={placements}"
    g = on_mesh_device(g, mesh)  # ctx.device: cuFFT under PDP_TEST_DEVICE=cuda
    ref_in = g.detach().clone().requires_grad_(grad)
    spec = make_spec(mesh, placements, tuple(g.shape), kind, dtype=g.dtype, salt=salt)
    x = shard_from_global(g, spec, requires_grad=grad)
    ref = fn(ref_in)
    with count_collectives() as fwd:
        out = fn(x)
    assert isinstance(out, ShardTensor), f"{where}: output is {type(out).__name__}"
    assert tuple(out._local_tensor.shape) == tuple(out._spec.local_shape), f"{where}: local shape != spec's box"
    _close(full(out).detach(), ref.detach(), f"{where} output")
    if not grad:
        return out, fwd, None
    w = cotangent(ref.shape, ref.dtype).to(ref.device)
    ref.backward(w)
    spec = out._spec
    gspec = spec.with_layout(tuple(Replicate() if p.is_partial() else p for p in spec.placements), spec.dim_sizes)
    upstream = shard_from_global(w, gspec)
    before = upstream._local_tensor.clone()
    with count_collectives() as bwd:
        out.backward(upstream)
    # c2r's adjoint doubles half the spectrum in place, on its own buffers only
    assert torch.equal(upstream._local_tensor, before), f"{where}: backward changed the upstream gradient"
    assert x.grad is not None, f"{where}: no gradient"
    expected = tuple(Replicate() if p.is_partial() else p for p in x._spec.placements)
    assert isinstance(x.grad, ShardTensor) and x.grad._spec.placements == expected, f"{where}: grad layout"
    _close(full(x.grad), ref_in.grad, f"{where} grad")
    return out, fwd, bwd
