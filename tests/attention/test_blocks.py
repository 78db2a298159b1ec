"""Single-process checks of the tile math, the zig-zag order and causal work balance."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_dp.attention import zigzag_order, zigzag_sizes
from physicsnemo_dp.attention import _blocks
from physicsnemo_dp.attention._blocks import (
    Span,
    attend,
    attend_backward,
    attend_backward_whole,
    attend_whole,
    one_call,
    plan_tiles,
)
from physicsnemo_dp.attention import _heads
from physicsnemo_dp.attention.zigzag import spans
from physicsnemo_dp.split import chunk_sizes, offsets_from_sizes


@pytest.mark.parametrize("causal,zigzag", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (3, 1)])
def test_blocks_merge_to_full_attention(causal, zigzag, hq, hk):
    """Keys cut into uneven blocks (one empty), merged by log-sum-exp = SDPA, forward and backward."""
    g = torch.Generator().manual_seed(0)
    L, S, E, Ev = 9, 11, 5, 3
    q = torch.randn(2, hq, L, E, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hk, S, E, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hk, S, Ev, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None if causal else torch.rand(hq, L, S, generator=g) > 0.3
    # in zig-zag order, global index i sits at causal position zigzag_order(n, 2)[i]
    causal_mask = zigzag_order(S, 2)[None, :] <= zigzag_order(L, 2)[:, None] if zigzag else None
    ref_mask = causal_mask if zigzag else mask
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, is_causal=causal and not zigzag, enable_gqa=True)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(w)

    groups = _heads.query_groups(hq, hk)
    q5, k5, v5 = (
        _heads.group_queries(q.detach(), groups, q.dtype),
        _heads.group_keys(k.detach()),
        _heads.group_keys(v.detach()),
    )
    m5 = _heads.group_mask(mask, 4, groups)
    cuts = [0, 4, 4, 7, S]  # an empty block on purpose
    q_spans = spans(0, L, L, 2, zigzag) if causal else (Span(0, L, 0),)
    blocks = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        k_spans = spans(a, b - a, S, 2, zigzag) if causal else (Span(0, b - a, 0),)
        blocks.append((a, b, plan_tiles(q_spans, k_spans, causal)))
    out = torch.zeros(2, hq // groups, groups, L, Ev, dtype=q.dtype)
    lse = torch.full(out.shape[:-1], float("-inf"), dtype=q.dtype)
    for a, b, tiles in reversed(blocks):  # any order
        attend(q5, k5[..., a:b, :], v5[..., a:b, :], m5, 0, a, tiles, E**-0.5, out, lse)
    assert torch.allclose(_heads.ungroup_queries(out, 4, q.dtype), ref, atol=1e-12)

    dout = _heads.group_queries(w, groups, q.dtype)
    delta = (dout * out).sum(-1)
    dq, dks, dvs = torch.zeros_like(q5), [], []
    for a, b, tiles in blocks:
        dk, dv = attend_backward(q5, k5[..., a:b, :], v5[..., a:b, :], m5, 0, a, tiles, E**-0.5, dout, lse, delta, dq)
        dks.append(dk)
        dvs.append(dv)
    assert torch.allclose(_heads.ungroup_queries(dq, 4, q.dtype), q.grad, atol=1e-12)
    assert torch.allclose(_heads.ungroup_keys(torch.cat(dks, -2), 4, q.dtype), k.grad, atol=1e-12)
    assert torch.allclose(_heads.ungroup_keys(torch.cat(dvs, -2), 4, q.dtype), v.grad, atol=1e-12)


@pytest.mark.parametrize("n,parts", [(0, 3), (5, 4), (16, 4), (17, 3), (9, 1)])
def test_zigzag_order_and_spans(n, parts):
    order = zigzag_order(n, parts)
    assert sorted(order.tolist()) == list(range(n))
    sizes = zigzag_sizes(n, parts)
    assert sum(sizes) == n
    chunks = chunk_sizes(n, 2 * parts)
    for r, (off, size) in enumerate(zip(offsets_from_sizes(sizes), sizes)):
        positions = [s.position + i for s in spans(off, size, n, parts, True) for i in range(s.length)]
        assert positions == order[off : off + size].tolist()
        assert size == chunks[r] + chunks[2 * parts - 1 - r]
    # any global range, not only whole shards
    positions = [s.position + i for s in spans(1, n - 2, n, parts, True) for i in range(s.length)] if n > 2 else []
    assert positions == order[1 : n - 1].tolist()


def _causal_work(n: int, parts: int, zigzag: bool) -> list[int]:
    """Score elements each rank computes in a causal ring (tiles that lie in the future are skipped)."""
    sizes = zigzag_sizes(n, parts) if zigzag else chunk_sizes(n, parts)
    ranges = list(zip(offsets_from_sizes(sizes), sizes))
    work = []
    for off, size in ranges:
        q_spans = spans(off, size, n, parts, zigzag)
        total = 0
        for k_off, k_size in ranges:
            for t in plan_tiles(q_spans, spans(k_off, k_size, n, parts, zigzag), True):
                total += t.q_len * t.k_len
        work.append(total)
    return work


def test_zigzag_balances_causal_work():
    n, parts = 4096, 4
    contiguous, zigzag = _causal_work(n, parts, False), _causal_work(n, parts, True)
    assert max(contiguous) == parts * min(contiguous)  # rank r computes r + 1 blocks
    assert max(zigzag) / min(zigzag) < 1.01
    assert sum(zigzag) < 0.7 * n * n  # future tiles are skipped, not just balanced


@pytest.mark.parametrize(
    "hq,hk,L,S,causal,dtype",
    [(4, 4, 12, 12, False, torch.float32), (4, 2, 12, 12, True, torch.float32), (3, 1, 9, 7, False, torch.float64),
     (2, 2, 8, 8, False, torch.bfloat16)],
)  # fmt: skip
def test_one_kernel_call_gives_the_bits_of_the_merged_tile(hq, hk, L, S, causal, dtype):
    """A block that is one fused-kernel call returns the tile itself: the bits (and memory layouts) of the merge path."""
    g = torch.Generator().manual_seed(3)
    E = 8
    # queries transposed in memory, as a projection split into heads gives them
    q = torch.randn(2, L, hq, E, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(2, hk, S, E, generator=g).to(dtype) for _ in range(2))
    groups = _heads.query_groups(hq, hk)
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    q5, k5, v5 = _heads.group_queries(q, groups, compute), _heads.group_keys(k), _heads.group_keys(v)
    tiles = plan_tiles((Span(0, L, 0),), (Span(0, S, 0),), causal)
    call = one_call(q5, k5, v5, None, tiles)
    assert call is not None
    out, lse = torch.zeros(*call[0], L, E, dtype=compute), torch.full((*call[0], L), float("-inf"), dtype=compute)
    attend(q5, k5, v5, None, 0, 0, tiles, 0.3, out, lse)
    fast_out, fast_lse = attend_whole(q5, k5, v5, *call, 0.3)
    dout = torch.randn(out.shape, generator=g).to(compute)
    dq = torch.zeros_like(q5)
    dk, dv = attend_backward(q5, k5, v5, None, 0, 0, tiles, 0.3, dout, lse, None, dq, out)
    fast = attend_backward_whole(q5, k5, v5, *call, 0.3, dout, out, lse)
    for a, b in zip((out, lse, dq, dk, dv), (fast_out, fast_lse, *fast)):
        assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype
    # more than one kernel call (a mask, a causal tile that is not square, several tiles): the general path
    mask = torch.ones(L, S, dtype=torch.bool)
    assert one_call(q5, k5, v5, mask, tiles) is None
    assert one_call(q5, k5, v5, None, plan_tiles((Span(0, L, 4),), (Span(0, S, 0),), True)) is None
    assert one_call(q5, k5, v5, None, plan_tiles((Span(0, 4, 0), Span(4, L - 4, 4)), (Span(0, S, 0),), False)) is None


@pytest.mark.parametrize("causal,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float64)])
def test_kernel_on_the_callers_heads_gives_the_bits_of_the_grouped_call(causal, dtype):
    """``WholeAttention`` (one rank's keys whole, one query head per key head) calls the kernel on the (B, H, L, E)
    tensors as given; the grouped one-call path folds the heads into the kernel's batch. Same bits, both ways."""
    from physicsnemo_dp._torch_compat import fused_attention, fused_attention_backward

    g = torch.Generator().manual_seed(5)
    B, H, L, E = 2, 3, 11, 8
    q, k, v = (torch.randn(B, L, H, E, generator=g).to(dtype).transpose(1, 2) for _ in range(3))
    q5, k5, v5 = _heads.group_queries(q, 1, dtype), _heads.group_keys(k), _heads.group_keys(v)
    call = one_call(q5, k5, v5, None, plan_tiles((Span(0, L, 0),), (Span(0, L, 0),), causal))
    assert call is not None and call[1] == causal
    out5, lse5 = attend_whole(q5, k5, v5, *call, 0.3)
    out, lse = fused_attention(q, k, v, causal, 0.3)
    assert torch.equal(out, _heads.ungroup_queries(out5, 4, dtype)) and torch.equal(lse, _heads.ungroup_rows(lse5, 4))
    dout = torch.randn(out.shape, generator=g).to(dtype)
    grads5 = attend_backward_whole(q5, k5, v5, *call, 0.3, _heads.group_queries(dout, 1, dtype), out5, lse5)
    grads = fused_attention_backward(dout, q, k, v, out, lse, causal, 0.3)
    ungroup = (_heads.ungroup_queries, _heads.ungroup_keys, _heads.ungroup_keys)
    for a, b, back in zip(grads, grads5, ungroup):
        assert torch.equal(a, back(b, 4, dtype))


class _OpLog(TorchDispatchMode):
    """The names of the ATen ops called under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernel_calls_fit_the_memory_efficient_kernel(causal):
    """On CUDA tensors the fused kernel is torch's memory-efficient one, forward and backward.

    Checked on fake CUDA tensors (this machine has no GPU): the calls must fit
    the kernel's schema and shapes and return what the CPU kernel returns: the
    log-sum-exp cut to the query count, the backward given it back uncut. The
    values are the GPU command's to check (``benchmarks.gpu_check`` runs
    tests/attention on CUDA against one process).
    """
    from physicsnemo_dp._torch_compat import fused_attention, fused_attention_backward

    N, H, L, S, E = 2, 3, 40, 24, 8
    with FakeTensorMode():
        q, k, v = (torch.empty(N, H, n, E, device="cuda") for n in (L, S, S))
        with _OpLog() as log:
            out, lse = fused_attention(q, k, v, causal, E**-0.5)
            dq, dk, dv = fused_attention_backward(out, q, k, v, out, lse, causal, E**-0.5)
        assert (out.shape, lse.shape, lse.dtype) == ((N, H, L, E), (N, H, L), torch.float32)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert "_scaled_dot_product_efficient_attention" in log.names
    assert "_scaled_dot_product_efficient_attention_backward" in log.names
    assert not any(name.endswith(("_for_cpu", "_for_cpu_backward")) for name in log.names)


def test_tiles_take_the_math_path_where_no_fused_kernel_fits(monkeypatch):
    """On CUDA the kernel runs where torch's selector accepts and the dtype is one it takes (not float64);
    CPU and meta always take the CPU kernel; a user mask takes the math path everywhere."""
    verdict = {"fits": True}
    asked = []

    def selector(params):
        asked.append((params.query.shape, params.query.dtype))
        return verdict["fits"]

    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", selector)
    with FakeTensorMode():
        q5 = torch.empty(1, 2, 1, 6, 4, device="cuda")
        assert _blocks._fused(q5, q5, q5, None)
        assert asked == [((1, 1, 6, 4), torch.float32)]  # asked about the kernel's (N, 1, n, E) tensors
        verdict["fits"] = False
        assert not _blocks._fused(q5, q5, q5, None)
        verdict["fits"] = True
        assert not _blocks._fused(q5.double(), q5.double(), q5.double(), None)  # float64: not the kernel's dtype
        assert len(asked) == 2  # ... decided without asking the selector
    q5 = torch.empty(1, 2, 1, 6, 4, dtype=torch.float64)
    assert _blocks._fused(q5, q5, q5, None) and _blocks._fused(q5.to("meta"), q5.to("meta"), q5.to("meta"), None)
    assert not _blocks._fused(q5, q5, q5, torch.ones(6, 6, dtype=torch.bool))  # a user mask: the math path
