"""Every dtype through every collective, bit-exact, on uneven shards (gloo has no kernels for some).

gloo refuses complex in all_to_all and int16, uint16/32/64 and float8 in every
collective; the collective wrappers in ``physicsnemo_dp._torch_compat`` send
them as same-size views (data movement) or widened (reductions). Layouts are
the deliberately uneven ones of ``tests/core/_util.py`` (an empty shard on 3
ranks). Data for moves is random *bits* (NaN payloads, negative zeros,
subnormals), so any conversion on the way would show. One job per test loops
over the dtypes: jobs, not dtypes, cost time here.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp import collectives as C
from tests._harness import distributed

from ._util import box, make_spec, shard_from_global

SHAPE = (7, 5)

#: Dtypes with torch arithmetic: every transition, reductions included.
ARITHMETIC = [
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
]
#: Dtypes torch stores and moves but cannot add on CPU: moves, and reductions
#: checked against a reference computed in int64/float32.
STORAGE_ONLY = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
ALL = ARITHMETIC + STORAGE_ONLY


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaNs compare, and -0.0 differs from 0.0)."""
    t = t.resolve_conj().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype, where
    assert got.shape == want.shape, where
    assert torch.equal(_bits(got), _bits(want)), f"{where}: {got} != {want}"


def random_bits(shape, dtype, seed: int) -> torch.Tensor:
    """Any bit pattern of ``dtype`` (valid 0/1 for bool): the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel())
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


# ----------------------------------------------------------------- moves
@distributed(world_sizes=(2, 3), mesh_2d=True)
def test_moves_are_bit_exact_for_every_dtype(ctx):
    """full_tensor (all-gather of uneven shards), Shard(0)->Shard(1) (all-to-all), broadcast, send/recv."""
    mesh = ctx.mesh
    for i, dtype in enumerate(ALL):
        G = random_bits(SHAPE, dtype, seed=i)
        src = (Shard(0),) * mesh.ndim if mesh.ndim == 1 else (Shard(0), Shard(1))
        dst = (Shard(1),) * mesh.ndim if mesh.ndim == 1 else (Shard(1), Shard(0))
        x = shard_from_global(G, make_spec(mesh, src, SHAPE, dtype=dtype))
        assert_bit_equal(x.full_tensor(), G, f"{dtype} full_tensor")
        y = x.redistribute(placements=dst)
        assert_bit_equal(y.to_local(), G[box(y._spec)].contiguous(), f"{dtype} {src} -> {dst}")
        assert_bit_equal(y.full_tensor(), G, f"{dtype} {dst} full_tensor")

        # 0-dim and non-contiguous tensors straight through the collectives.
        m = mesh.ndim - 1
        me, n = mesh.get_local_rank(m), mesh.size(m)
        scalar = random_bits((), dtype, seed=100 + i)
        mine = scalar if me == n - 1 else random_bits((), dtype, seed=200 + i + me)
        assert_bit_equal(C.broadcast(mine, n - 1, mesh, m), scalar, f"{dtype} 0-dim broadcast")
        T = random_bits((3, 4 * n), dtype, seed=300 + i)
        cols = T.t()[me * 4 : me * 4 + 4].t()  # (3, 4) view with strides (4n, 1) of the transpose's transpose
        assert_bit_equal(C.all_gather_v(cols, [4] * n, 1, mesh, m), T, f"{dtype} strided all_gather")

        # Point to point around the ring of the last mesh dim.
        if n > 1:
            nxt, prv = (me + 1) % n, (me - 1) % n
            mine = random_bits((2, 3), dtype, seed=400 + i + me)
            arriving = random_bits((2, 3), dtype, seed=400 + i + prv)
            got = C.send_recv([mine], nxt, [((2, 3), dtype)], prv, mesh, m).wait()[0]
            assert_bit_equal(got, arriving, f"{dtype} send_recv")


# ------------------------------------------------------------ reductions
def _contribution(dtype, op: str, rank: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s local part of a Partial(op): values that overflow small ints, exact in every float."""
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, SHAPE, generator=g).bool()
    if dtype in (torch.complex64, torch.complex128):
        return torch.complex(*(torch.randint(-8, 9, SHAPE, generator=g).double() for _ in range(2))).to(dtype)
    if dtype.is_floating_point:
        return torch.randint(-8, 9, SHAPE, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    hi = min(info.max, 2**62)  # uint64 through int64
    wide = torch.randint(max(info.min, -(2**62)), hi, SHAPE, generator=g)
    return wide.to(dtype)


def _widened(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.uint16, torch.uint32):
        return t.to(torch.int64)
    if t.dtype == torch.uint64:
        return t.view(torch.int64)  # values < 2**62: sums wrap like uint64
    return t.to(torch.float32)


def _reference(parts, op: str) -> torch.Tensor:
    """Single-process value of the Partial: ``a + b + ...`` (dtype kept: wraps, bool ors), or max/min."""
    fn = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    dtype = parts[0].dtype
    if dtype not in STORAGE_ONLY:
        return functools.reduce(fn, parts)
    out = functools.reduce(fn, [_widened(p) for p in parts])
    return out.view(dtype) if dtype == torch.uint64 else out.to(dtype)


def _ops(dtype):
    return ["sum"] if dtype.is_complex or dtype == torch.uint64 else ["sum", "max", "min"]


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_partial_reductions_are_exact_for_every_dtype(ctx):
    """Partial(op) -> Replicate (all_reduce) and -> Shard(0) (all-to-all, then a local reduction)."""
    mesh, n, me = ctx.mesh, ctx.world_size, ctx.rank
    for i, dtype in enumerate(ALL):
        for op in _ops(dtype):
            parts = [_contribution(dtype, op, r, seed=i) for r in range(n)]
            want = _reference(parts, op)
            spec = make_spec(mesh, (Partial(op),), SHAPE, dtype=dtype)
            x = ShardTensor(parts[me], spec, requires_grad=False)
            y = x.redistribute(placements=(Replicate(),))
            assert_bit_equal(y.to_local(), want, f"{dtype} Partial({op}) -> Replicate")
            if dtype in STORAGE_ONLY:
                continue  # no local reduction kernel for the reduce-scatter
            z = x.redistribute(placements=(Shard(0),))
            assert_bit_equal(z.to_local(), want[box(z._spec)], f"{dtype} Partial({op}) -> Shard(0)")
            assert_bit_equal(z.full_tensor(), want, f"{dtype} Partial({op}) -> Shard(0) full")


@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_unordered_dtypes_refuse_max_and_min(ctx):
    """Complex numbers have no order; uint64 has no backend kernel and no wider dtype: a clear error on every rank."""
    for dtype in (torch.complex64, torch.complex128, torch.uint64):
        for op in ("max", "min"):
            with pytest.raises(TypeError, match="reduction of"):
                C.all_reduce(torch.zeros(3, dtype=dtype), op, ctx.mesh, 0)
            with pytest.raises(TypeError, match="reduction of"):
                C.reduce_scatter_v(torch.zeros(2 * ctx.world_size, dtype=dtype), [2] * ctx.world_size, 0, op, ctx.mesh, 0)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_byte_counts_are_logical_bytes_of_the_callers_dtype(ctx):
    """A complex64 element counts 8 bytes, an int16 one 2, whatever travels on the wire."""
    for dtype in (torch.complex64, torch.int16, torch.float32):
        with C.count_collectives() as counter:
            C.all_gather_v(torch.zeros(3, dtype=dtype), [3, 3], 0, ctx.mesh, 0)
            C.all_reduce(torch.zeros(4, dtype=dtype), "sum", ctx.mesh, 0)
        assert counter.bytes_received["all_gather"] == 3 * dtype.itemsize
        assert counter.bytes_received["all_reduce"] == 4 * dtype.itemsize  # ring: 2 (P-1)/P * n


@distributed
def test_eager_collectives_equal_the_functional_ones(ctx):
    """In eager code the wrappers call the process group in place (cheaper); traced code keeps the
    functional collectives. Both give the same bits, shapes and dtypes: empty pieces, 0-dim,
    transposed, offset and expanded inputs included."""
    from physicsnemo_dp import _torch_compat as tc

    mesh, dims = ctx.mesh, range(ctx.mesh.ndim)
    cases = []
    for dtype in ALL:
        for shape in [(3, 4), (0, 4), (4, 0), (2, 3, 2), (3 * mesh.size(0), 2), (3 * mesh.size(-1), 0), ()]:
            cases.append(random_bits(shape, dtype, seed=len(cases) + 97 * ctx.rank))
        # the layouts real code hands over: transposed, offset, expanded
        seed = len(cases) + 97 * ctx.rank
        cases += [random_bits((4, 3), dtype, seed).t(), random_bits((5, 4), dtype, seed + 1)[1:4],
                  random_bits((1, 4), dtype, seed + 2).expand(3, 4)]

    def run():
        out = []
        for m in dims:
            for t in cases:
                for d in range(t.ndim):
                    out.append(tc.all_gather_tensor(t, d, mesh, m))
                out.append(tc.broadcast(t, mesh.size(m) - 1, mesh, m))
                if t.ndim and t.shape[0] == 3 * mesh.size(m):  # uneven splits, an empty one included
                    sizes = [3 * mesh.size(m) - 1, *[0] * (mesh.size(m) - 2), 1][: mesh.size(m)] if mesh.size(m) > 1 else [3]
                    received = [sizes[mesh.get_local_rank(m)]] * mesh.size(m)
                    out.append(tc.all_to_all_single(t, received, sizes, mesh, m))
                for op in ("sum", "max", "min"):
                    if t.dtype in STORAGE_ONLY or (op != "sum" and t.is_complex()):
                        continue
                    out.append(tc.all_reduce(t, op, mesh, m))
        return out

    assert tc._eager(cases[0])  # the first run takes the process group's ops
    eager = run()
    saved, tc._eager = tc._eager, lambda tensor: False  # by hand: the rank processes outlive a monkeypatch
    try:
        functional = run()
    finally:
        tc._eager = saved
    assert len(eager) == len(functional)
    for i, (a, b) in enumerate(zip(eager, functional)):
        assert_bit_equal(a, b, f"result {i}")
