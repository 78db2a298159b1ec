"""Collectives over a mesh dim of one rank are identities: no torch.distributed call, the same records.

A world of one and the ``"ddp"`` dim of a ``1 x N`` mesh are where users run
without a second rank along a dim; every collective of
:mod:`physicsnemo_dp.collectives` there must cost what an identity costs (a
local copy at most), and counters must still see each call, so that traffic
accounting does not depend on the world size.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from physicsnemo_dp import _stall, count_collectives
from physicsnemo_dp import _torch_compat as tc
from physicsnemo_dp import collectives as C
from tests._harness import distributed

#: Everything through which a collective could reach torch.distributed (or wait for one).
_ENTRIES = [(tc, "all_reduce"), (tc, "all_gather_tensor"), (tc, "all_to_all_single"), (tc, "broadcast"),
            (torch.distributed, "batch_isend_irecv"), (_stall, "wait")]  # fmt: skip


def _refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} called over a one-rank mesh dim")

    return refused


def _one_rank_dim(ctx):
    """A mesh and one of its dims that holds this rank only (the world's mesh at ws1, the "ddp" dim of 1 x N)."""
    if ctx.world_size == 1:
        return ctx.mesh, 0
    return init_device_mesh(ctx.device.type, (1, ctx.world_size), mesh_dim_names=("ddp", "domain")), 0


@distributed(world_sizes=(1, 3), mesh_2d=False)
def test_one_rank_collectives_skip_torch_distributed_and_are_counted(ctx):
    mesh, m = _one_rank_dim(ctx)
    x = torch.arange(12.0, device=ctx.device).reshape(4, 3) + ctx.rank
    saved = [(owner, name, getattr(owner, name)) for owner, name in _ENTRIES]
    for owner, name, _ in saved:
        setattr(owner, name, _refuse(name))
    try:
        with count_collectives() as counter:
            assert C.all_reduce(x, "sum", mesh, m) is x
            assert torch.equal(C.all_reduce(x, "avg", mesh, m), x)
            assert C.all_gather_v(x, [4], 0, mesh, m) is x
            assert torch.equal(C.reduce_scatter_v(x, [3], 1, "sum", mesh, m), x)
            assert C.all_to_all_v(x, [4], [4], mesh, m) is x
            assert C.broadcast(x, 0, mesh, m) is x
            halo = C.neighbour_exchange(x, [(0, 4)], [(0, 4)], mesh, m)
            assert torch.equal(halo, x) and halo.data_ptr() != x.data_ptr()  # a copy: the caller may write it
            assert C.neighbour_exchange(x[:0], [], [], mesh, m).shape == (0, 3)
            ring = C.send_recv(
                [x, x[:0], 2 * x], 0, [((4, 3), x.dtype), ((0, 3), x.dtype), ((4, 3), x.dtype)], 0, mesh, m
            )
            got = ring.wait()  # a ring of one: what is sent arrives, in order
            assert torch.equal(got[0], x) and got[1].shape == (0, 3) and torch.equal(got[2], 2 * x)
        if ctx.world_size == 1:
            with count_collectives() as ints:
                assert C.gather_ints([3, 5], mesh) == [[3, 5]]
            assert ints.summary() == {"all_gather": {"calls": 1, "sent": 0, "received": 0}}
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    payload = 2 * x.numel() * x.element_size()
    assert counter.summary() == {
        "all_gather": {"calls": 1, "sent": 0, "received": 0},
        "all_reduce": {"calls": 2, "sent": 0, "received": 0},
        "all_to_all": {"calls": 1, "sent": 0, "received": 0},
        "broadcast": {"calls": 1, "sent": 0, "received": 0},
        "neighbour_exchange": {"calls": 2, "sent": 0, "received": 0},
        "reduce_scatter": {"calls": 1, "sent": 0, "received": 0},
        "send_recv": {"calls": 1, "sent": payload, "received": payload},
    }
