"""Multi-rank tests written as plain functions.

    from tests._harness import distributed

    @distributed                      # world sizes 1, 3, 4 and the 2x2 ("ddp", "domain") mesh
    def test_sum(ctx):
        t = torch.ones(1, device=ctx.device)
        dist.all_reduce(t)
        assert t.item() == ctx.world_size

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @distributed(world_sizes=(2, 3), mesh_2d=False, timeout=120)
    def test_dtype(ctx, dtype): ...

The decorator turns the body into an ordinary pytest test parametrized over
layouts (ids ``ws1`` … ``ws4``, ``mesh2x2``). By default: 1, 3 and 4 ranks and
the 2x2 mesh. Two ranks on one mesh dim are what the 2x2 mesh's ``"domain"``
dim holds, so a separate ``ws2`` run repeated them at 2/14 of the suite's
rank-time; tests whose claim names P = 2 ask for ``EVERY_WORLD_SIZE``. The test runs in the pytest
process and ships ``(module, name, params)`` to every rank of the persistent
pool of that world size (see ``pool.py``); each rank imports the module and
calls the body with a :class:`Context` (see ``worker.py``). Arguments after
``ctx`` are resolved by pytest in the test process (parametrize or fixtures)
and must pickle. Bodies must be module-level functions.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from .pool import DEFAULT_TIMEOUT, RankFailure, STARTUP_TIMEOUT, close_all, get_pool
from .worker import Context, Job

__all__ = ["Context", "EVERY_WORLD_SIZE", "RankFailure", "close_all", "distributed", "get_pool", "run_job"]

#: Every 1-D world size the suite tests; ``@distributed``'s default leaves out 2 (see above).
EVERY_WORLD_SIZE = (1, 2, 3, 4)


def run_job(world_size, mesh_shape, module, name, params, *, timeout=DEFAULT_TIMEOUT):
    """Run ``module.name(ctx, **params)`` on every rank of the ``world_size`` pool; return the outcomes.

    For tests that decide *in the test process* what to run, one job at a time
    (property tests: Hypothesis draws a case, the ranks run it). A failure raises
    ``AssertionError`` with the harness's report (not ``pytest.fail``: callers
    such as Hypothesis must see an ordinary exception to shrink it).
    """
    pool = get_pool(world_size)
    if pool.backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"nccl needs {world_size} GPUs, found {torch.cuda.device_count()}")
    try:
        return pool.run(Job(module, name, params, tuple(mesh_shape)), timeout=timeout)
    except RankFailure as failure:
        report = str(failure)
    raise AssertionError(report)  # outside the except block: the report is the whole message

#: pytest fixtures whose effect lives in the test process: useless or harmful in a rank.
_PROCESS_LOCAL_FIXTURES = frozenset({"monkeypatch", "capsys", "capfd", "capsysbinary", "capfdbinary", "caplog", "recwarn"})


def distributed(body=None, *, world_sizes=(1, 3, 4), mesh_2d=True, timeout=DEFAULT_TIMEOUT):
    """Make ``body(ctx, ...)`` a pytest test that runs on every rank of each layout.

    ``timeout`` bounds one layout's run on all ranks, in seconds; a failing
    rank's peers get a few seconds' grace before the pool is stopped.
    """
    if body is None:
        return lambda fn: distributed(fn, world_sizes=world_sizes, mesh_2d=mesh_2d, timeout=timeout)
    if body.__qualname__ != body.__name__:
        raise TypeError(f"@distributed needs a module-level function, got {body.__qualname__}: "
                        f"ranks find the body by its module and name")
    layouts = [pytest.param((n, (n,)), id=f"ws{n}") for n in world_sizes]  # (world size, mesh shape)
    if mesh_2d:
        layouts.append(pytest.param((4, (2, 2)), id="mesh2x2"))

    def test(_pdp_layout, **params):
        world_size, mesh_shape = _pdp_layout
        pool = get_pool(world_size)
        if pool.backend == "nccl" and torch.cuda.device_count() < world_size:
            pytest.skip(f"nccl needs {world_size} GPUs, found {torch.cuda.device_count()}")
        try:
            outcomes = pool.run(Job(body.__module__, body.__name__, params, mesh_shape), timeout=timeout)
        except RankFailure as failure:
            report = str(failure)
        else:
            report = None
        if report:  # failed outside the except block: the report is the whole message, not chained
            pytest.fail(report, pytrace=False)
        skipped = [outcome for outcome in outcomes if outcome.status == "skipped"]
        if skipped:
            pytest.skip(f"rank {skipped[0].rank}: {skipped[0].detail}")

    extra = list(inspect.signature(body).parameters.values())[1:]  # after ctx: pytest supplies them
    local = sorted({p.name for p in extra} & _PROCESS_LOCAL_FIXTURES)
    if local:
        raise TypeError(
            f"{body.__name__} asks for {local}: a distributed body runs in the pooled rank processes, where "
            "these fixtures would act on a pickled copy (a monkeypatch is never undone there and leaks into "
            "later jobs; captured output stays empty). Patch inside the body with try/finally instead."
        )
    layout = inspect.Parameter("_pdp_layout", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    test.__signature__ = inspect.Signature([layout, *extra])
    test.__name__ = test.__qualname__ = body.__name__
    test.__module__ = body.__module__
    test.__doc__ = body.__doc__
    test.__wrapped__ = body  # pytest reports the body's file and line
    test.__distributed_body__ = body  # what the ranks run
    test = pytest.mark.parametrize("_pdp_layout", layouts)(test)
    # pytest-timeout only as a backstop behind the harness's own deadline.
    return pytest.mark.timeout(STARTUP_TIMEOUT + timeout + 60)(test)
