"""The same error on every rank: metadata agreement in from_local("infer") and the checking mode.

Issue 14, item 6: ``from_local(sharding_shapes="infer")`` already gathers every
rank's shape; it now carries the placements, ndim, dtype, ``global_shape`` and
each rank's own argument validity in that same all-gather, so a mistake made
on one rank raises the same ``PlacementError`` everywhere instead of building
inconsistent tensors or hanging. Item 7: the communication-free constructions
("chunk", a dict, ``from_dtensor``) and redistributions verify the ranks'
metadata collectively only in the checking mode (``physicsnemo_dp.debug.checks()``
or ``PDP_CHECKS=1``); off, they add no communication.
"""

import os
import threading

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import PlacementError, ShardTensor, ShardTensorSpec, count_collectives
from physicsnemo_dp.debug import checks, checks_enabled
from tests._harness import distributed

from ._util import integer_tensor, local_piece, make_spec, shard_from_global


def _raises(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    return str(info.value)


def _same_everywhere(ctx, message: str) -> None:
    """Every rank raised exactly this message (compared through a collective)."""
    import torch.distributed as dist

    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, message)
    assert len(set(everyone)) == 1, everyone


# --------------------------------------------------------------------------- #
# item 6: "infer" validates the gathered table, so every rank raises alike
# --------------------------------------------------------------------------- #
@distributed(world_sizes=(2, 3, 4))
def test_infer_with_other_placements_on_one_rank_raises_everywhere(ctx):
    """Before: rank 1 sharded dim 1 while the others sharded dim 0 and each built its own
    (inconsistent) tensor, e.g. global (4, 16) on rank 0 and (16, 4) elsewhere."""
    mesh = ctx.mesh
    local = torch.zeros(2, 4)
    placements = [Shard(0), Shard(1)][: mesh.ndim]
    if ctx.rank == 1:  # the other dim (1-D mesh), the other order (2x2 mesh)
        placements = [Shard(1), Shard(0)][: mesh.ndim]
    message = _raises(PlacementError, lambda: ShardTensor.from_local(local, mesh, placements), "different placements", "rank 1")
    _same_everywhere(ctx, message)


@distributed(world_sizes=(2, 3), mesh_2d=True)
def test_infer_with_a_shard_dim_out_of_range_on_one_rank_raises_everywhere(ctx):
    """Before: the bad rank raised alone, the others waited in the all-gather (a hang)."""
    mesh = ctx.mesh
    local = torch.zeros(2, 4)
    placements = [Shard(0)] * mesh.ndim
    if ctx.rank == 1:
        placements[0] = Shard(5)
    message = _raises(PlacementError, lambda: ShardTensor.from_local(local, mesh, placements), "out of range", "rank 1", "Shard(dim=5)")
    _same_everywhere(ctx, message)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_infer_with_other_invalid_arguments_on_one_rank_raises_everywhere(ctx):
    mesh = ctx.mesh
    one = ctx.rank == ctx.world_size - 1
    last = f"rank {ctx.world_size - 1}"
    good = torch.zeros(2, 4)
    # not a tensor on one rank (TypeError, as when every rank does it)
    message = _raises(TypeError, lambda: ShardTensor.from_local("x" if one else good, mesh, [Shard(0)]), "plain torch.Tensor", last)
    _same_everywhere(ctx, message)
    # a wrong global_shape on one rank
    shape = (9, 4) if one else (2 * ctx.world_size, 4)
    message = _raises(PlacementError, lambda: ShardTensor.from_local(good, mesh, [Shard(0)], global_shape=shape), "global_shape", last)
    _same_everywhere(ctx, message)
    # a placement list of the wrong length on one rank
    placements = [Shard(0), Replicate()] if one else [Shard(0)]
    message = _raises(PlacementError, lambda: ShardTensor.from_local(good, mesh, placements), "one placement per mesh dim", last)
    _same_everywhere(ctx, message)
    # and a good call still works afterwards (the ranks stayed in step)
    x = ShardTensor.from_local(good, mesh, [Shard(-2)])
    assert tuple(x.shape) == (2 * ctx.world_size, 4) and x.placements == (Shard(0),)


# --------------------------------------------------------------------------- #
# item 7: the checking mode
# --------------------------------------------------------------------------- #
def test_checks_state_nests_restores_and_stays_in_its_thread(monkeypatch):
    monkeypatch.delenv("PDP_CHECKS", raising=False)
    assert not checks_enabled()
    with checks():
        assert checks_enabled()
        with checks(False):
            assert not checks_enabled()
        assert checks_enabled()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(checks_enabled()))
        worker.start()
        worker.join()
        assert seen == [False]  # a new thread starts with a fresh context
    assert not checks_enabled()
    with pytest.raises(KeyError):
        with checks():
            raise KeyError
    assert not checks_enabled()

    @checks()
    def decorated(depth):
        return checks_enabled() and (depth == 0 or decorated(depth - 1))

    assert decorated(2) and not checks_enabled()
    monkeypatch.setenv("PDP_CHECKS", "1")  # read at use, no reset needed
    assert checks_enabled()
    with checks(False):
        assert not checks_enabled()
    monkeypatch.setenv("PDP_CHECKS", "0")
    assert not checks_enabled()


@distributed(world_sizes=(2, 3), mesh_2d=True)
def test_checks_off_add_no_communication_and_on_add_one_small_gather(ctx):
    mesh = ctx.mesh
    shape = (9, 4, 3)
    G = integer_tensor(shape)
    placements = (Shard(0),) + (Shard(2),) * (mesh.ndim - 1)
    chunk = ShardTensorSpec.chunked(mesh, placements, shape, G.dtype)
    uneven = make_spec(mesh, placements, shape)
    shapes = {m: uneven.sharding_shapes(m) for m in range(mesh.ndim)}
    replicated = (Replicate(),) * mesh.ndim

    def run():
        a = ShardTensor.from_local(local_piece(G, chunk), mesh, placements, "chunk", global_shape=shape)
        b = ShardTensor.from_local(local_piece(G, uneven), mesh, placements, sharding_shapes=shapes)
        return a, b.redistribute(placements=replicated)

    with count_collectives() as off:
        a, b = run()
    with checks(), count_collectives() as on:
        a2, b2 = run()
    gathers = sum(1 for n in mesh.shape)  # one all-gather per mesh dim for each check
    assert off.calls.get("all_gather", 0) == mesh.ndim  # the redistribution's own gathers
    assert on.total_calls == off.total_calls + 3 * gathers  # 2 constructions + 1 redistribution
    assert on.calls["all_gather"] == off.calls["all_gather"] + 3 * gathers
    assert a2._spec == a._spec and torch.equal(b2.to_local(), b.to_local()) and torch.equal(b.to_local(), G)


@distributed(world_sizes=(2, 3))
def test_checks_catch_chunk_arguments_that_differ_between_ranks(ctx):
    """A global_shape that differs on one rank: each rank's local shape fits its own layout,
    so without the check every rank builds a different tensor silently."""
    mesh = ctx.mesh
    placements = [Shard(0)] * mesh.ndim
    rows = 4 * mesh.size()
    local = torch.zeros(4, 2)
    mine = (rows - (ctx.rank == 0), 2)  # rank 0: one row less, still 4 of them locally
    unchecked = ShardTensor.from_local(local, mesh, placements, "chunk", global_shape=mine)
    assert tuple(unchecked.shape) == mine  # the silent inconsistency the checking mode exists for
    with checks():
        message = _raises(PlacementError, lambda: ShardTensor.from_local(local, mesh, placements, "chunk", global_shape=mine), "ranks disagree on the layout", "rank 0")
    _same_everywhere(ctx, message)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_checks_catch_a_dict_or_local_tensor_wrong_on_one_rank(ctx):
    """Before (and still without checks): the wrong rank raises alone, the others go on."""
    mesh = ctx.mesh
    n = ctx.world_size
    rows = [2] * n
    local = torch.zeros(2, 3)
    bad = list(rows)
    bad[-1] = 3
    shapes = {0: [(r, 3) for r in (bad if ctx.rank == n - 1 else rows)]}
    with checks():
        message = _raises(PlacementError, lambda: ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes=shapes), f"rank {n - 1}", "local tensor has shape")
    _same_everywhere(ctx, message)
    wrong = torch.zeros(3 if ctx.rank == 0 else 2, 3)
    with checks():
        message = _raises(PlacementError, lambda: ShardTensor.from_local(wrong, mesh, [Shard(0)], "chunk", global_shape=(2 * n, 3)), "rank 0")
    _same_everywhere(ctx, message)


@distributed(world_sizes=(2, 3))
def test_checks_catch_a_redistribution_of_inconsistent_tensors(ctx):
    """Tensors whose specs differ between ranks (built past every check) are stopped at the next redistribution."""
    mesh = ctx.mesh
    shape = (7, 4)
    placements = [Shard(0)] * mesh.ndim
    spec = make_spec(mesh, placements, shape, "chunk" if ctx.rank else "uneven")
    x = shard_from_global(integer_tensor(shape), spec)
    with checks():
        message = _raises(PlacementError, lambda: x.redistribute(placements=[Replicate()] * mesh.ndim), "redistribute", "rank 0", "different shard sizes")
    _same_everywhere(ctx, message)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_checks_catch_ranks_in_different_calls_and_from_dtensor_sizes(ctx):
    mesh = ctx.mesh
    local = torch.zeros(2, 3)
    with checks():
        if ctx.rank == 0:
            call = lambda: ShardTensor.from_local(local, mesh, [Shard(0)])  # noqa: E731
        else:
            call = lambda: ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", global_shape=(4, 3))  # noqa: E731
        message = _raises(PlacementError, call, "not in the same call", '"infer"', '"chunk"')
    _same_everywhere(ctx, message)
    # a DTensor whose local sizes are not torch.chunk's (3 and 1 rows of 4)
    dt = DTensor.from_local(torch.zeros(3 if ctx.rank == 0 else 1, 3), mesh, [Shard(0)], shape=(4, 3), stride=(3, 1))
    with checks():
        message = _raises(PlacementError, lambda: ShardTensor.from_dtensor(dt), "do not match their boxes", "rank 0 holds (3, 3)")
    _same_everywhere(ctx, message)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_pdp_checks_environment_variable_turns_the_mode_on(ctx):
    mesh = ctx.mesh
    local = torch.zeros(2, 3)
    before = os.environ.get("PDP_CHECKS")
    os.environ["PDP_CHECKS"] = "1"
    try:
        with count_collectives() as counter:
            ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", global_shape=(4, 3))
        assert counter.calls["all_gather"] == 1
        with checks(False), count_collectives() as counter:
            ShardTensor.from_local(local, mesh, [Shard(0)], "chunk", global_shape=(4, 3))
        assert counter.total_calls == 0
    finally:
        if before is None:
            del os.environ["PDP_CHECKS"]
        else:
            os.environ["PDP_CHECKS"] = before


@distributed(world_sizes=(2,), mesh_2d=False, timeout=300)
def test_checks_are_a_no_op_while_torch_compile_traces(ctx):
    """Compiled code runs unchecked (the fingerprint is run-time data); values stay right."""
    torch._dynamo.reset()
    mesh = ctx.mesh
    shape = (5, 3)
    G = integer_tensor(shape)
    x = shard_from_global(G, make_spec(mesh, [Shard(0)], shape))

    def fn(x):
        y = ShardTensor.from_local(x.to_local() * 2, mesh, [Shard(0)], sharding_shapes=x._spec.sharding_shapes())
        return y.redistribute(placements=[Shard(1)]) + 1

    f = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with checks(), count_collectives() as traced:
        out = f(x)
    assert "all_gather" not in traced.calls  # only the redistribution's all-to-all was traced
    with checks():
        assert torch.equal(out.full_tensor(), G * 2 + 1)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- #
# from_spec: the supported constructor from a known layout (datapipes, benchmarks)
# --------------------------------------------------------------------------- #
@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_from_spec_wraps_a_known_layout_without_communication(ctx):
    mesh = ctx.mesh
    placements = [Shard(0)] * mesh.ndim
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    x = shard_from_global(full, make_spec(mesh, placements, (7, 3), dtype=torch.float32))
    with count_collectives() as counter:
        y = ShardTensor.from_spec(x.to_local().clone(), x.spec)
    assert counter.total_calls == 0
    assert y.spec == x.spec and not y.requires_grad
    assert torch.equal(y.full_tensor(), full)
    w = x.to_local().clone().requires_grad_(True)  # differentiable like from_local
    (ShardTensor.from_spec(w, x.spec) * 2).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 2.0))
    wrong = torch.zeros(x.to_local().shape[0] + 1, 3)
    _raises(PlacementError, lambda: ShardTensor.from_spec(wrong, x.spec), "the spec gives this rank")
    _raises(PlacementError, lambda: ShardTensor.from_spec(x.to_local().double(), x.spec), "torch.float32")
    _raises(TypeError, lambda: ShardTensor.from_spec(x.to_local(), x.placements), "must be a ShardTensorSpec")


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_checks_catch_from_spec_with_another_layout_on_one_rank(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, [Shard(0) if ctx.rank != 1 else Shard(1)], (6, 4), kind="chunk", dtype=torch.float32)
    local = torch.zeros(spec.local_shape)
    with checks():
        message = _raises(PlacementError, lambda: ShardTensor.from_spec(local, spec), "from_spec", "disagree")
    _same_everywhere(ctx, message)
