"""Complex ShardTensors in every rule family, against single-process torch.

Forward values and gradients (torch's conjugate Wirtinger convention: the
cotangents that ``_diff.check`` draws have imaginary parts, and some tests use
a real loss such as ``(y.abs() ** 2).sum()``), complex64 and complex128,
uneven shards with an empty one, world sizes 1-4 and the 2x2 mesh. Plain
complex ``nn.Parameter``s meeting ShardTensors are promoted like real ones:
their gradient is plain and summed over the mesh.

Why conjugation needs care: torch's ``x.conj()`` is a lazy bit on the tensor,
and the rules run local kernels inside ``__torch_dispatch__``, where torch
excludes the keys that resolve it; a local tensor must never keep the bit
(:func:`test_conjugate_bit_never_reaches_a_local_kernel`).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import PlacementError, ShardTensor, count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

DTYPES = (torch.complex64, torch.complex128)
SHAPE = (5, 7, 3)


def _c(shape, seed=0, dtype=torch.complex128):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _r(shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _real_of(dtype):
    return torch.float32 if dtype == torch.complex64 else torch.float64


def _layouts(mesh, ndim, dims=None):
    """Each shardable dim and Replicate (on the 2x2 mesh a representative subset: the sweep is quadratic)."""
    lay = layouts(mesh, ndim, dims)
    return lay if mesh.ndim == 1 else lay[:: max(1, len(lay) // 6)] + [lay[-1]]


UNARY = {
    "real": lambda x: x.real,
    "imag": lambda x: x.imag * 2,
    "conj": lambda x: x.conj() * (1 + 2j),
    "conj_physical": torch.conj_physical,
    "resolve_conj": lambda x: x.conj().resolve_conj(),
    "resolve_neg": lambda x: x.conj().imag.resolve_neg(),
    "imag_of_conj": lambda x: x.conj().imag,
    "abs": torch.abs,
    "abs_squared": lambda x: x.abs() ** 2,
    "angle": torch.angle,
    "view_as_real": torch.view_as_real,
    "view_as_real_of_conj": lambda x: torch.view_as_real(x.conj().resolve_conj()),
    "exp_mul": lambda x: torch.exp(x) * x,
    "sgn": torch.sgn,
    "reciprocal_of_shifted": lambda x: 1 / (x + 3),
}


@distributed(world_sizes=OP_WORLD_SIZES)
def test_unary_complex_ops(ctx):
    for dtype in DTYPES:
        for name, fn in UNARY.items():
            for placements in _layouts(ctx.mesh, 3):
                check(fn, [(_c(SHAPE, 1, dtype), placements)], ctx.mesh, label=f"{name} {dtype}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_complex_from_parts(ctx):
    """``torch.complex``, ``polar`` and ``view_as_complex`` (real in, complex out), mixed layouts and plain parts."""
    for dtype in (torch.float32, torch.float64):
        lay = _layouts(ctx.mesh, 3)
        for pa in lay:
            for pb in (pa, lay[-1], None):
                a, b = _r(SHAPE, 2, dtype), _r(SHAPE, 3, dtype)
                check(torch.complex, [(a, pa), (b, pb)], ctx.mesh, label=f"complex {dtype}")
                check(lambda r, t: torch.polar(r.abs() + 0.5, t), [(a, pa), (b, pb)], ctx.mesh, label=f"polar {dtype}")
        for placements in _layouts(ctx.mesh, 4, dims=[0, 1, 2]):
            check(lambda x: torch.view_as_complex(x) * 2, [(_r((*SHAPE, 2), 4, dtype), placements)], ctx.mesh,
                  label=f"view_as_complex {dtype}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_partial_sums_stay_pending_through_complex_views(ctx):
    """Conjugation, ``torch.complex`` of two pending parts and the real/complex views are linear: no reduction."""
    mesh = ctx.mesh
    pspec = make_spec(mesh, [Partial()] * mesh.ndim, SHAPE, dtype=torch.complex128)
    g = _c(SHAPE, 5)
    x = shard_from_global(g, pspec)
    a = shard_from_global(g.real, make_spec(mesh, [Partial()] * mesh.ndim, SHAPE))
    with count_collectives() as counter:
        outs = {"conj": x.conj(), "view_as_real": torch.view_as_real(x), "complex": torch.complex(a, a),
                "view_as_complex": torch.view_as_complex(torch.view_as_real(x))}
    assert counter.total_calls == 0
    assert all(p.is_partial() for out in outs.values() for p in out.placements)
    torch.testing.assert_close(outs["conj"].full_tensor(), g.conj().resolve_conj())
    torch.testing.assert_close(outs["view_as_real"].full_tensor(), torch.view_as_real(g))
    torch.testing.assert_close(outs["complex"].full_tensor(), torch.complex(g.real, g.real))
    torch.testing.assert_close(outs["view_as_complex"].full_tensor(), g)


class _ComplexWeights(torch.nn.Module):
    """Plain complex parameters, promoted when they meet a ShardTensor (the FNO/AFNO pattern)."""

    def __init__(self, dtype, **shapes):
        super().__init__()
        for i, (name, shape) in enumerate(shapes.items()):
            self.register_parameter(name, torch.nn.Parameter(_c(shape, 10 + i, dtype)))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_contractions_with_complex_weights(ctx):
    """``x * w``, the FNO contraction ``einsum("bixy,ioxy->boxy")``, ``matmul``, ``F.linear``: input and parameter gradients."""
    mesh = ctx.mesh
    for dtype in DTYPES:
        for placements in _layouts(mesh, 4):
            x = _c((2, 3, 5, 4), 6, dtype)
            m = _ComplexWeights(dtype, w=(4,))
            check(lambda m, x: x * m.w, [(x, placements)], mesh, module=m, label=f"x*w {dtype}")
            # a real input meeting a complex weight: its gradient is the real part (torch's real-to-complex rule)
            check(lambda m, x: x * m.w + x, [(x.real.contiguous(), placements)], mesh, module=m,
                  label=f"real x * complex w {dtype}")
            m = _ComplexWeights(dtype, w=(3, 2, 5, 4))
            check(lambda m, x: torch.einsum("bixy,ioxy->boxy", x, m.w), [(x, placements)], mesh, module=m,
                  label=f"fno einsum {dtype}")
            m = _ComplexWeights(dtype, w=(4, 3))
            check(lambda m, x: torch.matmul(x, m.w), [(x, placements)], mesh, module=m, label=f"matmul {dtype}")
            m = _ComplexWeights(dtype, w=(6, 4), b=(6,))
            check(lambda m, x: F.linear(x, m.w, m.b), [(x, placements)], mesh, module=m, label=f"linear {dtype}")
            check(lambda m, x: torch.addmm(m.b, x.reshape(-1, 4), m.w.T, alpha=2 - 1j, beta=0.5j),
                  [(x, placements)], mesh, module=m, label=f"addmm complex alpha/beta {dtype}")
        # both operands sharded (a pending sum over a sharded contracted dim)
        for pa in _layouts(mesh, 3):
            check(torch.bmm, [(_c((2, 5, 4), 7, dtype), pa), (_c((2, 4, 3), 8, dtype), pa[::-1])], mesh,
                  label=f"bmm {dtype}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_real_loss_gradient_of_a_spectral_multiply(ctx):
    """``loss = (y.abs() ** 2).sum()`` and ``view_as_real(y).pow(2).sum()``: the gradients torch defines."""
    mesh = ctx.mesh
    for dtype in DTYPES:
        for placements in _layouts(mesh, 4):
            g, w0 = _c((2, 3, 5, 4), 9, dtype), _c((3, 2, 5, 4), 11, dtype)
            spec = make_spec(mesh, placements, tuple(g.shape), dtype=dtype)
            for loss in (lambda y: (y.abs() ** 2).sum(), lambda y: torch.view_as_real(y).pow(2).sum()):
                x_ref, w_ref = g.clone().requires_grad_(), w0.clone().requires_grad_()
                loss(torch.einsum("bixy,ioxy->boxy", x_ref, w_ref) + x_ref.conj()[:, :2]).backward()
                x, w = shard_from_global(g, spec, requires_grad=True), w0.clone().requires_grad_()
                out = loss(torch.einsum("bixy,ioxy->boxy", x, w) + x.conj()[:, :2])
                out.backward()
                tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.complex64 else {}
                torch.testing.assert_close(out.full_tensor(), loss(torch.einsum("bixy,ioxy->boxy", g, w0)
                                                                   + g.conj()[:, :2]), **tol)
                torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **tol)
                assert not isinstance(w.grad, ShardTensor)
                torch.testing.assert_close(w.grad, w_ref.grad, **tol)


REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(1),
    "sum_keepdim": lambda x: x.sum((0, 2), keepdim=True),
    "mean": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(0),
    "abs_max": lambda x: x.abs().max(),
    "abs_amax_dim": lambda x: x.abs().amax(1),
    "vector_norm": lambda x: torch.linalg.vector_norm(x, dim=1),
}


@distributed(world_sizes=OP_WORLD_SIZES)
def test_complex_reductions(ctx):
    for dtype in DTYPES:
        for name, fn in REDUCTIONS.items():
            for placements in _layouts(ctx.mesh, 3):
                check(fn, [(_c(SHAPE, 12, dtype), placements)], ctx.mesh, label=f"{name} {dtype}")


JOINS = {
    "cat": lambda x, y: torch.cat([x, y, x], 1),
    "cat0": lambda x, y: torch.cat([y, x], 0),
    "stack": lambda x, y: torch.stack([x, y], 1),
    "narrow": lambda x, y: x.narrow(1, 2, 4) + y[:, 1:5],
    "slice_head": lambda x, y: x[:, :3],
    "slice_tail": lambda x, y: x[:, -3:] * y[-2:, -3:].sum(0),
    "slice_both_ends": lambda x, y: torch.cat([x[:, :2], x[:, -2:]], 1),
    "select": lambda x, y: x.select(1, -1) + y[:, 0],
    "pad_constant": lambda x, y: F.pad(x, (1, 2, 0, 3)),
    "flip": lambda x, y: x.flip(1),
    "roll": lambda x, y: x.roll(3, 1),
}


@distributed(world_sizes=OP_WORLD_SIZES)
def test_complex_joins_slices_and_pads(ctx):
    for dtype in DTYPES:
        for name, fn in JOINS.items():
            for placements in _layouts(ctx.mesh, 3):
                check(fn, [(_c(SHAPE, 13, dtype), placements), (_c(SHAPE, 14, dtype), placements)], ctx.mesh,
                      label=f"{name} {dtype}")


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
@distributed(world_sizes=(1, 3, 4))
def test_complex_spatial_pad(ctx, mode):
    """``F.pad`` of a complex image sharded along its spatial dims (halo exchanges carry complex values)."""
    for dtype in DTYPES:
        for placements in _layouts(ctx.mesh, 4, dims=[0, 2, 3]):
            check(lambda x: F.pad(x, (1, 2, 2, 1), mode=mode), [(_c((2, 3, 7, 6), 15, dtype), placements)],
                  ctx.mesh, label=f"pad {mode} {dtype}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_complex_factories(ctx):
    """``zeros_like``/``new_zeros`` with complex dtypes keep the sharding, also for a size differing
    only along unsharded dims (a spectrum buffer of other channels / half the last dim)."""
    mesh = ctx.mesh
    for placements in _layouts(mesh, 3):
        g = _r(SHAPE, 16)
        spec = make_spec(mesh, placements, SHAPE)
        x = shard_from_global(g, spec)
        for make, ref in [
            (lambda t: torch.zeros_like(t, dtype=torch.cfloat), torch.zeros(SHAPE, dtype=torch.cfloat)),
            (lambda t: t.new_zeros(SHAPE, dtype=torch.cdouble), torch.zeros(SHAPE, dtype=torch.cdouble)),
            (lambda t: torch.full_like(t, 1 - 2j, dtype=torch.cdouble), torch.full(SHAPE, 1 - 2j, dtype=torch.cdouble)),
            (lambda t: t.new_ones((5, 7, 2), dtype=torch.cfloat), torch.ones((5, 7, 2), dtype=torch.cfloat)),
            (lambda t: t.new_zeros((2, 7, 3), dtype=torch.cdouble), torch.zeros((2, 7, 3), dtype=torch.cdouble)),
        ]:
            out = make(x)
            assert out.dtype == ref.dtype and tuple(out._local_tensor.shape) == tuple(out._spec.local_shape)
            assert torch.equal(out.full_tensor(), ref)
            kept = all(t is None or ref.shape[d] == SHAPE[d] for d, t in enumerate(spec.dim_sizes))
            if kept:  # laid out like x: no rank holds the global tensor
                assert out.placements == x.placements and out._spec.dim_sizes == spec.dim_sizes
        cz = torch.zeros_like(shard_from_global(_c(SHAPE, 17), make_spec(mesh, placements, SHAPE, dtype=torch.cdouble)))
        assert cz.dtype == torch.cdouble and torch.equal(cz.full_tensor(), torch.zeros(SHAPE, dtype=torch.cdouble))


def _assemble(x_ft, w1, w2, m1, m2):
    """The FNO spectrum assembly: low and high modes of dim -2, low modes of dim -1, into a zero spectrum."""
    b, _, h, w = x_ft.shape
    out = x_ft.new_zeros((b, w1.shape[1], h, w)) if isinstance(x_ft, ShardTensor) else torch.zeros(
        (b, w1.shape[1], h, w), dtype=x_ft.dtype)
    out[..., :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[..., :m1, :m2], w1)
    out[..., -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[..., -m1:, :m2], w2)
    return out


@distributed(world_sizes=OP_WORLD_SIZES)
def test_spectrum_assembly_by_slice_assignment(ctx):
    """``out[..., :m1, :m2] = y`` and ``out[..., -m1:, :m2] = y2`` with ``out`` sharded on the sliced dim
    (uneven, empty shards, modes spanning and missing ranks), forward and gradients of input and weights."""
    mesh = ctx.mesh
    for dtype in DTYPES:
        for m1, m2 in [(2, 3), (3, 1), (1, 4)]:
            for placements in _layouts(mesh, 4, dims=[0, 2]):
                m = _ComplexWeights(dtype, w1=(3, 2, m1, m2), w2=(3, 2, m1, m2))
                check(lambda m, x: _assemble(x, m.w1, m.w2, m1, m2), [(_c((2, 3, 7, 5), 18, dtype), placements)],
                      mesh, module=m, label=f"assemble m1={m1} m2={m2} {dtype}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_conjugate_bit_never_reaches_a_local_kernel(ctx):
    """Lazy conjugation/negation is resolved before any local kernel, collective or reinterpretation sees it.

    Inside ``__torch_dispatch__`` torch excludes the Conjugate/Negative keys, so a local tensor
    keeping the bit would be read as its raw memory (a silent wrong sign): ``from_local`` of a
    ``conj()`` view, ``x.conj()`` and ``imag`` of a conjugate must all hold resolved values.
    """
    mesh = ctx.mesh
    g = _c(SHAPE, 19)
    for placements in _layouts(mesh, 3):
        spec = make_spec(mesh, placements, SHAPE, dtype=g.dtype)
        x = shard_from_global(g, spec)
        y = x.conj()
        assert not y.is_conj() and not y._local_tensor.is_conj()
        assert not y.imag._local_tensor.is_neg()
        ref = g.conj().resolve_conj()
        assert torch.equal((y * 1).full_tensor(), ref)
        assert torch.equal(torch.view_as_real(y).full_tensor(), torch.view_as_real(ref))
        assert torch.equal(y.view(torch.float64).full_tensor(), ref.view(torch.float64))
        assert torch.equal(y.imag.full_tensor(), -g.imag)
        assert torch.equal(y.redistribute(placements=[Replicate()] * mesh.ndim).to_local(), ref)
        # a user's conjugate view handed to from_local
        local = g[tuple(slice(o, o + n) for o, n in zip(spec.local_offsets(), spec.local_shape))].conj()
        z = ShardTensor.from_local(local, mesh, spec.placements, sharding_shapes="infer", global_shape=SHAPE)
        assert not z._local_tensor.is_conj()
        assert torch.equal((z + 0).full_tensor(), ref) and torch.equal(torch.view_as_real(z).full_tensor(),
                                                                         torch.view_as_real(ref))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_view_as_complex_of_a_sharded_last_dim_is_refused(ctx):
    """The (real, imaginary) pair must be whole on a rank: the same PlacementError on every rank, no hang."""
    mesh = ctx.mesh
    spec = make_spec(mesh, [Shard(2)] + [Replicate()] * (mesh.ndim - 1), (4, 3, 2))
    x = shard_from_global(_r((4, 3, 2), 20), spec)
    with pytest.raises(PlacementError, match="view_as_complex: the last dim .* is sharded"):
        torch.view_as_complex(x)
    # after a redistribution that leaves the last dim whole, it works
    y = x.redistribute(placements=[Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    assert torch.equal(torch.view_as_complex(y).full_tensor(), torch.view_as_complex(_r((4, 3, 2), 20)))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_complex_variance_along_a_sharded_dim(ctx):
    """``var``/``std``/``var_mean`` of complex data: the squared deviations are ``|dev|^2`` (a real result)."""
    for dtype in DTYPES:
        for placements in _layouts(ctx.mesh, 3):
            for fn in (lambda x: x.var(1), lambda x: x.std(0, keepdim=True), lambda x: torch.var_mean(x, (0, 2))):
                check(fn, [(_c(SHAPE, 21, dtype), placements)], ctx.mesh, label=f"var {dtype}")
