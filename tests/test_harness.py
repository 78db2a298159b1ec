"""Tests of the multi-rank harness itself (tests/_harness).

The failure cases drive the pool API directly and assert on the RankFailure it
raises, its wording and how long it took; the bodies they ship are the
module-level ``_...`` functions below.
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankFailure, distributed, get_pool
from tests._harness.pool import choose_device
from tests._harness.worker import Job

# ---------------------------------------------------------------- passing tests via @distributed


@distributed
def test_all_reduce_and_mesh(ctx):
    assert ctx.device.type == choose_device(ctx.backend) == ctx.mesh.device_type  # PDP_TEST_DEVICE, or the backend's
    if ctx.device.type == "cuda":
        assert ctx.device.index == ctx.rank % torch.cuda.device_count() == torch.cuda.current_device()
    assert dist.get_rank() == ctx.rank and dist.get_world_size() == ctx.world_size
    assert tuple(ctx.mesh.shape) == ctx.mesh_shape
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == sum(range(ctx.world_size))
    if len(ctx.mesh_shape) == 1:
        assert ctx.mesh.mesh_dim_names == ("domain",)
        return
    assert ctx.mesh_shape == (2, 2)
    assert ctx.mesh.mesh_dim_names == ("ddp", "domain")
    ddp, domain = ctx.mesh.get_coordinate()
    assert ctx.rank == 2 * ddp + domain  # the mesh is arange(4).view(2, 2)
    row = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(row, group=ctx.mesh["domain"].get_group())
    assert row.item() == 2 * ddp + 2 * ddp + 1  # ranks {2*ddp, 2*ddp + 1}
    column = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(column, group=ctx.mesh["ddp"].get_group())
    assert column.item() == domain + (2 + domain)  # ranks {domain, 2 + domain}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@distributed(world_sizes=(2, 3), mesh_2d=False, timeout=30)
def test_parametrize_forwards_params_and_fixtures(ctx, dtype, tmp_path):
    t = torch.ones(2, dtype=dtype, device=ctx.device)
    dist.all_reduce(t)
    assert t.dtype == dtype and t.tolist() == [ctx.world_size] * 2
    (tmp_path / f"rank{ctx.rank}").write_text("here")  # every rank sees the test process's tmp_path
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(ctx.world_size)]


@distributed(world_sizes=(2,), mesh_2d=False)
def test_seed_gives_the_same_stream_on_every_rank(ctx):
    ctx.seed(1234)
    mine = torch.randn(8, device=ctx.device)
    largest = mine.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    assert torch.equal(mine, largest)


def test_distributed_rejects_nested_functions():
    def body(ctx):
        pass

    with pytest.raises(TypeError, match="module-level"):
        distributed(body)


def _patches(ctx, monkeypatch):
    pass


def test_distributed_rejects_fixtures_that_act_on_the_test_process():
    with pytest.raises(TypeError, match=r"\['monkeypatch'\].*try/finally"):
        distributed(_patches)


@pytest.mark.parametrize(("env", "backend", "expected"), [
    ("", "gloo", "cpu"), ("cpu", "gloo", "cpu"), ("", "nccl", "cuda"), ("cuda", "nccl", "cuda"),
    (" CUDA ", "gloo", "cuda"),  # ranks sharing the GPUs there are, through gloo
    ("cpu", "nccl", "NCCL moves CUDA tensors only"), ("tpu", "gloo", "expected cpu or cuda"),
])  # fmt: skip
def test_pdp_test_device_picks_where_ranks_allocate(monkeypatch, env, backend, expected):
    monkeypatch.setenv("PDP_TEST_DEVICE", env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # choose_device asks only this
    if expected in ("cpu", "cuda"):
        assert choose_device(backend) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            choose_device(backend)


def test_pdp_test_device_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setenv("PDP_TEST_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"PDP_TEST_DEVICE=cuda but torch.cuda.is_available\(\) is False"):
        choose_device("gloo")


# ---------------------------------------------------------------- bodies shipped by the pool tests


def _pid(ctx):
    return os.getpid()


def _print_then_fail_on_rank_0(ctx):
    print(f"hello from rank {ctx.rank}")
    assert ctx.rank != 0, "rank 0 fails on purpose"


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise AssertionError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever


def _hang_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(3600)
    dist.barrier()


def _exit_on_rank_1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def _segfault_on_rank_0(ctx):
    if ctx.rank == 0:
        ctypes.string_at(0)
    dist.barrier()


def _bare_assert(ctx):
    assert ctx.world_size == 99


def _skip(ctx):
    pytest.skip("not on this layout")


def _job(name, world_size):
    return Job(__name__, name, {}, (world_size,))


def _run_failing(pool, name, timeout=20.0, grace=2.0):
    """Run a job that must fail; return the RankFailure and the seconds it took."""
    began = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_job(name, pool.world_size), timeout=timeout, grace=grace)
    return info.value, time.monotonic() - began


# ---------------------------------------------------------------- pool behaviour


def test_pool_is_reused_between_jobs():
    pool = get_pool(2)
    first = [o.value for o in pool.run(_job("_pid", 2))]
    second = [o.value for o in pool.run(_job("_pid", 2))]
    assert first == second == pool.pids
    assert len(set(first)) == 2


def test_output_is_captured_per_rank_and_reported():
    pool = get_pool(2)
    failure, _ = _run_failing(pool, "_print_then_fail_on_rank_0")
    assert [o.status for o in failure.outcomes] == ["raised", "ok"]
    assert failure.outcomes[0].output == "hello from rank 0\n"
    assert failure.outcomes[1].output == "hello from rank 1\n"
    message = str(failure)
    assert message.startswith("rank 0 raised AssertionError: rank 0 fails on purpose\n")
    assert "rank 1 finished ok" in message
    assert "----- rank 0 output -----\nhello from rank 0" in message
    assert "----- rank 1 output -----\nhello from rank 1" in message


def test_failing_rank_is_reported_and_its_blocked_peers_get_a_grace_period():
    pool = get_pool(3)
    pool.start()
    before = pool.pids
    failure, seconds = _run_failing(pool, "_raise_on_rank_1", timeout=60.0, grace=2.0)
    assert seconds < 2.0 + 6.0, "the grace period, not the 60 s deadline, must end the job"
    assert [o.status for o in failure.outcomes] == ["unfinished", "raised", "unfinished"]
    message = str(failure)
    assert message.startswith("rank 1 raised AssertionError: rank 1 fails on purpose\n")
    assert 'raise AssertionError("rank 1 fails on purpose")' in message  # the traceback
    assert "rank 0 and rank 2 did not finish within 2 s after rank 1 failed" in message
    assert "pool stopped" in message
    assert "_raise_on_rank_1" in failure.outcomes[0].output  # faulthandler's stack of the blocked rank
    assert pool.pids == []
    assert [o.value for o in pool.run(_job("_pid", 3))] != before  # a new pool serves the next job


def test_hanging_rank_fails_at_the_deadline_and_the_pool_recovers():
    pool = get_pool(2)
    failure, seconds = _run_failing(pool, "_hang_on_rank_0", timeout=3.0)
    assert 3.0 <= seconds < 3.0 + 6.0
    assert [o.status for o in failure.outcomes] == ["unfinished", "unfinished"]
    assert "rank 0 and rank 1 did not finish within the 3 s deadline" in str(failure)
    assert "time.sleep" in failure.outcomes[0].output or "_hang_on_rank_0" in failure.outcomes[0].output
    outcomes = pool.run(_job("_pid", 2))
    assert [o.value for o in outcomes] == pool.pids


def test_worker_that_exits_is_reported_with_its_exit_code():
    pool = get_pool(2)
    failure, seconds = _run_failing(pool, "_exit_on_rank_1")
    assert seconds < 2.0 + 6.0
    assert failure.outcomes[1].status == "died"
    assert "rank 1 died before replying: exit code 3" in str(failure)
    assert failure.outcomes[0].status in ("raised", "unfinished")  # gloo may or may not notice the peer left


def test_worker_that_segfaults_is_reported_with_its_signal_and_stack():
    pool = get_pool(2)
    failure, _ = _run_failing(pool, "_segfault_on_rank_0")
    assert "rank 0 died before replying: killed by signal SIGSEGV" in str(failure)
    assert "_segfault_on_rank_0" in failure.outcomes[0].output  # faulthandler wrote the stack before dying


def test_bare_asserts_are_rewritten_as_in_pytest():
    failure, _ = _run_failing(get_pool(2), "_bare_assert")
    assert "assert 2 == 99" in str(failure)


def test_skip_in_a_body_is_not_a_failure():
    outcomes = get_pool(2).run(_job("_skip", 2))
    assert [(o.status, o.detail) for o in outcomes] == [("skipped", "not on this layout")] * 2
