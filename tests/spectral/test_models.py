"""The FNO and AFNO models of ``examples/spectral_models.py`` on ShardTensors equal one process.

Grids are small and odd-sized, so shards are uneven (with an empty one at 3
and 4 ranks) and the AFNO's patch boundaries fall inside shards; 1-D meshes
shard rows or columns, the 2x2 mesh batch x rows and rows x columns (two
sharded transformed dims). Forward output, input gradient and every parameter
gradient, float32 and float64.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import distributed

from ._conformance import check_model, placements_for

import spectral_models  # noqa: E402  (on sys.path through tests/spectral/__init__.py)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


@DTYPES
@distributed(timeout=120)
def test_fno(ctx, dtype):
    """Two Fourier layers; 11 x 9 grid: odd sizes, W // 2 + 1 = 5 frequency columns over up to 4 ranks."""
    model = spectral_models.FNO2d(c_in=1, c_out=1, width=6, modes=(3, 3), layers=2, dtype=dtype).to(ctx.device)
    x = torch.randn(2, 1, 11, 9, dtype=dtype).to(ctx.device)
    for i, placements in enumerate(placements_for(ctx.mesh, (2, 3))):
        check_model(model, x, ctx.mesh, placements, salt=i)


@DTYPES
@distributed(timeout=120)
def test_afno(ctx, dtype):
    """Two AFNO blocks, 14 x 10 image, 2x2 patches -> a 7 x 5 token grid; 60 % of the modes kept."""
    model = spectral_models.AFNONet((14, 10), patch=2, dim=8, depth=2, num_blocks=2, mlp_ratio=2.0,
                                    hard_thresholding_fraction=0.6).to(device=ctx.device, dtype=dtype)
    x = torch.randn(2, 1, 14, 10, dtype=dtype).to(ctx.device)
    for i, placements in enumerate(placements_for(ctx.mesh, (2, 3))):
        check_model(model, x, ctx.mesh, placements, salt=i)


@pytest.mark.parametrize("compiling", [False, True], ids=["eager-form", "traced-form"])
def test_spectral_conv_real_product_is_the_complex_einsum(compiling, monkeypatch):
    """SpectralConv2d's two forms, the complex ``einsum`` run eagerly and the real block ``einsum`` on the
    spectrum's real view taken while torch.compile traces (forced here by patching ``is_compiling``), give
    the public FNO's complex ``einsum`` of its complex weights: output, input gradient and weight
    gradients, float64, with the modes capped by a small grid (11 x 9: 5 rows, 5 columns of the half
    spectrum)."""
    calls = []
    monkeypatch.setattr(spectral_models.SpectralConv2d, "_real_product",
                        staticmethod(lambda *a: calls.append(1) or _REAL_PRODUCT(*a)))  # fmt: skip
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    torch.manual_seed(0)
    layer = spectral_models.SpectralConv2d(3, 4, 6, 6, dtype=torch.float64)
    x = torch.randn(2, 3, 11, 9, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w1, w2 = (w.detach().clone().requires_grad_() for w in (layer.weights1, layer.weights2))
    assert layer.weights1.dtype == torch.complex128 and layer.weights1.shape == (3, 4, 6, 6)
    m1, m2 = 5, 5
    x_ft = torch.fft.rfft2(x_ref)
    out_ft = torch.zeros(2, 4, 11, 5, dtype=torch.complex128)
    out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], w1[:, :, :m1, :m2])
    out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], w2[:, :, :m1, :m2])
    expected = torch.fft.irfft2(out_ft, s=(11, 9))
    got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    got.backward(g)
    expected.backward(g)
    for name, a, b in (("x", x.grad, x_ref.grad), ("weights1", layer.weights1.grad, w1.grad),
                       ("weights2", layer.weights2.grad, w2.grad)):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert len(calls) == (2 if compiling else 0), "the form taken is not the one the trace state selects"


_REAL_PRODUCT = spectral_models.SpectralConv2d._real_product


def test_models_reject_bad_sizes():
    """Sizes a model cannot take are refused with the argument and the fix."""
    with pytest.raises(ValueError, match=r"img_size=\(14, 9\) must be multiples of patch=2"):
        spectral_models.AFNONet((14, 9), patch=2)
    with pytest.raises(ValueError, match="dim=10 must be a multiple of num_blocks=4"):
        spectral_models.AFNO2D(10, num_blocks=4)
    with pytest.raises(ValueError, match="at least 2 rows"):
        spectral_models.FNO2d(width=4, modes=(2, 2), layers=1)(torch.randn(1, 1, 1, 8))


@distributed(world_sizes=(2,), mesh_2d=False)
def test_opt_einsum_backend(ctx):
    """opt_einsum (tensorly's einsum in neuraloperator) finds torch's functions for a ShardTensor.

    It picks an operand's library by the top-level module of its class
    (``physicsnemo_dp``) and falls back to NumPy without ``einsum`` /
    ``tensordot`` / ``transpose`` there. Checked directly, and through
    opt_einsum when it is installed.
    """
    import physicsnemo_dp
    from torch.distributed.tensor.placement_types import Shard

    from ..core._util import make_spec, shard_from_global

    x = torch.randn(2, 3, 5, 4, dtype=torch.complex128)
    w = torch.randn(3, 6, 5, 4, dtype=torch.complex128)
    xs = shard_from_global(x, make_spec(ctx.mesh, (Shard(2),), tuple(x.shape), dtype=x.dtype))
    expected = torch.einsum("bixy,ioxy->boxy", x, w)
    assert torch.equal(physicsnemo_dp.einsum("bixy,ioxy->boxy", xs, w).full_tensor(), expected)
    assert torch.allclose(physicsnemo_dp.tensordot(xs, w, axes=([1], [0])).full_tensor(),
                          torch.tensordot(x, w, dims=([1], [0])))
    assert torch.equal(physicsnemo_dp.transpose(xs, (0, 2, 1, 3)).full_tensor(), x.permute(0, 2, 1, 3))
    try:
        import opt_einsum
    except ImportError:
        return
    got = opt_einsum.contract("bixy,ioxy->boxy", xs, w)
    assert isinstance(got, physicsnemo_dp.ShardTensor)
    assert torch.allclose(got.full_tensor(), expected)


@distributed(world_sizes=(), timeout=120)
def test_fno_under_fsdp2_mixed_precision(ctx):
    """The FNO on the 2x2 mesh under FSDP2's bf16 ``MixedPrecisionPolicy`` and bf16 autocast, rows sharded unevenly.

    Its spectral weights are complex: FSDP2 leaves them complex64 and (``complex_policy``) reduces their
    gradients in complex64, where the policy's float32 ``reduce_dtype`` would fail the backward. One step's
    gradients equal one float32 process's on the whole batch within bf16 rounding.
    """
    from torch.distributed.tensor.placement_types import Shard

    from physicsnemo_dp.distributed import MeshContext, MixedPrecisionPolicy, parallelize_model

    from ..core._util import make_spec, shard_from_global

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    context = MeshContext.from_mesh(ctx.mesh, strategy="fsdp2", mixed_precision=policy)
    torch.manual_seed(0)
    reference = spectral_models.FNO2d(c_in=1, c_out=1, width=6, modes=(3, 3), layers=2)
    x = torch.randn(4, 1, 11, 9, generator=torch.Generator().manual_seed(1))
    for half in x.tensor_split(context.ddp_size):  # the global batch's mean loss: the mean of the halves'
        (reference(half).square().mean() / context.ddp_size).backward()
    torch.manual_seed(0)
    model = parallelize_model(spectral_models.FNO2d(c_in=1, c_out=1, width=6, modes=(3, 3), layers=2), context)
    mine = x.tensor_split(context.ddp_size)[context.ddp_rank]
    spec = make_spec(context.domain_mesh, [Shard(2)], tuple(mine.shape), "uneven", dtype=mine.dtype, salt=1)
    with torch.autocast(context.device.type, dtype=torch.bfloat16):
        out = model(shard_from_global(mine, spec))
    out.float().square().mean().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        grad = q.grad.full_tensor()
        assert grad.dtype == p.dtype, f"{name}: {grad.dtype}"
        scale = p.grad.abs().max().item()
        diff = (grad - p.grad).abs().max().item()
        # 4 bf16 units in the last place of the largest gradient (measured: at most 1.25)
        assert diff <= 4 * torch.finfo(torch.bfloat16).eps * scale, f"{name}: max abs diff {diff:.3e}, scale {scale:.3e}"
