"""``torch.autocast`` on ShardTensors: every family gives one process's output dtypes, values and gradient dtypes.

Each case runs a function under ``torch.autocast(device, dtype)`` twice on every
rank: on the plain global tensors (the single-process reference) and on
ShardTensors cut from them with uneven shards. Compared: the output's dtype
(exactly), its values (within a few units in the last place of the low dtype,
relative to the output's scale: shard boundaries change summation orders), and
the gradients of every input and parameter (dtype exactly, values likewise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp._redistribute import grad_layout
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, _comparable

LOW = [torch.bfloat16, torch.float16]
#: Units in the last place of the low dtype (relative to the reference's largest magnitude) a value may differ by.
ULPS = 8


def _g(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _sharded(mesh, g, dims, salt):
    """``g`` as a ShardTensor leaf sharded along ``dims`` (one per mesh dim; ``None``: replicated)."""
    dims = (dims,) if not isinstance(dims, tuple) else dims
    dims = (dims * mesh.ndim)[: mesh.ndim]
    placements = tuple(Replicate() if d is None else Shard(d) for d in dims)
    spec = make_spec(mesh, placements, tuple(g.shape), dtype=g.dtype, salt=salt)
    return shard_from_global(g, spec, requires_grad=True)


def _close(actual, expected, what, low):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != one process's {expected.dtype}"
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    atol = ULPS * torch.finfo(low).eps * max(scale, 1e-3)
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item() if expected.numel() else 0.0
    assert diff <= atol, f"{what}: max abs diff {diff:.3e} > {atol:.3e} (scale {scale:.3e})"


def _run(ctx, low, fn, inputs, module=None, label="", sharded_fn=None):
    """Compare ``fn(*inputs)`` (or ``fn(module, *inputs)``) under autocast with one process.

    ``inputs``: ``(global float32 tensor, dims)`` pairs; ``dims`` None keeps it plain (promoted).
    ``sharded_fn`` (default ``fn``) is what runs on the ShardTensors.
    """
    sharded_fn = sharded_fn or fn
    device = ctx.device.type if hasattr(ctx.device, "type") else torch.device(ctx.device).type
    ref_module = None
    if module is not None:
        import copy

        ref_module = copy.deepcopy(module)
    refs = [g.clone().requires_grad_() for g, _ in inputs]
    shards = [
        g.clone().requires_grad_() if dims is None else _sharded(ctx.mesh, g, dims, salt=i)
        for i, (g, dims) in enumerate(inputs)
    ]
    with torch.autocast(device, dtype=low):
        expected = fn(ref_module, *refs) if module is not None else fn(*refs)
        out = sharded_fn(module, *shards) if module is not None else sharded_fn(*shards)
    assert isinstance(out, ShardTensor), f"{label}: output is {type(out).__name__}"
    _close(*_comparable(out, expected), f"{label} output", low)
    cot = _g(expected.shape, 99).to(expected.dtype)
    torch.autograd.backward(expected, cot)
    torch.autograd.backward(out, shard_from_global(cot, grad_layout(out._spec)))
    for i, (s, r) in enumerate(zip(shards, refs)):
        assert s.grad is not None, f"{label}: input {i} got no gradient"
        _close(*_comparable(s.grad, r.grad), f"{label} grad of input {i}", low)
    if module is not None:
        for (name, p), (_, rp) in zip(module.named_parameters(), ref_module.named_parameters()):
            _close(p.grad, rp.grad, f"{label} grad of {name}", low)
    return out, expected


@pytest.mark.parametrize("low", LOW, ids=str)
@distributed(world_sizes=OP_WORLD_SIZES)
def test_convolutions(ctx, low):
    x1, x2, x3 = _g((2, 3, 13), 0), _g((2, 3, 11, 9), 1), _g((1, 2, 7, 6, 5), 2)
    w1, w2, w3 = _g((4, 3, 3), 3), _g((4, 3, 3, 3), 4), _g((3, 2, 3, 3, 3), 5)
    b = _g((4,), 6)
    cases = [
        ("conv1d", lambda x, w, b: F.conv1d(x, w, b, padding=1), [(x1, 2), (w1, None), (b, None)]),
        ("conv2d same", lambda x, w, b: F.conv2d(x, w, b, padding="same"), [(x2, (2, 3)), (w2, None), (b, None)]),
        ("conv2d stride 2", lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), [(x2, (2, 3)), (w2, None), (b, None)]),
        ("conv3d", lambda x, w: F.conv3d(x, w, padding=1), [(x3, (2, 4)), (w3, None)]),
        ("conv_transpose1d", lambda x, w: F.conv_transpose1d(x, w, stride=2, padding=1), [(x1, 2), (w1.transpose(0, 1).contiguous(), None)]),
        ("conv_transpose2d", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), [(x2, (2, 3)), (_g((3, 4, 2, 2), 7), None), (b, None)]),
        ("conv_transpose3d", lambda x, w: F.conv_transpose3d(x, w, padding=1), [(x3, (3, 2)), (w3.transpose(0, 1).contiguous(), None)]),
    ]
    for label, fn, inputs in cases:
        _run(ctx, low, fn, inputs, label=label)
    for mode in ("reflect", "replicate", "circular"):
        torch.manual_seed(0)
        conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
        _run(ctx, low, lambda m, x: m(x), [(x2, (2, 3))], module=conv, label=f"Conv2d {mode}")


@pytest.mark.parametrize("low", LOW, ids=str)
@distributed(world_sizes=OP_WORLD_SIZES)
def test_contractions(ctx, low):
    a, w, b = _g((2, 9, 8), 0), _g((5, 8), 1), _g((5,), 2)
    cases = [
        ("linear", lambda x, w, b: F.linear(x, w, b), [(a, 1), (w, None), (b, None)]),
        ("matmul", lambda x, w: x @ w.t(), [(a, 1), (w, None)]),
        ("matmul sharded contraction", lambda x, y: x @ y, [(a, 2), (_g((8, 5), 3), 0)]),
        ("einsum", lambda x, w: torch.einsum("bij,kj->bik", x, w), [(a, 1), (w, None)]),
        ("bmm", lambda x, y: torch.bmm(x, y), [(a, 1), (_g((2, 8, 4), 4), None)]),
    ]
    for label, fn, inputs in cases:
        _run(ctx, low, fn, inputs, label=label)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    _run(ctx, low, lambda m, x: m(x), [(a, 1)], module=mlp, label="Linear-GELU-Linear")


@pytest.mark.parametrize("low", LOW, ids=str)
@distributed(world_sizes=OP_WORLD_SIZES)
def test_attention(ctx, low):
    q, k, v = _g((1, 2, 10, 8), 0), _g((1, 2, 11, 8), 1), _g((1, 2, 11, 8), 2)
    sdpa = F.scaled_dot_product_attention
    cases = [
        ("local (sharded queries)", sdpa, [(q, 2), (k, None), (v, None)]),
        ("ring", sdpa, [(q, 2), (k, 2), (v, 2)]),
        ("ring causal", lambda q, k, v: sdpa(q, k, v, is_causal=True), [(q, 2), (k[:, :, :10].contiguous(), 2), (v[:, :, :10].contiguous(), 2)]),
        ("lse merge (sharded keys)", sdpa, [(q, None), (k, 2), (v, 2)]),
    ]
    for label, fn, inputs in cases:
        _run(ctx, low, fn, inputs, label=label)
    torch.manual_seed(0)
    x = _g((2, 10, 16), 3)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)  # the fused kernels through the dispatcher
    _run(ctx, low, lambda m, x: m(x, x, x, need_weights=False)[0], [(x, 1)], module=mha, label="MultiheadAttention")
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    _run(ctx, low, lambda m, x: m(x), [(x, 1)], module=layer, label="TransformerEncoderLayer")


@pytest.mark.parametrize("low", LOW, ids=str)
@distributed(world_sizes=OP_WORLD_SIZES)
def test_float32_families(ctx, low):
    """Norms, FFTs and losses after a low-precision conv: autocast's float32 ops give what one process gives."""
    x, w, t = _g((2, 3, 11, 9), 0), _g((4, 3, 3, 3), 1), _g((2, 4, 11, 9), 2)

    def conv(x, w):
        return F.conv2d(x, w, padding=1)

    cases = [
        ("layer_norm", lambda x, w: F.layer_norm(conv(x, w), (9,)), [(x, 2), (w, None)]),
        ("group_norm", lambda x, w: F.group_norm(conv(x, w), 2), [(x, (2, 3)), (w, None)]),
        ("batch_norm", lambda x, w: F.batch_norm(conv(x, w), None, None, training=True), [(x, (2, 3)), (w, None)]),
        ("rfft2", lambda x, w: torch.fft.rfft2(conv(x, w)).abs(), [(x, 2), (w, None)]),
        ("fftn", lambda x, w: torch.fft.fftn(conv(x, w), dim=(2, 3)).real, [(x, (2, 3)), (w, None)]),
        ("squared error", lambda x, w, t: ((conv(x, w) - t) ** 2).mean(), [(x, (2, 3)), (w, None), (t, (2, 3))]),
        ("l1_loss", lambda x, w, t: F.l1_loss(conv(x, w), t, reduction="sum"), [(x, 2), (w, None), (t, 2)]),
        ("mse_loss", lambda x, w, t: F.mse_loss(conv(x, w), t), [(x, (2, 3)), (w, None), (t, (2, 3))]),
        ("cross_entropy probabilities", lambda x, w, t: F.cross_entropy(conv(x, w), t.softmax(1)), [(x, 2), (w, None), (t, 2)]),
        ("softmax", lambda x, w: torch.softmax(conv(x, w), dim=2), [(x, (2, 3)), (w, None)]),
    ]
    for label, fn, inputs in cases:
        _run(ctx, low, fn, inputs, label=label)
    torch.manual_seed(0)
    for norm in (nn.GroupNorm(2, 4), nn.BatchNorm2d(4), nn.InstanceNorm2d(4, affine=True)):
        # no conv bias: a norm cancels it, so its gradient would be rounding noise on both sides
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), norm)
        _run(ctx, low, lambda m, x: m(x), [(x, (2, 3))], module=model, label=type(norm).__name__)


@pytest.mark.parametrize("low", LOW, ids=str)
@distributed(world_sizes=OP_WORLD_SIZES)
def test_windows_and_pointwise(ctx, low):
    """Pooling, interpolation and padding of a low-precision activation; pointwise ops between mixed dtypes."""
    x, w, y = _g((2, 3, 12, 10), 0), _g((4, 3, 3, 3), 1), _g((2, 4, 12, 10), 2)
    x3, w3 = _g((1, 2, 6, 7, 4), 3), _g((3, 2, 3, 3, 3), 4)

    def conv(x, w):
        return F.conv2d(x, w, padding=1)

    cases = [
        ("max_pool2d", lambda x, w: F.max_pool2d(conv(x, w), 2), [(x, (2, 3)), (w, None)]),
        ("avg_pool2d", lambda x, w: F.avg_pool2d(conv(x, w), 3, stride=2, padding=1), [(x, (2, 3)), (w, None)]),
        ("adaptive_avg_pool2d", lambda x, w: F.adaptive_avg_pool2d(conv(x, w), (5, 4)), [(x, 2), (w, None)]),
        ("interpolate bilinear", lambda x, w: F.interpolate(conv(x, w), scale_factor=2, mode="bilinear"), [(x, (2, 3)), (w, None)]),
        ("interpolate nearest", lambda x, w: F.interpolate(conv(x, w), size=(7, 15)), [(x, 2), (w, None)]),
        ("pad reflect (float32 on CPU)", lambda x, w: F.pad(conv(x, w), (1, 2, 2, 1), mode="reflect"), [(x, (2, 3)), (w, None)]),
        ("avg_pool3d (float32 on CPU)", lambda x, w: F.avg_pool3d(F.conv3d(x, w, padding=1), 2), [(x3, (2, 3)), (w3, None)]),
        ("cat low, float32 (promote)", lambda x, w, y: torch.cat([conv(x, w), y], dim=1), [(x, (2, 3)), (w, None), (y, (2, 3))]),
        ("low + float32", lambda x, w, y: conv(x, w) + y, [(x, (2, 3)), (w, None), (y, (2, 3))]),
        ("low * float32 plain", lambda x, w, y: conv(x, w) * y[0], [(x, 2), (w, None), (y, None)]),
        ("slice of low", lambda x, w: conv(x, w)[:, 1:3, 2:9], [(x, (2, 3)), (w, None)]),
        ("low gelu, sum", lambda x, w: F.gelu(conv(x, w)).sum(dim=(2, 3)), [(x, (2, 3)), (w, None)]),
    ]
    for label, fn, inputs in cases:
        _run(ctx, low, fn, inputs, label=label)


@pytest.mark.parametrize("poison", [False, True])
@distributed(world_sizes=(3,), mesh_2d=False)
def test_grad_scaler_skips_the_step_on_every_rank(ctx, poison):
    """``torch.amp.GradScaler`` with a sharded float16 forward: an inf/NaN in one rank's shard skips every rank's step.

    The parameters are plain (promoted): their gradients are summed over the mesh before
    the scaler reads them, so every rank finds the same non-finite gradient and skips alike.
    """
    device = torch.device(ctx.device).type
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    before = [p.detach().clone() for p in conv.parameters()]
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8)
    g = _g((2, 3, 12, 10), 0)
    x = _sharded(ctx.mesh, g, 2, salt=1).detach()
    if poison and ctx.rank == 1:
        assert x._local_tensor.numel() > 0
        x._local_tensor[0, 0, 0, 0] = float("inf")  # only this rank's shard holds it
    with torch.autocast(device, dtype=torch.float16):
        out = conv(x)
        assert out.dtype == torch.float16
        loss = out.float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    changed = [not torch.equal(p.detach(), b) for p, b in zip(conv.parameters(), before)]
    assert changed == [not poison] * 2, f"rank {ctx.rank}: parameters changed {changed}"
    assert scaler.get_scale() == (2.0**7 if poison else 2.0**8)


@distributed(world_sizes=(3,), mesh_2d=False, timeout=180)
def test_compiled_under_autocast(ctx):
    """A compiled region under autocast gets the policy too (probed on real metadata while Dynamo traces)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU(), nn.Conv2d(4, 2, 3, padding=1))
    compiled = torch.compile(lambda m, x: m(x), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    try:
        out, _ = _run(ctx, torch.bfloat16, lambda m, x: m(x), [(_g((2, 3, 12, 10), 0), 2)], module=model,
                      label="compiled CNN", sharded_fn=compiled)
    finally:
        torch._dynamo.reset()
    assert out.dtype == torch.bfloat16
