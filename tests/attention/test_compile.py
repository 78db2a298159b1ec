"""Ring attention inside torch.compile: it runs eagerly at a graph break, and the results match eager."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global


def _g(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _block(q, k, v):
    return torch.sin(F.scaled_dot_product_attention(q * 2, k, v, is_causal=True)) + 1


def _inputs(mesh):
    spec = make_spec(mesh, (Shard(2),), (1, 2, 9, 3))
    return [shard_from_global(_g((1, 2, 9, 3), s), spec, requires_grad=True) for s in range(3)]


@distributed(world_sizes=(2,), mesh_2d=False, timeout=300)  # compiling is slow; the ring logic is covered elsewhere
def test_ring_runs_eagerly_in_a_compiled_function(ctx):
    import torch._dynamo

    P = ctx.world_size
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(_block, backend=backend)
        sharded, reference = _inputs(ctx.mesh), _inputs(ctx.mesh)
        with count_collectives() as fwd:
            out = compiled(*sharded)
        # the ring loop ran for real: P - 1 hops of key/value blocks
        assert fwd.calls == {"send_recv": P - 1}, (backend, dict(fwd.calls))
        expected = _block(*reference)
        assert torch.allclose(out.full_tensor(), expected.full_tensor(), atol=1e-12)
        grad = shard_from_global(_g(out.shape, 7), out._spec)
        with count_collectives() as bwd:
            torch.autograd.backward(out, grad)
        assert bwd.calls == {"send_recv": 2 * P - 2}, (backend, dict(bwd.calls))
        torch.autograd.backward(expected, grad)
        for a, b in zip(sharded, reference):
            assert torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), atol=1e-12)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_block)(*_inputs(ctx.mesh))
    first = explained.break_reasons[0]
    assert "ring attention" in first.reason  # the graph breaks at the attention call, on purpose
    assert "scaled_dot_product_attention" in first.user_stack[-1].line
    torch._dynamo.reset()


class _Regional(nn.Module):
    """The recommended pattern: compile the token-wise parts, leave the attention call eager."""

    def __init__(self):
        super().__init__()
        self.pre = torch.compile(nn.Sequential(nn.Tanh()), backend="aot_eager")
        self.post = torch.compile(nn.Sequential(nn.SiLU()), backend="aot_eager")

    def forward(self, q, k, v):
        return self.post(F.scaled_dot_product_attention(self.pre(q), k, v, is_causal=True))


@distributed(world_sizes=(2,), mesh_2d=False, timeout=300)
def test_regional_compile_pattern(ctx):
    import torch._dynamo

    torch._dynamo.reset()
    model = _Regional()
    sharded, reference = _inputs(ctx.mesh), _inputs(ctx.mesh)
    with count_collectives() as fwd:
        out = model(*sharded)
    assert fwd.calls == {"send_recv": 1}
    expected = torch.nn.functional.silu(
        F.scaled_dot_product_attention(torch.tanh(reference[0]), *reference[1:], is_causal=True)
    )
    assert torch.allclose(out.full_tensor(), expected.full_tensor(), atol=1e-12)
    torch._dynamo.reset()
