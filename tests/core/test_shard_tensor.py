"""ShardTensor construction, conversion and autograd properties on uneven shards."""

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import PlacementError, ShardTensor, ShardTensorSpec, count_collectives
from physicsnemo_dp.split import chunk_sizes
from tests._harness import distributed

from ._util import box, integer_tensor, local_piece, make_spec, shard_from_global

SHAPE = (9, 4, 3)


def _sharded_placements(mesh):
    return [Shard(0)] if mesh.ndim == 1 else [Shard(0), Shard(2)]


def _raises(exc, fn, *words):
    try:
        fn()
    except exc as err:
        for w in words:
            assert w in str(err), f"{w!r} not in {err}"
        return err
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


@distributed
def test_from_local_infer_records_every_shard(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, _sharded_placements(mesh), SHAPE, "uneven")
    local = local_piece(G, spec)
    x = ShardTensor.from_local(local, mesh, spec.placements)
    assert x._spec == spec and hash(x._spec) == hash(spec)
    assert tuple(x.shape) == SHAPE
    assert torch.equal(x.to_local(), local)
    assert torch.equal(x.full_tensor(), G)
    assert x._spec.local_shape == local.shape
    assert all(type(s) is int for t in x._spec.dim_sizes if t for s in t)
    # sharding_shapes / offsets agree with the boxes
    for m, shapes in x._spec.sharding_shapes().items():
        assert len(shapes) == mesh.size(m)
        assert shapes[mesh.get_local_rank(m)] == tuple(local.shape)
    d0 = x.placements[0].dim
    assert x.offsets(0) == box(spec)[d0].start
    assert x.offsets() == tuple(box(spec)[p.dim].start if p.is_shard() else 0 for p in x.placements)


@distributed
def test_from_local_chunk_and_dict_need_no_communication(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    placements = _sharded_placements(mesh)
    chunk = ShardTensorSpec.chunked(mesh, placements, SHAPE, G.dtype)
    with count_collectives() as counter:
        x = ShardTensor.from_local(local_piece(G, chunk), mesh, placements, sharding_shapes="chunk", global_shape=SHAPE)
        uneven = make_spec(mesh, placements, SHAPE, "uneven")
        shapes = {m: uneven.sharding_shapes(m) for m in range(mesh.ndim)}
        y = ShardTensor.from_local(local_piece(G, uneven), mesh, placements, sharding_shapes=shapes)
    assert counter.total_calls == 0
    assert x._spec == chunk and y._spec == uneven
    assert torch.equal(x.full_tensor(), G) and torch.equal(y.full_tensor(), G)


@distributed
def test_from_local_errors_are_clear(ctx):
    mesh = ctx.mesh
    placements = _sharded_placements(mesh)
    t = torch.zeros(2, 4, 3, dtype=torch.float64)
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements, sharding_shapes="chunk"), "global_shape")
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements, sharding_shapes="bogus"), "sharding_shapes")
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, [Shard(5)] * mesh.ndim), "out of range")
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, [Replicate()] * (mesh.ndim + 1)), "one placement per mesh dim")
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements, sharding_shapes={}), "no entry for mesh dim")
    _raises(TypeError, lambda: ShardTensor.from_local("x", mesh, placements), "plain torch.Tensor")
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements, global_shape=(1, 2, 3)), "global_shape")


@distributed(world_sizes=(2, 3, 4))
def test_from_local_mismatches_raise_on_every_rank(ctx):
    mesh, rank = ctx.mesh, ctx.rank
    placements = _sharded_placements(mesh)
    # a different number of dims on one rank
    t = torch.zeros((2, 4, 3) if rank else (2, 4), dtype=torch.float32)
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements), "numbers of dims")
    # a different dtype on one rank
    t = torch.zeros(2, 4, 3, dtype=torch.float64 if rank else torch.float32)
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements), "dtypes")
    # an unsharded dim that differs
    t = torch.zeros(2, 4 + (rank == 1), 3)
    _raises(PlacementError, lambda: ShardTensor.from_local(t, mesh, placements), "disagree on the size of dim 1")


@distributed
def test_from_dtensor_and_back(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE).requires_grad_(True)
    d = distribute_tensor(G.detach(), mesh, _sharded_placements(mesh)).requires_grad_(True)
    x = ShardTensor.from_dtensor(d)
    assert x._spec.is_chunked()
    assert torch.equal(x.to_local(), d.to_local())
    assert torch.equal(x.full_tensor(), G.detach())
    (x.full_tensor() * 3).sum().backward()
    assert isinstance(d.grad, DTensor)
    assert torch.equal(d.grad.full_tensor(), torch.full(SHAPE, 3.0, dtype=G.dtype))
    # non-leaf DTensor keeps the graph
    e = distribute_tensor(G.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_(True)
    y = ShardTensor.from_dtensor(e * 2)
    y.full_tensor().sum().backward()
    assert torch.equal(e.grad.full_tensor(), torch.full(SHAPE, 2.0, dtype=G.dtype))


@distributed
def test_from_local_is_differentiable(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, _sharded_placements(mesh), SHAPE, "uneven")
    local = local_piece(G, spec).requires_grad_(True)
    x = ShardTensor.from_local(local, mesh, spec.placements)
    assert x.requires_grad and not x.is_leaf and x.grad_fn is not None
    W = integer_tensor(SHAPE, 5)
    (x.full_tensor() * W).sum().backward()
    assert torch.equal(local.grad, W[box(spec)])


@distributed
def test_to_local_grad_placements(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, [Replicate()] * mesh.ndim, SHAPE)
    x = shard_from_global(G, spec, requires_grad=True)
    # default: the local gradient is the full (replicated) gradient
    x.to_local().sum().backward()
    assert x.grad.placements == tuple([Replicate()] * mesh.ndim)
    assert torch.equal(x.grad.full_tensor(), torch.ones(SHAPE, dtype=G.dtype))
    # Partial: each rank's local gradient is a contribution, summed on resolution
    y = shard_from_global(G, spec, requires_grad=True)
    y.to_local(grad_placements=[Partial()] * mesh.ndim).sum().backward()
    assert all(p.is_partial() for p in y.grad.placements)
    assert torch.equal(y.grad.full_tensor(), torch.full(SHAPE, float(mesh.size()), dtype=G.dtype))


@distributed
def test_partial_to_local_is_the_contribution(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, [Partial()] * mesh.ndim, SHAPE)
    x = shard_from_global(G, spec)
    assert torch.equal(x.to_local(), local_piece(G, spec))
    assert torch.equal(x.full_tensor(), G)


@distributed
def test_autograd_properties(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, _sharded_placements(mesh), SHAPE, "uneven")
    x = shard_from_global(G, spec)
    assert x.is_leaf and x.grad_fn is None and not x.requires_grad and x.grad is None
    assert x.requires_grad_() is x and x.requires_grad
    assert not x._local_tensor.requires_grad
    assert x.grad_dtype == torch.float64
    y = x * 2
    assert y.grad_fn is not None and not y.is_leaf
    y.retain_grad()
    y.backward(torch.ones_like(y))
    assert isinstance(x.grad, ShardTensor) and x.grad._spec == x._spec
    assert torch.equal(x.grad.full_tensor(), torch.full(SHAPE, 2.0, dtype=G.dtype))
    assert torch.equal(y.grad.full_tensor(), torch.ones(SHAPE, dtype=G.dtype))
    # gradients accumulate across backward calls
    (x * 3).backward(torch.ones_like(x))
    assert torch.equal(x.grad.full_tensor(), torch.full(SHAPE, 5.0, dtype=G.dtype))
    # hooks see ShardTensor gradients
    seen = []
    z = shard_from_global(G, spec, requires_grad=True)
    z.register_hook(lambda g: seen.append(type(g).__name__))
    (z * 1).backward(torch.ones_like(z))
    assert seen == ["ShardTensor"]
    # torch.autograd.grad
    (g,) = torch.autograd.grad((z * 4).full_tensor().sum(), z)
    assert isinstance(g, ShardTensor) and torch.equal(g.full_tensor(), torch.full(SHAPE, 4.0, dtype=G.dtype))


@distributed
def test_backward_resolves_partial_first(ctx):
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, [Partial()] * mesh.ndim, SHAPE)
    x = shard_from_global(G, spec, requires_grad=True)
    x.backward(torch.ones(SHAPE, dtype=G.dtype))
    assert not any(p.is_partial() for p in x.grad.placements)
    assert torch.equal(x.grad.full_tensor(), torch.ones(SHAPE, dtype=G.dtype))


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_grad_assigned_by_hand_is_read_in_the_tensor_layout(ctx):
    mesh = ctx.mesh
    spec = make_spec(mesh, _sharded_placements(mesh), SHAPE, "uneven")
    x = shard_from_global(integer_tensor(SHAPE), spec, requires_grad=True)
    local_grad = torch.ones(spec.local_shape, dtype=torch.float64)
    x.grad = ShardTensor(local_grad, spec, requires_grad=False)
    assert x.grad._spec == spec




@distributed(world_sizes=(3,), mesh_2d=False)
def test_spec_equality_and_hash_include_sizes(ctx):
    mesh = ctx.mesh
    a = ShardTensorSpec.from_sizes(mesh, [Shard(0)], (7, 2), torch.float32, ((4, 0, 3), None))
    b = ShardTensorSpec.from_sizes(mesh, [Shard(0)], (7, 2), torch.float32, ((3, 3, 1), None))
    c = ShardTensorSpec.chunked(mesh, [Shard(0)], (7, 2), torch.float32)
    assert a != b and b == c and hash(b) == hash(c) and len({a, b, c}) == 2
    assert c.is_chunked() and not a.is_chunked()
    assert c.dim_sizes[0] == chunk_sizes(7, 3)
    _raises(PlacementError, lambda: ShardTensorSpec.from_sizes(mesh, [Shard(0)], (7, 2), torch.float32, ((4, 4, 3), None)), "add up to")


@distributed(world_sizes=(2,), mesh_2d=False)
def test_device_mismatch_is_refused(ctx):
    if ctx.device.type != "cpu":
        pytest.skip("needs a non-CPU mesh")

    meta = torch.zeros(2, device="meta")
    _raises(PlacementError, lambda: ShardTensor.from_local(meta, ctx.mesh, [Shard(0)]), "device")


@distributed(world_sizes=(1, 3), mesh_2d=False)
def test_detach_takes_its_rule_directly_unless_a_handler_is_registered(ctx):
    """``aten.detach`` (what autograd runs on every saved ShardTensor output of a Function) skips the
    dispatch layer's lookups: the table's rule's result (the local tensor detached, the same spec), with
    the dispatch layer not entered; a registered dispatch handler still sees the call."""
    from physicsnemo_dp import shard_tensor as st_module

    x = shard_from_global(torch.randn(7, 3, dtype=torch.float64), make_spec(ctx.mesh, (Shard(0),), (7, 3)))
    entered, general = [], st_module.handle_torch_dispatch
    st_module.handle_torch_dispatch = lambda *a: entered.append(a[0]) or general(*a)
    try:
        out = torch.ops.aten.detach.default(x)
        assert not entered and type(out) is ShardTensor and out is not x
        assert out._spec is x._spec and out._local_tensor is not x._local_tensor
        assert out._local_tensor.data_ptr() == x._local_tensor.data_ptr()
        y = x.detach().requires_grad_()
        (y * 2).sum().backward()  # a Function saving its output detaches it: through the fast path too
        assert torch.equal(y.grad._local_tensor, torch.full_like(x._local_tensor, 2.0))
        seen = []
        entered.clear()
        def handler(func, types, args, kwargs):
            seen.append(1)
            return ShardTensor._of_local(args[0]._local_tensor.detach(), args[0]._spec)

        ShardTensor.register_dispatch_handler(torch.ops.aten.detach.default, handler)
        try:
            assert type(torch.ops.aten.detach.default(x)) is ShardTensor and seen == [1]
            assert entered == [torch.ops.aten.detach.default]
        finally:
            from physicsnemo_dp.dispatch import registry

            registry.dispatch_handlers.unregister(torch.ops.aten.detach.default)
    finally:
        st_module.handle_torch_dispatch = general
