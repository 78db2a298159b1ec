"""``physicsnemo_dp.rowwise``: an MLP fused into one node on the local rows equals the module on one process.

Differential checks (``tests/ops/_diff.check``): output, input gradient and
every parameter gradient against the unfused module on the full tensors, on
uneven shards with an empty one (3 ranks) and the 2x2 mesh (rows sharded over
both mesh dims: the parameters' gradients are summed over "ddp" and "domain"),
with a pending-sum input, with gradient buckets and under the checking mode.
At one rank the fused call runs the same local ops as plain torch: the same
bits. Then what it refuses and where it takes the module's own forward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint

import physicsnemo_dp
from physicsnemo_dp import PlacementError, ShardTensor, bucket_gradients, rowwise
from physicsnemo_dp.debug import checks
from physicsnemo_dp.fusion import is_rowwise
from physicsnemo_dp.promotion import clear_gradient_buckets
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..distributed._models import FEATURES, HIDDEN
from ._diff import OP_WORLD_SIZES, check


def _mlp(c_in=6, hidden=5, c_out=4, dtype=torch.float64):
    """Linear, SiLU, nested (Linear, GELU, eval Dropout, Identity), Linear, LayerNorm: every kind rowwise fuses."""
    torch.manual_seed(3)
    inner = nn.Sequential(nn.Linear(hidden, hidden, bias=False), nn.GELU(), nn.Dropout(0.5), nn.Identity())
    m = nn.Sequential(nn.Linear(c_in, hidden), nn.SiLU(), inner, nn.Linear(hidden, c_out), nn.LayerNorm(c_out))
    return m.to(dtype).eval()


def _fused(out) -> bool:
    """Whether ``out`` came from a fused call: one node over the local layers, or (rows on one-rank mesh dims only)
    the layers recorded by torch's autograd on the local rows between one entry and one exit node."""
    return out.grad_fn is not None and type(out.grad_fn).__name__ in ("_FusedBackward", "_LeaveBackward")


def _native(out) -> bool:
    return type(out.grad_fn).__name__ == "_LeaveBackward"


def _rows_alone(mesh, placements) -> bool:
    """Whether every mesh dim sharding the rows has one rank (the native path's condition)."""
    return all(mesh.size(m) == 1 for m, p in enumerate(placements) if isinstance(p, Shard))


def _layouts(mesh):
    if mesh.ndim == 1:
        return [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)]
    # rows over both mesh dims (ddp + domain: parameter gradients summed over both), one each, and pending sums
    return [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(1)), (Partial(), Shard(0))]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=120)
def test_rowwise_matches_one_process(ctx):
    """Output, input and parameter gradients of the fused module equal the unfused module's on the full tensors."""
    x = torch.randn(5, 7, 6, dtype=torch.float64)
    for buckets in (False, True):
        for placements in _layouts(ctx.mesh):
            module = rowwise(_mlp())
            if buckets:
                bucket_gradients(module)
            try:
                with checks():
                    out = check(
                        lambda m, t: m(t),
                        [(x, placements)],
                        ctx.mesh,
                        module=module,
                        label=f"rowwise buckets={buckets}",
                    )
            finally:
                clear_gradient_buckets()
            assert isinstance(out, ShardTensor) and _fused(out), (placements, out.grad_fn)
            assert _native(out) == _rows_alone(ctx.mesh, placements), (placements, out.grad_fn)
            assert out.placements == tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


@distributed(world_sizes=(1,), mesh_2d=False)
def test_rowwise_one_rank_same_bits_as_plain_torch(ctx):
    """At one rank the fused call is plain torch's op sequence: output and every gradient bit for bit."""
    torch.manual_seed(0)
    module = _mlp(dtype=torch.float32)
    reference = copy.deepcopy(module)
    assert not is_rowwise(module)
    rowwise(module)
    twin = copy.deepcopy(module)  # a copy is rowwise too, bound to the copy
    assert is_rowwise(module) and is_rowwise(twin) and twin.forward.__self__ is twin
    del twin.forward
    assert not is_rowwise(twin)
    x = torch.randn(33, 6)
    ref_x = x.clone().requires_grad_()
    expected = reference(ref_x)
    sharded = ShardTensor.from_local(x.clone(), ctx.mesh, [Shard(0)]).requires_grad_()
    out = module(sharded)
    assert _native(out) and torch.equal(out.to_local(), expected)
    g = torch.randn(33, 4)
    expected.backward(g)
    out.backward(ShardTensor.from_local(g.clone(), ctx.mesh, [Shard(0)]))
    assert torch.equal(sharded.grad.to_local(), ref_x.grad)
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    first_inplace = rowwise(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 4)))  # not through the entry node
    fresh = ShardTensor.from_local(x.clone(), ctx.mesh, [Shard(0)])  # the ReLU writes into it, as in plain torch
    assert type(first_inplace(fresh).grad_fn).__name__ == "_FusedBackward"
    with torch.no_grad():  # inference: no node at all, the same values
        assert torch.equal(module(sharded).to_local(), reference(x))
    assert torch.equal(module(x), reference(x))  # a plain input runs the module's own forward
    for reentrant in (False, True):  # activation checkpointing recomputes the fused call: the same bits
        module.zero_grad(set_to_none=True)
        leaf = ShardTensor.from_local(x.clone(), ctx.mesh, [Shard(0)]).requires_grad_()
        y = checkpoint(module, leaf, use_reentrant=reentrant)
        y.backward(ShardTensor.from_local(g.clone(), ctx.mesh, [Shard(0)]))
        assert torch.equal(y.to_local(), expected) and torch.equal(leaf.grad.to_local(), ref_x.grad)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(module.parameters(), reference.parameters()))


def test_rowwise_all_marks_the_outermost_fusable_sequentials():
    model = nn.ModuleDict({
        "mlp": _mlp(),  # marked; its nested Sequential is inside it
        "conv": nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),  # not row-local: left alone
        "head": nn.Linear(4, 1),  # a lone layer: left alone
        "deep": nn.ModuleList([nn.Sequential(nn.Tanh(), nn.Linear(4, 4))]),
    })  # fmt: skip
    assert physicsnemo_dp.rowwise_all(model) == ["mlp", "deep.0"]
    assert is_rowwise(model["mlp"]) and not is_rowwise(model["mlp"][2]) and not is_rowwise(model["conv"])
    assert physicsnemo_dp.rowwise_all(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == [""]


class _Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        return x


@distributed(world_sizes=(3,), mesh_2d=False)
def test_rowwise_refusals_and_general_path(ctx):
    """Not row-local: TypeError naming the submodule; a feature dim sharded: PlacementError on every rank;
    training dropout and hooks: the module's own forward (the library's rules), the same values."""
    for bad, words in (
        (nn.BatchNorm1d(6), "statistics"),
        (_Scaled(6, 6), "subclass"),
        (_Counter(), "buffers"),
        (nn.Softmax(dim=0), "not known"),
        (nn.Conv1d(6, 6, 1), "not known"),
    ):
        with pytest.raises(TypeError, match=words):
            rowwise(nn.Sequential(nn.Linear(6, 6), bad))
    with pytest.raises(TypeError, match="nn.Module"):
        rowwise(lambda x: x)
    x = torch.randn(5, 7, 6, dtype=torch.float64)
    module = rowwise(_mlp())
    for placements, dim in (((Shard(2),), 2), ((Shard(-1),), 2)):
        sharded = shard_from_global(x, make_spec(ctx.mesh, placements, tuple(x.shape)), requires_grad=True)
        with pytest.raises(PlacementError, match=f"sharded on dim {dim}"):
            module(sharded)
    norm2 = rowwise(nn.Sequential(nn.Linear(6, 6), nn.LayerNorm((7, 6))).double())  # normalizes dims 1 and 2
    with pytest.raises(PlacementError, match="2 trailing"):
        norm2(shard_from_global(x, make_spec(ctx.mesh, (Shard(1),), tuple(x.shape))))
    # general path: the values the library's per-op rules give, not the fused node
    module.train()  # Dropout(0.5) in training: the library's decomposition-invariant dropout
    sharded = shard_from_global(x, make_spec(ctx.mesh, (Shard(0),), tuple(x.shape)), requires_grad=True)
    out = module(sharded)
    assert not _fused(out) and out.grad_fn is not None
    module.eval()
    handle = module[1].register_forward_hook(lambda m, a, o: o * 2)  # a hook on a layer: it must run
    try:
        out = module(sharded)
        assert not _fused(out)
        reference = copy.deepcopy(module)
        assert torch.allclose(out.full_tensor(), reference(x))
    finally:
        handle.remove()
    assert _fused(module(sharded))
    with physicsnemo_dp.promotion_mode("disabled"), pytest.raises(physicsnemo_dp.PromotionError):
        module(sharded)  # promotion's own refusal, as without rowwise


@distributed(world_sizes=(1,), mesh_2d=False, timeout=120)
def test_rowwise_under_compile(ctx):
    """torch.compile traces the module's own forward (the per-op rules): the same output and gradients."""
    module = rowwise(_mlp())
    reference = copy.deepcopy(module)
    x = torch.randn(9, 6, dtype=torch.float64)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    sharded = ShardTensor.from_local(x.clone(), ctx.mesh, [Shard(0)]).requires_grad_()
    out = compiled(sharded)
    expected = reference(x)
    assert torch.allclose(out.to_local(), expected, rtol=1e-12, atol=1e-12)
    out.backward(ShardTensor.from_local(torch.ones(9, 4, dtype=torch.float64), ctx.mesh, [Shard(0)]))
    expected.backward(torch.ones(9, 4, dtype=torch.float64))
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12)


class _RowwiseNet(nn.Sequential):
    """A token-wise MLP, every layer fusable: the whole model is one ``rowwise`` node."""

    @dataclass(frozen=True)
    class ModelCapabilities:
        supports_domain: bool = True
        supports_ddp: bool = True

    def __init__(self):
        super().__init__(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN),
                         nn.Linear(HIDDEN, 2))  # fmt: skip


@distributed(world_sizes=(3,), mesh_2d=True, timeout=120)
def test_rowwise_trains_under_ddp_and_domain(ctx):
    """DDP over "ddp", tokens over "domain" (uneven, an empty shard at 2 domain ranks): two SGD steps of the
    fused model reach the single-process parameters (domain sums by promotion's buckets, then DDP's average)."""
    from torch.nn.parallel import DistributedDataParallel

    from physicsnemo_dp.distributed import DDPConfig, MeshContext, parallelize_model

    from ..distributed._models import assert_close_states, device_mesh, full_state, local_input, sample_batch, train

    batches = [sample_batch(seed=s) for s in range(2)]
    torch.manual_seed(0)
    reference = _RowwiseNet()
    train(reference, batches)
    # tokens over "domain"; at 4 ranks also all on "ddp" (the batch of 4 split evenly) and a one-rank "domain": the
    # layers recorded by torch's own autograd on the real parameters (nothing for promotion to sum), DDP's hooks
    for shape in ((2, 2), (4, 1)) if ctx.mesh.ndim == 2 else ((1, ctx.world_size),):
        context = MeshContext.from_mesh(device_mesh(ctx.device.type, *shape), strategy=DDPConfig())
        torch.manual_seed(0)
        try:
            model = parallelize_model(rowwise(_RowwiseNet().to(ctx.device)), context)
            assert isinstance(model, DistributedDataParallel) == (shape[0] > 1)  # DDP only over more than one rank
            train(model, [local_input(b, context, salt=0) for b in batches])
            inner = model.module if isinstance(model, DistributedDataParallel) else model
            out = inner(local_input(batches[0], context))
            assert _fused(out) and _native(out) == (shape[1] == 1), (shape, out.grad_fn)
        finally:
            clear_gradient_buckets()
        assert_close_states(full_state(model), full_state(reference), atol=1e-5, rtol=1e-5)
