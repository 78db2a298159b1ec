"""The elementwise fast path above the dispatcher steps aside wherever the dispatcher must see the op.

Elementwise functions on ShardTensors of one layout that record no gradient
run on the local tensors in ``__torch_function__`` (see
``rules/pointwise._elementwise_handler``). Checked against the full tensors in
one process, and that the usual route is taken when a gradient is recorded,
a dispatch mode watches, a dispatch handler is registered for the ATen op, a
pending sum is involved, or the call writes in place.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_dp import ShardTensor
from tests._harness import distributed
from tests.core._util import integer_tensor, make_spec, shard_from_global

aten = torch.ops.aten

CALLS = [
    lambda t: t + t, lambda t: 2.0 - t, lambda t: t * 0.5, lambda t: t / 3, lambda t: -t, lambda t: t**2,
    torch.tanh, torch.sigmoid, torch.exp, lambda t: torch.add(t, t, alpha=2), lambda t: torch.maximum(t, t * 2),
    F.gelu, F.silu, F.relu, lambda t: torch.relu(t * 0.5 + 1.0),
]  # fmt: skip


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shard_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.shard_ops += any(isinstance(a, ShardTensor) for a in args)
        return func(*args, **(kwargs or {}))


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_fast_path_matches_the_full_tensor_and_steps_aside(ctx):
    G = integer_tensor((7, 5), seed=1) / 4
    placements = (Shard(0),) * ctx.mesh.ndim if ctx.mesh.ndim == 1 else (Shard(0), Shard(1))
    spec = make_spec(ctx.mesh, placements, G.shape)
    for k, call in enumerate(CALLS):
        x = shard_from_global(G, spec)
        y = call(x)
        assert y._spec.dim_sizes == spec.dim_sizes and y._spec.placements == spec.placements, k
        assert torch.allclose(y.full_tensor(), call(G)), k
        # a recorded gradient takes the usual route (autograd sees the op)
        xg = shard_from_global(G, spec, requires_grad=True)
        yg = call(xg)
        assert yg.grad_fn is not None, k
        yg.sum().backward()
        ref = G.clone().requires_grad_(True)
        call(ref).sum().backward()
        assert torch.allclose(xg.grad.full_tensor(), ref.grad), k
        # a dispatch mode sees the ShardTensor op
        with _Seen() as seen:
            call(x)
        assert seen.shard_ops > 0, k


@distributed(world_sizes=(2,), mesh_2d=False)
def test_dispatch_handlers_pending_sums_and_in_place_calls_take_the_usual_route(ctx):
    G = integer_tensor((6, 4), seed=2)
    x = shard_from_global(G, make_spec(ctx.mesh, (Shard(0),), G.shape))
    called = []

    def handler(func, types, args, kwargs):
        called.append(func)
        from physicsnemo_dp.rules.pointwise import pointwise_rule

        return pointwise_rule(func, args, kwargs)

    ShardTensor.register_dispatch_handler(aten.tanh.default, handler)
    try:
        torch.tanh(x)
    finally:
        from physicsnemo_dp.dispatch.registry import dispatch_handlers

        dispatch_handlers.unregister(aten.tanh.default)
    assert called == [aten.tanh.default]
    p = shard_from_global(G, make_spec(ctx.mesh, (Partial(),), G.shape))
    assert torch.allclose(torch.tanh(p).full_tensor(), torch.tanh(G))  # reduced first, not tanh of contributions
    z = shard_from_global(G - 1, make_spec(ctx.mesh, (Shard(0),), G.shape))
    out = F.relu(z, True)
    assert out is z and torch.equal(z.full_tensor(), F.relu(G - 1))


def _rowwise_cases(mesh):
    """(placements, whole rows?) for a (rows, features) input normalized over its features."""
    if mesh.ndim == 2:
        return [((Shard(0), Shard(0)), True), ((Shard(0), Shard(1)), False)]
    return [((Shard(0),), True), ((Shard(1),), False), ((Partial(),), False)]


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_layer_norm_over_whole_rows_skips_the_plan_and_matches(ctx):
    """Rows whole on their rank: straight to torch's fused kernel (no meta call), same values and gradients."""
    import physicsnemo_dp.spatial.norm as norm

    G = integer_tensor((9, 6), seed=3) / 4
    ln = torch.nn.LayerNorm(6, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.copy_(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        ln.bias.copy_(torch.linspace(-1, 1, 6, dtype=torch.float64))
    ref_x = G.clone().requires_grad_(True)
    ref_y = ln(ref_x)
    (ref_y * G).sum().backward()
    ref = (ref_y.detach(), ref_x.grad, ln.weight.grad.clone(), ln.bias.grad.clone())
    meta_output, metas = norm.meta_output, []
    norm.meta_output = lambda *a: metas.append(1) or meta_output(*a)  # counts the general path's meta calls
    try:
        for placements, whole in _rowwise_cases(ctx.mesh):
            metas.clear()
            ln.zero_grad()
            x = shard_from_global(G, make_spec(ctx.mesh, placements, G.shape), requires_grad=True)
            y = ln(x)
            assert (not metas) == whole, placements
            (y * shard_from_global(G, y._spec)).sum().backward()
            got = (y.full_tensor(), x.grad.full_tensor(), ln.weight.grad, ln.bias.grad)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b)
    finally:
        norm.meta_output = meta_output
