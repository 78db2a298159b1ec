"""One model on ShardTensors against the same model on the full tensors in one process (run on every rank).

:func:`check_model` deep-copies the model, runs the copy on the global input
and the original on a ShardTensor cut from it with deliberately uneven shard
sizes (empty shards where the mesh allows), then drives both backwards with
the same random cotangent and compares the output, the input's gradient and
every parameter's gradient. Errors are relative to the largest magnitude of
the reference tensor (a model's outputs and weight gradients are sums of many
terms whose order differs between layouts; an element-wise relative error
would judge the rounding of near-zero elements).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor

from ..core._util import make_spec, shard_from_global

#: relative tolerance per dtype (issue 16: float64 to 1e-10, float32 to 1e-5)
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def placements_for(mesh, spatial: tuple[int, int]) -> list[tuple]:
    """Layouts to check: each spatial dim alone on a 1-D mesh; batch x rows and rows x columns on a 2-D mesh."""
    h, w = spatial
    if mesh.ndim == 1:
        return [(Shard(h),), (Shard(w),)]
    return [(Shard(0), Shard(h)), (Shard(h), Shard(w))]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """``max |actual - expected| <= rtol * max |expected|`` (and equal shapes)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= rtol * max(scale, 1e-30), (
        f"{what}: max abs diff {err:.3e} is {err / max(scale, 1e-30):.2e} of max |expected| {scale:.3e} "
        f"(tolerance {rtol:g})")


def check_model(model: torch.nn.Module, x: torch.Tensor, mesh, placements, *, salt: int = 0) -> ShardTensor:
    """Forward output, input gradient and every parameter gradient of ``model`` on a sharded ``x`` vs one process.

    Returns the sharded output (its layout may be checked further).
    """
    rtol = RTOL[x.dtype]
    where = f"placements {placements}, global input {tuple(x.shape)}"
    model.zero_grad(set_to_none=True)  # a previous check's gradients would add up (deepcopy drops .grad)
    reference = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(True)
    spec = make_spec(mesh, placements, tuple(x.shape), "uneven", dtype=x.dtype, salt=salt)
    x_sharded = shard_from_global(x, spec, requires_grad=True)

    expected = reference(x_ref)
    out = model(x_sharded)
    assert isinstance(out, ShardTensor), f"{where}: the output is a plain {type(out).__name__}"
    assert_close(out.full_tensor().detach(), expected.detach(), rtol, f"{where}: output")

    cotangent = torch.randn(tuple(expected.shape), generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    expected.backward(cotangent)
    layout = out.spec
    layout = layout.with_layout(tuple(Replicate() if p.is_partial() else p for p in layout.placements),
                                layout.dim_sizes)
    out.backward(shard_from_global(cotangent.to(x.device), layout))

    assert isinstance(x_sharded.grad, ShardTensor), f"{where}: the input's gradient is {type(x_sharded.grad)}"
    assert_close(x_sharded.grad.full_tensor(), x_ref.grad, rtol, f"{where}: input gradient")
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p_ref.grad is not None, f"reference parameter {name} got no gradient (a test without teeth)"
        assert p.grad is not None, f"{where}: parameter {name} got no gradient"
        assert not isinstance(p.grad, ShardTensor), f"{where}: parameter {name}'s gradient is a ShardTensor"
        assert_close(p.grad, p_ref.grad, rtol, f"{where}: gradient of {name}")
    return out
