"""The launcher and the demo, run as a user would (they start their own ranks)."""

import subprocess
import sys
import time

import pytest

from physicsnemo_dp import RankError, launch


def _coordinates(mesh):
    return tuple(mesh.get_coordinate()), mesh.mesh_dim_names


def _raise_on_rank_one(mesh):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, which never comes


def _print_and_return(mesh, value):
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} says hi")
    return value * (dist.get_rank() + 1)


def test_launch_returns_rank_zero_or_all_results(capfd):
    assert launch(_print_and_return, 3, args=(5,)) == 5
    assert launch(_print_and_return, 3, args=(5,), return_all=True) == [5, 10, 15]
    out = capfd.readouterr().out
    assert "[rank 2] rank 2 says hi" in out


def test_launch_builds_the_requested_mesh():
    coords = launch(_coordinates, 4, mesh_shape=(2, 2), return_all=True)
    assert [c for c, _ in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert coords[0][1] == ("ddp", "domain")


def test_failing_rank_surfaces_with_its_traceback_in_bounded_time():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank_one, 3, timeout=60)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "_raise_on_rank_one" in str(info.value)  # the rank's own traceback
    assert elapsed < 45, f"took {elapsed:.0f} s"


def test_launch_rejects_bad_mesh_shapes():
    with pytest.raises(ValueError, match="nprocs"):
        launch(_coordinates, 3, mesh_shape=(2, 2))


def test_demo_prints_match():
    result = subprocess.run(
        [sys.executable, "-m", "physicsnemo_dp.demo", "--ranks", "3", "--rows", "8", "--cols", "5"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MATCH" in result.stdout
