"""Per-rank misuse in the default mode: the same PlacementError on every rank, no hang, no extra collective.

Each case runs in its own job (``launch``): after a stall is reported, the
unmatched collective stays posted, so the process group cannot be reused.
"""

import time

import pytest

from physicsnemo_dp import launch


def _redistribute_to_another_target_on_rank_one(mesh):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from physicsnemo_dp import PlacementError, scatter_tensor

    x = scatter_tensor(torch.arange(24.0).reshape(6, 4), 0, mesh, (Shard(0),))
    target = (Shard(1),) if dist.get_rank() == 1 else (Replicate(),)  # an all-to-all here, all-gathers elsewhere
    try:
        x.redistribute(placements=target)
    except PlacementError as error:
        return _after_the_others_read_the_notes(str(error))
    return None


def _after_the_others_read_the_notes(message):
    """Under ``launch`` rank 0's process hosts the job's store: stay until every rank has its message."""
    import time

    import torch.distributed as dist

    from physicsnemo_dp._torch_compat import default_store

    store, size = default_store(), dist.get_world_size()
    store.add("test_stall/done", 1)
    while store.add("test_stall/done", 0) < size:
        time.sleep(0.02)
    if dist.get_rank():  # the store's host (rank 0) leaves last
        store.add("test_stall/left", 1)
    else:
        while store.add("test_stall/left", 0) < size - 1:
            time.sleep(0.02)
    return message


def _from_local_wrong_on_rank_one(mesh, mode):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Shard

    from physicsnemo_dp import PlacementError, ShardTensor

    rows = 3 if dist.get_rank() == 1 else 2  # rank 1's piece is not its chunk of (6, 4)
    shapes = "chunk" if mode == "chunk" else {0: [(2, 4)] * 3}
    try:
        x = ShardTensor.from_local(torch.ones(rows, 4), mesh, (Shard(0),), sharding_shapes=shapes, global_shape=(6, 4))
        x.full_tensor()  # the others wait here for rank 1
    except PlacementError as error:
        return _after_the_others_read_the_notes(str(error))
    return None


def _with_one_second_slices(mesh, fn, *args):
    """Rank body: ``fn`` with 1 s stall-check slices. Set here, not in the caller: ranks start from a fork server
    whose environment was fixed when it started (by an earlier test of the session, maybe)."""
    import os

    os.environ["PDP_STALL_SECONDS"] = "1"
    return fn(mesh, *args)


def _run(monkeypatch, fn, *args):
    monkeypatch.setenv("PDP_STALL_SECONDS", "1")
    start = time.monotonic()
    messages = launch(_with_one_second_slices, 3, args=(fn, *args), timeout=90, return_all=True, echo=False)
    return messages, time.monotonic() - start


def test_a_redistribution_whose_target_differs_on_one_rank_raises_the_same_error_everywhere(monkeypatch):
    messages, seconds = _run(monkeypatch, _redistribute_to_another_target_on_rank_one)
    assert None not in messages and len(set(messages)) == 1, messages  # the same text on every rank
    text = messages[0]
    assert "waiting in different collectives" in text and "programs diverged" in text
    assert "to (Shard(dim=1),)" in text and "to (Replicate(),)" in text  # each rank's call is named
    assert "rank 1: collective #" in text and "debug.checks()" in text
    assert seconds < 60  # reported after a stall-check slice, not the process group's timeout


@pytest.mark.parametrize(
    "mode", ["chunk", pytest.param("dict", marks=pytest.mark.slow)]  # the same path as "chunk": raised_alone
)
def test_from_local_wrong_on_one_rank_raises_the_same_error_everywhere(monkeypatch, mode):
    messages, _ = _run(monkeypatch, _from_local_wrong_on_rank_one, mode)
    assert None not in messages and len(set(messages)) == 1, messages
    assert messages[0].startswith("rank 1: local tensor has shape (3, 4)")
    assert "raised on rank 1 alone" in messages[0]


def test_the_stall_interval_is_validated(monkeypatch):
    from physicsnemo_dp import _stall

    monkeypatch.setenv("PDP_STALL_SECONDS", "soon")
    with pytest.raises(ValueError, match="PDP_STALL_SECONDS='soon'"):
        _stall.interval()
    monkeypatch.setenv("PDP_STALL_SECONDS", "0")
    assert _stall.interval() == 0
    monkeypatch.delenv("PDP_STALL_SECONDS")
    assert _stall.interval() == 10
