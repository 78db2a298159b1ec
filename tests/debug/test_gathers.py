"""Implicit gathers: every kind is recorded with its op, bytes per rank and the user's line; the policy
("warn" once per line, "raise" on every rank alike, "allow") and PDP_IMPLICIT_GATHERS; and the paths that
must not report (explicit requests, halos, ring attention, graphs, gradients of whole tensors)."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

import physicsnemo_dp
from physicsnemo_dp import ImplicitGatherError, ShardTensor, ImplicitGatherWarning, count_collectives, implicit_gathers
from physicsnemo_dp._gathers import FIX_INDEX, FIX_PLAIN_BUFFER, listening
from physicsnemo_dp.debug import explain, gather_policy
from physicsnemo_dp.graph import build_graph
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global

N, E, F_ = 23, 31, 5


def _here() -> int:
    """The caller's line number."""
    return inspect.currentframe().f_back.f_lineno


def _src(line: int) -> str:
    return f"{__file__}:{line}"


def _sharded(mesh, shape, seed, dtype=torch.float32, dim=0, requires_grad=False, salt=0):
    """A ShardTensor of ``shape`` sharded unevenly along ``dim`` on the last mesh dim (Replicate on the others)."""
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(dim)]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    if not dtype.is_floating_point:
        full = torch.randint(0, N, shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return shard_from_global(full, make_spec(mesh, placements, shape, dtype=dtype, salt=salt), requires_grad), full


class _Records:
    def __init__(self):
        self.found = []

    def implicit_gather(self, record):
        self.found.append(record)


@distributed(world_sizes=(3,), mesh_2d=True)
def test_each_kind_is_recorded_with_op_bytes_and_line(ctx):
    x, x_full = _sharded(ctx.mesh, (N, F_), 0, requires_grad=True)
    idx, idx_full = _sharded(ctx.mesh, (E,), 1, dtype=torch.int64, salt=1)
    with implicit_gathers("allow"), listening(_Records()) as sink:
        # x[idx] / index_select / gather along dim 0 with an index ShardTensor that is not a graph's: by request
        y = x[idx]
        assert torch.equal(y.full_tensor(), x_full[idx_full]) and y.placements == idx.placements
        torch.index_select(x, 0, idx)
        torch.gather(x, 0, idx[:, None].expand(E, F_).contiguous())
        # gather with such an index along a dim that is not the leading one: a pending sum of the index length
        xt, _ = _sharded(ctx.mesh, (F_, N), 0, dim=1)
        line_gather = _here() + 1
        torch.gather(xt, 1, idx[None, :].expand(F_, E).contiguous())
        # torch_scatter's torch.zeros(N, F).index_add_ / scatter_add_ pattern: by request, node-sharded, not recorded
        src, src_full = _sharded(ctx.mesh, (E, F_), 2, salt=2)
        out = torch.zeros(N, F_).index_add_(0, idx, src)
        assert isinstance(out, ShardTensor) and out.placements[-1] == Shard(0)
        assert torch.allclose(out.full_tensor(), torch.zeros(N, F_).index_add_(0, idx_full, src_full), atol=1e-6)
        # sharded values written into a plain buffer otherwise (the index and the source gathered whole)
        line_plain = _here() + 1
        torch.zeros(F_, N).index_add_(1, idx, src.transpose(0, 1))  # along dim 1: no request path
        # a contraction that gathers an operand whole (window attention as timm writes it: tokens sharded)
        q, q_full = _sharded(ctx.mesh, (N, F_), 3, salt=3)
        k, k_full = _sharded(ctx.mesh, (N, F_), 4, salt=4)
        line_mm = _here() + 1
        s = q @ k.transpose(0, 1)
        assert torch.allclose(s.full_tensor(), q_full @ k_full.T, atol=1e-5)
    by_line = {}
    for r in sink.found:
        by_line.setdefault(r.source, []).append(r)
    assert set(by_line) == {_src(n) for n in (line_gather, line_plain, line_mm)}
    (gather,) = by_line[_src(line_gather)]
    assert (gather.op, gather.phase, gather.fix) == ("gather", "forward", FIX_INDEX)
    assert gather.kind == "pending sum of the global index length" and gather.nbytes == E * F_ * 8 + E * F_ * 4
    plain = by_line[_src(line_plain)]  # the index and the source, each gathered whole
    assert [r.op for r in plain] == ["index_add_"] * 2 and {r.fix for r in plain} == {FIX_PLAIN_BUFFER}
    assert sorted(r.nbytes for r in plain) == [E * 8, E * F_ * 4]
    assert all(r.kind.startswith("sharded values written into a plain tensor") for r in plain)
    (mm,) = by_line[_src(line_mm)]
    assert mm.op == "matmul" and mm.kind == "all-gather" and mm.nbytes == N * F_ * 4
    # every rank records the same (op, kind, bytes, line): decided from layouts alone
    mine = [(r.op, r.kind, r.nbytes, r.source) for r in sink.found]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert all(o == mine for o in every)


@distributed(world_sizes=(3,), mesh_2d=True)
def test_raise_is_the_same_error_on_every_rank_before_anything_moves(ctx):
    x, _ = _sharded(ctx.mesh, (F_, N), 0, dim=1)  # read along dim 1: no request path
    idx, _ = _sharded(ctx.mesh, (E,), 1, dtype=torch.int64, salt=1)
    with count_collectives() as counter, implicit_gathers("raise"):
        with pytest.raises(ImplicitGatherError) as error:
            line = _here() + 1
            x[:, idx]
    assert counter.summary() == {}  # raised before any collective
    message = str(error.value)
    assert "__getitem__" in message and _src(line) in message and "build_graph" in message
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    assert all(m == message for m in every)
    torch.ones(1).sum()  # the ranks are in step: a collective after the error completes
    dist.barrier()


@distributed(world_sizes=(3,), mesh_2d=False)
def test_warn_once_per_line_by_the_first_rank_and_allow_is_silent(ctx):
    x, _ = _sharded(ctx.mesh, (F_, N), 0, dim=1)  # read along dim 1: no request path
    idx, _ = _sharded(ctx.mesh, (E,), 1, dtype=torch.int64, salt=1)
    assert gather_policy() == "warn"  # the default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            line = _here() + 1
            x[:, idx]
        with implicit_gathers("allow"):
            x[:, idx[:7]]
    ours = [w for w in caught if issubclass(w.category, ImplicitGatherWarning)]
    if ctx.rank == 0:
        assert len(ours) == 1 and (ours[0].filename, ours[0].lineno) == (__file__, line)
        assert "Fix: build the graph with physicsnemo_dp.graph.build_graph" in str(ours[0].message)
    else:
        assert ours == []


@distributed(world_sizes=(3,), mesh_2d=False)
def test_environment_variable_and_block_precedence(ctx):
    x, _ = _sharded(ctx.mesh, (F_, N), 0, dim=1)  # read along dim 1: no request path
    idx, _ = _sharded(ctx.mesh, (E,), 1, dtype=torch.int64, salt=1)
    old = os.environ.get("PDP_IMPLICIT_GATHERS")
    try:
        os.environ["PDP_IMPLICIT_GATHERS"] = "raise"
        assert gather_policy() == "raise"
        with pytest.raises(ImplicitGatherError):
            x[:, idx]
        with implicit_gathers("allow"):  # a block wins over the environment
            x[:, idx]
        os.environ["PDP_IMPLICIT_GATHERS"] = "ALLOW"
        x[:, idx]
        os.environ["PDP_IMPLICIT_GATHERS"] = "loud"
        with pytest.raises(ValueError, match="PDP_IMPLICIT_GATHERS.*'warn', 'raise', 'allow'.*'loud'"):
            x[:, idx]
    finally:
        if old is None:
            os.environ.pop("PDP_IMPLICIT_GATHERS", None)
        else:
            os.environ["PDP_IMPLICIT_GATHERS"] = old
    with pytest.raises(ValueError, match="implicit_gathers: .*'sometimes'"):
        with implicit_gathers("sometimes"):
            pass


@distributed(world_sizes=(3,), mesh_2d=False)
def test_explain_lists_the_implicit_gathers_of_the_step(ctx):
    x, _ = _sharded(ctx.mesh, (F_, N), 0, dim=1, requires_grad=True)
    idx, _ = _sharded(ctx.mesh, (E,), 1, dtype=torch.int64, salt=1)
    line = _here() + 3

    def step():
        (x[:, idx] * 2).sum().backward()

    with implicit_gathers("allow"):
        e = explain(step)
    found = e.implicit_gathers()
    assert len(found) == 1
    row, record = found[0]
    assert e.rows[row].op == "__getitem__" and record.source == _src(line)
    assert e.records[row]["implicit_gather_bytes"] == E * 8 + E * F_ * 4
    text = str(e)
    assert "implicit gathers: 1," in text and f"#{row} __getitem__" in text and "fix: build the graph" in text
    clean = explain(lambda: (x * 2).sum().backward())
    assert clean.implicit_gathers() == [] and str(clean).endswith("implicit gathers: none")


@distributed(world_sizes=(3,), mesh_2d=True, timeout=120)
def test_explicit_requests_and_the_algorithms_own_traffic_are_not_reported(ctx):
    mesh = ctx.mesh
    domain = mesh.ndim - 1
    with implicit_gathers("raise"), listening(_Records()) as sink:
        # explicit requests, forward and backward
        x, x_full = _sharded(mesh, (N, F_), 0, requires_grad=True)
        assert torch.equal(x.full_tensor(), x_full)
        cols = x.redistribute(placements=[Replicate()] * domain + [Shard(1)])
        whole = x.redistribute(placements=[Replicate()] * mesh.ndim)
        (cols.sum() + whole.sum() + x.full_tensor().sum()).backward()
        # a plain weight (whole) and its gradient; a reduction; softmax along an unsharded dim
        w = torch.randn(F_, 4, requires_grad=True)
        (torch.softmax(x @ w, dim=1).sum() + x.mean()).backward()
        # a halo convolution
        img, _ = _sharded(mesh, (1, 2, 12, 9), 5, dim=2, requires_grad=True, salt=5)
        conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        conv(img).sum().backward()
        # ring / sequence-sharded attention
        q, _ = _sharded(mesh, (1, 2, 11, 4), 6, dim=2, requires_grad=True, salt=6)
        k, _ = _sharded(mesh, (1, 2, 11, 4), 7, dim=2, requires_grad=True, salt=7)
        v, _ = _sharded(mesh, (1, 2, 11, 4), 8, dim=2, requires_grad=True, salt=8)
        F.scaled_dot_product_attention(q, k, v).sum().backward()
        # a graph: ghost rows and aggregation at the owner
        ids = torch.arange(N)
        edges = torch.stack([(ids + 3) % N, ids]) if ctx.rank == 0 else torch.zeros(2, 0, dtype=torch.long)
        g = build_graph(edges, x)
        msg = x[g.src] - x[g.dst]
        agg = torch.zeros_like(x).index_add_(0, g.dst, msg)
        agg.sum().backward()
        # Python values are whole by definition
        x.sum().item(), x.tolist()
    assert sink.found == []
    assert physicsnemo_dp.implicit_gathers is implicit_gathers


@distributed(world_sizes=(3,), mesh_2d=False)
def test_a_gather_in_backward_is_filed_under_the_backward_call(ctx):
    q, _ = _sharded(ctx.mesh, (N, F_), 3, requires_grad=True, salt=3)
    k, _ = _sharded(ctx.mesh, (N, F_), 4, requires_grad=True, salt=4)
    with implicit_gathers("allow"), listening(_Records()) as sink:
        s = q @ k.transpose(0, 1)
        line = _here() + 1
        s.square().sum().backward()
    backward = [r for r in sink.found if r.phase == "backward"]
    assert backward and all(r.source == _src(line) for r in backward)
    assert all(r.nbytes > 0 and r.op != "?" for r in backward)
