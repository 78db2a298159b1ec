"""One rank's bad data raises the same error on every rank, instead of leaving the others blocked.

Issue 14, item 8 (and the statistics half of item 12): a NaN that only one
rank reads (its own slab) must reach every rank before they block in a
collective. Without ``check_all_ranks`` the clean ranks walk into the next
collective and wait until the harness's deadline (that is how these tests
fail on the code before it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from datapipes import DomainPipe, InvalidValuesError, check_all_ranks, compute_statistics
from tests._harness import distributed

from ._data import grid_fields, open_grid, write_grid

BAD_SAMPLE = 3


def _nan_in_last_rows(ctx, tmp_path):
    """The grid dataset with one NaN in the last row of ``pressure`` of sample 3: only the last domain rank reads it."""
    fields = grid_fields()
    fields["pressure"][BAD_SAMPLE, -1, 2] = np.nan
    path = [write_grid("hdf5", tmp_path, fields) if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _bad_rank(ctx) -> int:
    """Global rank of the last domain rank of the ddp group that reads sample 3 (ddp rank 3 % ddp size)."""
    ddp_size, domain_size = (1, ctx.world_size) if len(ctx.mesh_shape) == 1 else ctx.mesh_shape
    return (BAD_SAMPLE % ddp_size) * domain_size + domain_size - 1


@pytest.mark.parametrize("workers,prefetch", [("thread", 2), ("process", 1)])
@distributed(world_sizes=(1, 3), timeout=90)
def test_a_nan_in_one_ranks_slab_is_raised_on_every_rank(ctx, workers, prefetch, tmp_path):
    source = open_grid("hdf5", _nan_in_last_rows(ctx, tmp_path))
    with DomainPipe(source, ctx.mesh, shuffle=False, validate=True, workers=workers, prefetch=prefetch) as pipe:
        batches = iter(pipe)
        with pytest.raises(InvalidValuesError) as raised:
            for _ in range(len(pipe)):
                try:
                    error, _batch = None, next(batches)
                except Exception as err:
                    error = err
                check_all_ranks(error, ctx.mesh)
                dist.all_reduce(torch.ones(1))  # the step's first collective: reached only when all agree
    message = str(raised.value)
    bad = _bad_rank(ctx)
    assert f"rank(s) {bad} failed" in message
    assert f"variable 'pressure' of sample {BAD_SAMPLE}" in message and "stacked.h5" in message
    assert f"read by rank {bad} (ddp " in message
    assert (raised.value.__cause__ is not None) == (ctx.rank == bad)  # the original error, on the rank that had it


@distributed(world_sizes=(2,), mesh_2d=False)
def test_no_error_anywhere_costs_one_flag_and_raises_nothing(ctx):
    check_all_ranks(None)
    check_all_ranks(None, ctx.mesh)


@distributed(world_sizes=(1, 3), timeout=90)
def test_statistics_with_validate_reject_nan_on_every_rank(ctx, tmp_path):
    source = open_grid("hdf5", _nan_in_last_rows(ctx, tmp_path))
    with pytest.raises(InvalidValuesError, match=rf"'pressure' of sample {BAD_SAMPLE} .*read by rank {_bad_rank(ctx)}"):
        compute_statistics(source, ctx.mesh, validate=True, prefetch=0)
