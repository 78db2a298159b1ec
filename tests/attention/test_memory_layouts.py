"""Sequence-sharded attention on local tensors in any memory layout, against single-process SDPA.

Attention blocks in the wild feed SDPA views of one projection
(``qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)`` then select, or
``transpose(1, 2)``), so the local tensors are strided views. The fused CPU
kernel that runs the tiles reads each row of the last dim as consecutive
memory: a local whose last dim is strided (transposed, expanded) gave garbage
until every tensor handed to the kernel was made to match. These tests cover
every layout (local, replicated queries with sharded keys, ring), causal,
GQA and zig-zag, forward and gradients, uneven shards with an empty one.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp._conversion import FromLocal
from physicsnemo_dp.attention import from_zigzag, to_zigzag, zigzag_causal
from physicsnemo_dp.attention._blocks import Span, attend, attend_backward, plan_tiles
from tests._harness import distributed

from ..ops._diff import check

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
B, L, D = 2, 7, 3


def _seq(mesh, p):
    """Placements with ``p`` on the last mesh dim (the batch dim split over "ddp" on a 2-D mesh)."""
    return (p,) if mesh.ndim == 1 else (Shard(0), p)


def _sdpa(q, k, v, option):
    """SDPA with ``option``; zig-zag runs causal attention in zig-zag order (natural order in and out)."""
    gqa = q.shape[1] != k.shape[1]
    if option != "zigzag" or not isinstance(q, ShardTensor):
        return F.scaled_dot_product_attention(q, k, v, is_causal=option != "plain", enable_gqa=gqa)
    m = q.device_mesh.ndim - 1
    q, k, v = (to_zigzag(t, dim=2, mesh_dim=m) for t in (q, k, v))
    with zigzag_causal():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return from_zigzag(out, dim=2, mesh_dim=m)


def _projection_heads(x, split, hq, hk):
    """q, k, v as the usual views of one projection ``x`` of shape (B, L, (hq + 2 hk) D)."""
    if split == "select":  # timm / ViT: view, permute, select
        t = x.view(B, L, 3, hq, D).permute(2, 0, 3, 1, 4)
        return t[0], t[1], t[2]
    q, k, v = x.split([hq * D, hk * D, hk * D], dim=-1)  # GPT style: split, view, transpose(1, 2)
    return q.reshape(B, L, hq, D).transpose(1, 2), k.reshape(B, L, hk, D).transpose(1, 2), v.reshape(B, L, hk, D).transpose(1, 2)


def _on_layout(q, k, v, layout):
    """Bring the sequence of q or of k/v to Replicate for the local and kv_sharded layouts."""
    if not isinstance(q, ShardTensor) or layout == "ring":
        return q, k, v
    whole = [*q.placements[:-1], Replicate()]
    if layout == "local":
        return q, k.redistribute(placements=whole), v.redistribute(placements=whole)
    return q.redistribute(placements=whole), k, v


@DTYPES
@distributed(timeout=300)
def test_views_of_one_projection(ctx, dtype):
    """Every layout and option on the views attention blocks make of one qkv projection."""
    mesh = ctx.mesh
    for split, hq, hk in (("select", 2, 2), ("transpose", 2, 2), ("transpose", 4, 2)):
        x = torch.randn(B, L, (hq + 2 * hk) * D, dtype=dtype, generator=torch.Generator().manual_seed(hq + hk))
        for layout in ("ring", "local", "kv_sharded"):
            for option in ("plain", "causal", "zigzag"):
                if option == "zigzag" and layout == "local":
                    continue  # to_zigzag shards the sequence of all three: that is the ring
                def fn(x, split=split, hq=hq, hk=hk, layout=layout, option=option):
                    q, k, v = _on_layout(*_projection_heads(x, split, hq, hk), layout)
                    return _sdpa(q, k, v, option)
                check(fn, [(x, _seq(mesh, Shard(1)))], mesh, label=f"{split} hq={hq} hk={hk} {layout} {option}")


def _stored(t, storage):
    """``t`` (a ShardTensor) with the same values and spec, its local tensor kept in another memory layout."""
    local = t.to_local()
    if storage == "transposed":  # last two dims swapped in memory, viewed back: the last dim is strided
        new = local.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:  # "offset": the interior of a larger buffer (storage offset, padded strides)
        new = local.new_zeros([n + 2 for n in local.shape])[tuple(slice(1, 1 + n) for n in local.shape)]
        new = new.copy_(local)
    return FromLocal.apply(new, t._spec)


def _strided(storage, option, kernel=False):
    """SDPA on q, k, v whose local tensors are stored as ``storage``; the plain reference gets the same values."""
    def fn(q, k, v):
        if storage == "expanded":  # values constant along the last dim: a stride-0 last dim after expand
            v = v[..., :1].expand(v.shape)
        elif isinstance(q, ShardTensor):
            q, k, v = (_stored(t, storage) for t in (q, k, v))
        if kernel:  # the fused kernel op, as library composites reach it below autograd
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, option == "causal")[0]
        out = _sdpa(q, k, v, option)
        return out.transpose(-1, -2) if storage == "transposed" else out  # a gradient strided in its last dim
    return fn


def _qkv(dtype, hk=2):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in ((B, 2, L, D), (B, hk, 6, D), (B, hk, 6, D))]


@DTYPES
@distributed(timeout=300)
def test_strided_local_storage(ctx, dtype):
    """Transposed, expanded (stride 0) and offset local tensors in every layout, and via the fused kernel op."""
    mesh = ctx.mesh
    S, R = Shard(2), Replicate()
    layouts = {"ring": (S, S, S), "local": (S, R, R), "kv_sharded": (R, S, S)}
    for name, layout in layouts.items():
        for storage in ("transposed", "expanded", "offset"):
            for option in ("plain", "causal"):
                inputs = [(t, _seq(mesh, p)) for t, p in zip(_qkv(dtype), layout)]
                check(_strided(storage, option), inputs, mesh, label=f"{name} {storage} {option}")
        inputs = [(t, _seq(mesh, p)) for t, p in zip(_qkv(dtype), layout)]
        check(_strided("transposed", "causal", kernel=True), inputs, mesh, label=f"{name} fused op")
    inputs = [(t, _seq(mesh, S)) for t in _qkv(dtype, hk=1)]
    check(_strided("transposed", "causal"), inputs, mesh, label="ring gqa transposed")


def _last_dim_strided(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_tiles_read_every_memory_layout(causal):
    """The tile functions themselves (one process): strided q/k/v, output and its gradient give the contiguous result."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 1, n, 4, generator=g, dtype=torch.float64) for n in (6, 5, 5))
    dout = torch.randn(2, 2, 1, 6, 4, generator=g, dtype=torch.float64)
    tiles = plan_tiles((Span(0, 6, 2),), (Span(0, 5, 0),), causal)

    def run(q, k, v, dout, strided):
        out = torch.zeros(2, 2, 1, 6, 4, dtype=q.dtype)
        lse = torch.full(out.shape[:-1], float("-inf"), dtype=q.dtype)
        attend(q, k, v, None, 0, 0, tiles, 0.5, out, lse)
        if strided:
            out = _last_dim_strided(out)
        dq = torch.zeros_like(q)
        dk, dv = attend_backward(q, k, v, None, 0, 0, tiles, 0.5, dout, lse, (dout * out).sum(-1), dq, out)
        return out, dq, dk, dv

    expected = run(q, k, v, dout, False)
    actual = run(*(_last_dim_strided(t) for t in (q, k, v, dout)), True)
    for a, e in zip(actual, expected):
        assert torch.allclose(a, e, atol=1e-12)
