"""Every transition among Shard, Replicate and Partial, on uneven and empty shards.

Forward: the result holds exactly the target layout's piece of the global
tensor. Backward: the gradient of ``sum(full * W)`` reaches the source as ``W``
in the source's layout (Partial read as Replicate). Traffic: the counted bytes
stay within 10% of the minimum the transition needs.
"""

from itertools import product

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import PlacementError, ShardTensor, count_collectives
from physicsnemo_dp.split import chunk_sizes
from tests._harness import distributed

from ._util import box, integer_tensor, make_spec, shard_from_global

SHAPE = (7, 5)
ONE_D = [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)]


def _placement_sets(mesh):
    if mesh.ndim == 1:
        return ONE_D
    return list(product([Shard(0), Shard(1), Replicate(), Partial()], repeat=2))


def _check_transition(G, W, mesh, src_placements, dst_placements, kind):
    src_spec = make_spec(mesh, src_placements, SHAPE, kind)
    x = shard_from_global(G, src_spec, requires_grad=True)
    y = x.redistribute(placements=dst_placements)
    where = f"{src_placements} [{kind}] -> {dst_placements}"
    assert tuple(y.placements) == tuple(dst_placements), where
    assert tuple(y.shape) == SHAPE
    if not any(isinstance(p, Partial) for p in dst_placements):
        assert torch.equal(y.to_local(), G[box(y._spec)]), where
    full = y.full_tensor()
    assert torch.equal(full, G), where
    (full * W).sum().backward()
    grad = x.grad
    assert grad is not None and grad._spec.dim_sizes == src_spec.dim_sizes, where
    assert not any(isinstance(p, Partial) for p in grad.placements), where
    assert torch.equal(grad.full_tensor(), W), where
    return y


@distributed
def test_all_transitions_uneven(ctx):
    G, W = integer_tensor(SHAPE, 1), integer_tensor(SHAPE, 2)
    for kind in ("uneven", "chunk"):
        for src, dst in product(_placement_sets(ctx.mesh), repeat=2):
            _check_transition(G, W, ctx.mesh, src, dst, kind)


@distributed
def test_same_placements_is_a_no_op(ctx):
    spec = make_spec(ctx.mesh, (Shard(0),) * ctx.mesh.ndim, SHAPE)
    x = shard_from_global(integer_tensor(SHAPE), spec)
    with count_collectives() as counter:
        assert x.redistribute(placements=x.placements) is x
    assert counter.total_calls == 0


@distributed
def test_new_sharding_follows_the_split_rule(ctx):
    mesh = ctx.mesh
    x = shard_from_global(integer_tensor(SHAPE), make_spec(mesh, (Replicate(),) * mesh.ndim, SHAPE))
    y = x.redistribute(placements=(Replicate(),) * (mesh.ndim - 1) + (Shard(1),))
    assert y._spec.dim_sizes[1] == chunk_sizes(SHAPE[1], mesh.size(mesh.ndim - 1))


@distributed
def test_kept_dims_keep_their_uneven_sizes(ctx):
    mesh = ctx.mesh
    if mesh.ndim == 1:
        return
    spec = make_spec(mesh, (Shard(0), Shard(1)), SHAPE)
    x = shard_from_global(integer_tensor(SHAPE), spec)
    y = x.redistribute(placements=(Shard(0), Replicate()))
    assert y._spec.dim_sizes[0] == spec.dim_sizes[0]


def _row_bytes(G, dim):
    return G.element_size() * G.numel() // G.shape[dim]


@distributed(mesh_2d=False)
def test_traffic_within_ten_percent_of_minimum(ctx):
    """Uneven all-gather, Shard(a)->Shard(b), Partial->Shard and rebalancing move (almost) only what is needed."""
    mesh, P, me = ctx.mesh, ctx.world_size, ctx.rank
    G = integer_tensor((11, 6), 3)
    row0, elem = _row_bytes(G, 0), G.element_size()
    cases = []
    # uneven all-gather: a rank must receive every row it does not hold
    src = make_spec(mesh, [Shard(0)], G.shape, "uneven")
    mine = src.local_shape[0]
    cases.append((src, [Replicate()], (G.shape[0] - mine) * row0))
    # Shard(0) -> Shard(1): a rank receives its column block of the rows it does not hold
    dst_cols = chunk_sizes(G.shape[1], P)[me]
    cases.append((src, [Shard(1)], (G.shape[0] - mine) * dst_cols * elem))
    # Partial -> Shard(0): the other ranks' contributions to my rows
    partial = make_spec(mesh, [Partial()], G.shape, "chunk")
    cases.append((partial, [Shard(0)], (P - 1) * chunk_sizes(G.shape[0], P)[me] * row0))
    for spec, dst, minimum in cases:
        x = shard_from_global(G, spec)
        with count_collectives() as counter:
            y = x.redistribute(placements=dst)
        assert torch.equal(y.full_tensor(), G)
        moved = counter.total_received
        assert moved <= 1.1 * minimum, f"{spec.placements}->{dst}: received {moved} B, minimum {minimum} B"
        print(f"{spec.placements} -> {dst}: received {moved} B, minimum {minimum} B")


@distributed(mesh_2d=False)
def test_rebalance_moves_only_the_misplaced_rows(ctx):
    mesh = ctx.mesh
    G = integer_tensor((11, 6), 4)
    src = make_spec(mesh, [Shard(0)], G.shape, "uneven")
    dst = make_spec(mesh, [Shard(0)], G.shape, "chunk")
    x = shard_from_global(G, src)
    from physicsnemo_dp._conversion import Redistribute

    with count_collectives() as counter:
        y = Redistribute.apply(x, dst)
    assert torch.equal(y.to_local(), G[box(dst)])
    have = set(range(*box(src)[0].indices(11)))
    need = set(range(*box(dst)[0].indices(11)))
    assert counter.total_received == len(need - have) * _row_bytes(G, 0)


@distributed
def test_bad_placements_raise_on_every_rank(ctx):
    mesh = ctx.mesh
    x = shard_from_global(integer_tensor(SHAPE), make_spec(mesh, (Replicate(),) * mesh.ndim, SHAPE))
    for bad in [(Shard(2),) * mesh.ndim, (Shard(-3),) * mesh.ndim, (Replicate(),) * (mesh.ndim + 1)]:
        try:
            x.redistribute(placements=bad)
        except PlacementError as err:
            assert "placement" in str(err)
        else:
            raise AssertionError(f"{bad} was accepted")
    try:
        x.redistribute()
    except PlacementError:
        pass
    else:
        raise AssertionError("missing placements accepted")


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_redistribute_to_another_mesh_is_refused(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    other = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("other",))
    x = shard_from_global(integer_tensor(SHAPE), make_spec(ctx.mesh, [Replicate()], SHAPE))
    try:
        x.redistribute(other, [Shard(0)])
    except PlacementError as err:
        assert "different device mesh" in str(err)
    else:
        raise AssertionError("cross-mesh redistribute accepted")


@distributed
def test_negative_shard_dim_is_normalized(ctx):
    mesh = ctx.mesh
    x = shard_from_global(integer_tensor(SHAPE), make_spec(mesh, (Replicate(),) * mesh.ndim, SHAPE))
    y = x.redistribute(placements=(Replicate(),) * (mesh.ndim - 1) + (Shard(-1),))
    assert y.placements[-1] == Shard(1)


@distributed(mesh_2d=False)
def test_gradient_of_an_average_contribution_is_scaled(ctx):
    """value = mean of contributions, so each contribution's gradient is grad / P."""
    mesh = ctx.mesh
    G = integer_tensor(SHAPE)
    spec = make_spec(mesh, [Partial("avg")], SHAPE)
    x = ShardTensor(G.clone(), spec, requires_grad=True)  # every rank contributes G: the average is G
    full = x.full_tensor()
    assert torch.equal(full, G)
    full.sum().backward()
    assert torch.allclose(x.grad.to_local(), torch.full(SHAPE, 1.0 / ctx.world_size, dtype=G.dtype))


@distributed(world_sizes=(2,), mesh_2d=False)
def test_no_gradient_through_partial_max(ctx):
    spec = make_spec(ctx.mesh, [Partial("max")], SHAPE)
    x = ShardTensor(integer_tensor(SHAPE), spec, requires_grad=True)
    try:
        x.full_tensor().sum().backward()
    except NotImplementedError as err:
        assert "Partial('max')" in str(err)
    else:
        raise AssertionError("backward through Partial('max') was accepted")
