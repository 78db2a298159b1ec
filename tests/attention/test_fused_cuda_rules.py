"""The rules for the CUDA fused attention kernels, run on CPU ShardTensors.

``ShardTensor.__torch_dispatch__`` takes the op before any backend kernel, and
autograd's formula for each op (registered for every device) calls the op's
``_backward``, so calling e.g. ``aten._scaled_dot_product_efficient_attention``
on CPU ShardTensors exercises both rules. Outputs and gradients are compared
with ``F.scaled_dot_product_attention`` on the full tensors; the log-sum-exp
with one computed from the scores, in the kernel's format; the other outputs
with the kernel's meta function on the global shapes.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_dp import ShardTensor
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import check
from .test_sdpa import _g, _qkv

aten = torch.ops.aten
R, S2 = Replicate(), Shard(2)


def _flash(q, k, v, mask=None, causal=False, dropout_p=0.0, return_debug_mask=False):
    # as aten::scaled_dot_product_attention calls it on CUDA: head dims padded to a multiple of 8, output cut back
    ev, scale = v.shape[-1], 1 / math.sqrt(q.shape[-1])
    q, k, v = (F.pad(t, (0, -t.shape[-1] % 8)) for t in (q, k, v))
    out, *rest = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, causal, return_debug_mask, scale=scale)
    return out[..., :ev], *rest


def _efficient(q, k, v, mask=None, causal=False, dropout_p=0.0):
    if mask is not None:  # as aten::scaled_dot_product_attention hands it over on CUDA: padded to 8 columns, expanded
        n = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n].expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, dropout_p, causal)


def _cudnn(q, k, v, mask=None, causal=False, dropout_p=0.0):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, dropout_p, causal)


def _overrideable(q, k, v, mask=None, causal=False, dropout_p=0.0):
    return aten._scaled_dot_product_fused_attention_overrideable(q, k, v, mask, dropout_p, causal)


def _padded(lse):
    return F.pad(lse, (0, -(-lse.shape[-1] // 32) * 32 - lse.shape[-1]), value=math.inf)


#: name -> (call, the log-sum-exp rows (*B, H, L) as the kernel stores them, takes a mask, backward op)
OPS = {
    "flash": (_flash, lambda lse: lse, False, aten._scaled_dot_product_flash_attention_backward),
    "efficient": (_efficient, _padded, True, aten._scaled_dot_product_efficient_attention_backward),
    "cudnn": (_cudnn, lambda lse: lse.unsqueeze(-1), True, aten._scaled_dot_product_cudnn_attention_backward),
    "overrideable": (_overrideable, lambda lse: lse, True,
                     aten._scaled_dot_product_fused_attention_overrideable_backward),
}  # fmt: skip


def _reference_lse(q, k, mask, causal):
    """Log-sum-exp of the scores per query row, from the full tensors."""
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return torch.logsumexp(s if mask is None else s + mask, -1)


def _kernel_or_reference(name, mask, causal):
    """On ShardTensors the kernel's (output, log-sum-exp); on plain tensors SDPA's output and the reference lse."""
    call, store, _, _ = OPS[name]

    def fn(q, k, v):
        if isinstance(q, ShardTensor):
            return call(q, k, v, mask, causal)[:2]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return out, store(_reference_lse(q, k, mask, causal)).detach()

    return fn


class _Ops(TorchDispatchMode):
    """Records the ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(OPS))
@distributed(mesh_2d=False, timeout=300)
def test_fused_kernel_rules(ctx, name):
    mesh = ctx.mesh
    _, _, takes_mask, backward_op = OPS[name]
    bias = _g((2, 1, 7, 6), 6)
    cases = [("plain", _qkv(), None, False), ("causal", _qkv(), None, True)]
    cases.append(("gqa causal", _qkv(Hq=4, Hk=2), None, True))
    if takes_mask:
        cases.append(("additive mask", _qkv(), bias, False))
    # ring (all sharded), local (sharded queries), kv_sharded (sharded keys and values)
    for layout in ((S2, S2, S2), (S2, R, R), (R, S2, S2)):
        for label, tensors, mask, causal in cases:
            with _Ops() as seen:
                check(_kernel_or_reference(name, mask, causal), [(t, (p,)) for t, p in zip(tensors, layout)], mesh,
                      label=f"{name} {label}")  # fmt: skip
            assert backward_op.default in seen.seen, f"{name} {label}: autograd did not call {backward_op}"


def _sharded(tensors, mesh):
    """Sequence-sharded (dim -2) ShardTensors, uneven."""
    out = []
    for i, t in enumerate(tensors):
        spec = make_spec(mesh, (Shard(t.ndim - 2),), tuple(t.shape), dtype=t.dtype, salt=i)
        out.append(shard_from_global(t, spec, requires_grad=True))
    return out


def _assert_like_meta(name, outs, tensors, device):
    """Every output as the kernel's meta function says: None, the same int, or a tensor of its shape and dtype."""
    meta = OPS[name][0](*(t.detach().to("meta") for t in tensors))
    assert len(outs) == len(meta), name
    for i, (o, m) in enumerate(zip(outs, meta)):
        where = f"{name} output {i}"
        if m is None or isinstance(m, int):
            assert o is m if m is None else o == m, f"{where}: {o} != {m}"
            continue
        assert isinstance(o, ShardTensor) == (i < 2), f"{where}: {type(o).__name__}"  # output and log-sum-exp
        assert tuple(o.shape) == tuple(m.shape) and o.dtype == m.dtype, f"{where}: {o.shape} {o.dtype} != meta {m}"
        assert o.device == device, where


@distributed(world_sizes=(3,), mesh_2d=False, timeout=120)
def test_fused_kernel_outputs_and_errors(ctx):
    mesh = ctx.mesh
    q, k, v = (t.float() for t in _qkv(Ev=3))  # the kernels' dtype: float32 log-sum-exp, as the meta functions say
    for name in sorted(OPS):
        _assert_like_meta(name, OPS[name][0](*_sharded((q, k, v), mesh)), (q, k, v), q.device)
    three_d = [t[0] for t in (q, k, v)]  # (H, L, E): the overrideable kernel's log-sum-exp is (1, H, L)
    _assert_like_meta("overrideable", _overrideable(*_sharded(three_d, mesh)), three_d, q.device)

    for name in sorted(OPS):
        with pytest.raises(ValueError, match="needs dropout_p=0"):
            OPS[name][0](*_sharded((q, k, v), mesh), dropout_p=0.1)
    with pytest.raises(ValueError, match="debug attention mask"):
        _flash(*_sharded((q, k, v), mesh), return_debug_mask=True)

    # the efficient kernel without compute_log_sumexp: an empty log-sum-exp, and a backward that says why it fails
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(*_sharded((q, k, v), mesh), None, False)
    assert tuple(lse.shape) == (2, 2, 0)
    with pytest.raises(ValueError, match="compute_log_sumexp=False"):
        out.sum().backward()
