"""Convolutions on spatially sharded inputs against the single-process result."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import OP_WORLD_SIZES, check
from ._cases import check_module, grid, spatial_layouts

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
SHAPES = {1: (2, 4, 13), 2: (2, 4, 11, 9), 3: (1, 4, 7, 6, 5)}

CONV_CASES = [
    dict(k=3, padding=1),
    dict(k=2, padding="same"),
    dict(k=4, padding="same", dilation=2),
    dict(k=3, padding="valid"),
    dict(k=3, stride=2, padding=1),
    dict(k=2, stride=2),
    dict(k=5, stride=3, padding=2, dilation=1),
    dict(k=3, stride=2, padding=2, dilation=2, groups=2),
    dict(k=1),
    dict(k=3, padding=1, groups=4, bias=False),
]


def _conv_case(n, case, transposed=False):
    case = dict(case)
    k, groups, bias = case.pop("k"), case.get("groups", 1), case.pop("bias", True)
    c_in, c_out = SHAPES[n][1], 6 if groups == 1 else 4
    shape = (c_in, c_out // groups, *(k,) * n) if transposed else (c_out, c_in // groups, *(k,) * n)
    return grid(shape, 1), grid((c_out,), 2) if bias else None, case


@pytest.mark.parametrize("n", [1, 2, 3])
@distributed(world_sizes=OP_WORLD_SIZES)
def test_conv(ctx, n):
    x = grid(SHAPES[n])
    for case in CONV_CASES:
        if n == 3 and case["k"] > 3:
            continue
        w, b, kw = _conv_case(n, case)
        for placements in spatial_layouts(ctx.mesh, n + 2, n, batch=n == 2):
            inputs = [(x, placements), (w, None)] + ([(b, None)] if b is not None else [])
            check(lambda x, w, b=None: CONV[n](x, w, b, **kw), inputs, ctx.mesh, label=f"conv{n}d {case}")


CONV_T_CASES = [
    dict(k=2, stride=2),
    dict(k=3, stride=2, padding=1, output_padding=1),
    dict(k=3, padding=1),
    dict(k=4, stride=2, padding=1),
    dict(k=1, stride=3),
    dict(k=3, stride=3, padding=2, output_padding=2, dilation=2),
    dict(k=3, stride=2, groups=2, bias=False),
]


@pytest.mark.parametrize("n", [1, 2, 3])
@distributed(world_sizes=OP_WORLD_SIZES)
def test_conv_transpose(ctx, n):
    x = grid(SHAPES[n])
    for case in CONV_T_CASES:
        w, b, kw = _conv_case(n, case, transposed=True)
        for placements in spatial_layouts(ctx.mesh, n + 2, n, batch=n == 2):
            inputs = [(x, placements), (w, None)] + ([(b, None)] if b is not None else [])
            check(lambda x, w, b=None: CONV_T[n](x, w, b, **kw), inputs, ctx.mesh, label=f"conv_transpose{n}d {case}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_nn_modules_with_every_padding_mode(ctx):
    x = grid(SHAPES[2])
    torch.manual_seed(0)
    modules = [
        torch.nn.Conv2d(4, 3, 3, padding=1, padding_mode=mode).double()
        for mode in ("zeros", "reflect", "replicate", "circular")
    ] + [
        torch.nn.Conv2d(4, 3, (3, 2), stride=(2, 1), padding=(1, 2), padding_mode="circular").double(),
        torch.nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1).double(),
    ]
    for module in modules:
        for placements in spatial_layouts(ctx.mesh, 4, 2):
            check_module(module, x, placements, ctx.mesh, label=repr(module))
    conv1, conv3 = torch.nn.Conv1d(4, 2, 3, padding=1, padding_mode="reflect").double(), torch.nn.Conv3d(4, 2, 3, padding=1, padding_mode="circular").double()
    for placements in spatial_layouts(ctx.mesh, 3, 1):
        check_module(conv1, grid(SHAPES[1]), placements, ctx.mesh, label="conv1d reflect")
    for placements in spatial_layouts(ctx.mesh, 5, 3):
        check_module(conv3, grid(SHAPES[3]), placements, ctx.mesh, label="conv3d circular")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_unbatched_and_channel_sharded_inputs(ctx):
    x = grid(SHAPES[2])
    w, b = grid((3, 4, 3, 3), 1), grid((3,), 2)
    for placements in spatial_layouts(ctx.mesh, 3, 2):
        check(lambda x, w, b: F.conv2d(x, w, b, padding=1), [(x[0], placements), (w, None), (b, None)], ctx.mesh, label="unbatched")
    channel = (Shard(1),) * ctx.mesh.ndim
    check(lambda x, w, b: F.conv2d(x, w, b, padding=1), [(x, channel), (w, None), (b, None)], ctx.mesh, label="channel-sharded")


def _expected_halo_rows(spec, d, halo):
    """Rows a same-padded stride-1 conv must receive along ``d`` (window minus own rows, inside the grid)."""
    a, n, N = spec.local_offsets()[d], spec.local_shape[d], spec.global_shape[d]
    if n == 0:
        return 0
    return min(a + n + halo, N) - max(a - halo, 0) - n


@distributed(world_sizes=OP_WORLD_SIZES)
def test_each_conv_does_one_halo_exchange_per_sharded_dim(ctx):
    shape = (2, 4, 11, 9)
    x_global, w, b = grid(shape), grid((3, 4, 5, 5), 1), grid((3,), 2)
    layouts = [(Shard(2),), (Shard(3),)] if ctx.mesh.ndim == 1 else [(Shard(2), Shard(3)), (Shard(0), Shard(3))]
    for placements in layouts:
        spec = make_spec(ctx.mesh, placements, shape)
        x = shard_from_global(x_global, spec, requires_grad=True)
        with count_collectives() as fwd:
            y = F.conv2d(x, w, b, padding=2)
        with count_collectives() as bwd:
            y.backward(torch.ones_like(y))
        sharded = [p.dim for m, p in enumerate(placements) if p.dim > 1 and ctx.mesh.size(m) > 1]
        assert fwd.calls["halo"] == len(sharded) and fwd.total_calls == len(sharded), fwd.summary()
        assert bwd.calls["halo"] == len(sharded), bwd.summary()
        # interior halo rows only: the zero padding at the global boundary is never sent
        local = list(spec.local_shape)
        expected = 0
        for d in sorted(sharded):
            row = torch.Size(local[:d] + local[d + 1 :]).numel()
            rows = _expected_halo_rows(spec, d, 2)
            expected += rows * row * 8
            local[d] += rows  # later dims' messages carry these (corners), never padding
        assert fwd.bytes_received["halo"] == expected, (fwd.summary(), expected)
        assert bwd.bytes_sent["halo"] == fwd.bytes_received["halo"] and bwd.bytes_received["halo"] == fwd.bytes_sent["halo"]
        # the only other traffic in backward: the weight and bias gradients' all-reduce
        assert set(bwd.calls) <= {"halo", "all_reduce"}, bwd.summary()
        assert y._spec.dim_sizes == spec.dim_sizes  # stride 1, same padding: layout unchanged


@distributed(world_sizes=OP_WORLD_SIZES)
def test_transposed_and_3d_convs_exchange_once_per_sharded_dim(ctx):
    cases = [
        ((2, 4, 12, 10), lambda x: F.conv_transpose2d(x, grid((4, 3, 3, 3), 1), stride=2, padding=1, output_padding=1), 2),
        ((1, 4, 8, 6, 6), lambda x: F.conv3d(x, grid((2, 4, 3, 3, 3), 1), padding=1), 3),
    ]
    for shape, fn, n in cases:
        spatial = list(range(len(shape) - n, len(shape)))
        placements = (Shard(spatial[0]),) if ctx.mesh.ndim == 1 else (Shard(spatial[0]), Shard(spatial[-1]))
        x = shard_from_global(grid(shape), make_spec(ctx.mesh, placements, shape, kind="chunk"), requires_grad=True)
        with count_collectives() as fwd:
            y = fn(x)
        with count_collectives() as bwd:
            y.backward(torch.ones_like(y))
        sharded = sum(1 for m in range(ctx.mesh.ndim) if ctx.mesh.size(m) > 1)
        assert fwd.calls["halo"] == fwd.total_calls == sharded, fwd.summary()
        assert bwd.calls["halo"] == sharded, bwd.summary()
        assert bwd.bytes_sent["halo"] == fwd.bytes_received["halo"] and bwd.bytes_received["halo"] == fwd.bytes_sent["halo"]


@distributed(world_sizes=(2,), mesh_2d=False)
def test_bad_arguments_raise_torch_errors_on_every_rank(ctx):
    x = shard_from_global(grid(SHAPES[2]), make_spec(ctx.mesh, (Shard(2),), SHAPES[2]))
    with pytest.raises(RuntimeError, match="channel"):
        F.conv2d(x, grid((3, 5, 3, 3)))
    with pytest.raises(RuntimeError, match="Kernel size can't be greater"):
        F.conv2d(x, grid((3, 4, 30, 3)))


@distributed(world_sizes=(3,), mesh_2d=False)
def test_same_conv_along_one_sharded_dim_corrects_the_seams(ctx):
    """A stride-1 "same" conv sharded along one dim runs as torch's conv of the local rows plus seam
    corrections (no window copy); a shard thinner than the padding takes the window op. Either way
    the result, input and parameter gradients are the single-device ones, with the same traffic."""
    from physicsnemo_dp import ShardTensorSpec

    x, w, b = grid((2, 4, 11, 9)), grid((6, 4, 5, 5), 1), grid((6,), 2)  # P = 2 along both dims
    spec = ShardTensorSpec.from_sizes(ctx.mesh, (Shard(2),), tuple(x.shape), x.dtype, (None, None, (6, 1, 4), None))
    xs = shard_from_global(x, spec, requires_grad=True)
    ws, bs = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    with count_collectives() as fwd:
        out = F.conv2d(xs, ws, bs, padding=2)
    path = {0: "SeamConvFunction", 1: "WindowFunction", 2: "SeamConvFunction"}[ctx.rank]
    assert type(out.grad_fn).__name__.startswith(path), type(out.grad_fn).__name__
    gout = grid(tuple(out.shape), 3)
    with count_collectives() as bwd:
        out.backward(shard_from_global(gout, out._spec))
    assert fwd.calls == {"halo": 1}
    # The mirror exchange; the weight and bias gradients summed in one reduction (a ring all-reduce of both).
    assert bwd.calls == {"halo": 1, "all_reduce": 1}
    P, nbytes = ctx.world_size, (w.numel() + b.numel()) * w.element_size()
    assert bwd.bytes_sent["all_reduce"] == 2 * (P - 1) * nbytes // P
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    ref = F.conv2d(xr, wr, br, padding=2)
    ref.backward(gout)
    assert torch.allclose(out.full_tensor(), ref, atol=1e-12)
    assert torch.allclose(xs.grad.full_tensor(), xr.grad, atol=1e-12)
    assert torch.allclose(ws.grad, wr.grad, atol=1e-12) and torch.allclose(bs.grad, br.grad, atol=1e-12)
