"""Run the examples' importable functions on harness ranks, on any (ddp, domain) layout.

``on_layout`` ships a module-level body to the pool of the layout's world size
with the layout as the job's mesh shape (the worker builds a
``("ddp", "domain")`` mesh of that shape) and returns rank 0's value.
"""

from __future__ import annotations

import math

import pytest

from physicsnemo_dp.distributed import MeshContext
from tests._harness import RankFailure, get_pool
from tests._harness.worker import Job


def on_layout(module: str, body: str, layout: tuple[int, int], *, timeout: float = 300, **params):
    """``module.body(ctx, **params)`` on ``layout[0] * layout[1]`` ranks; rank 0's return value."""
    try:
        outcomes = get_pool(math.prod(layout)).run(Job(module, body, params, tuple(layout)), timeout=timeout)
    except RankFailure as failure:
        report = str(failure)
    else:
        return outcomes[0].value
    pytest.fail(report, pytrace=False)


def context(ctx, strategy: str) -> MeshContext:
    """The example's MeshContext on the job's ("ddp", "domain") mesh."""
    return MeshContext.from_mesh(ctx.mesh, strategy=None if strategy == "none" else strategy)


def argv(options: dict, out) -> list[str]:
    """Command-line flags from ``{"--flag": value}`` (``None``: a switch), plus ``--out``."""
    flags = [str(x) for k, v in options.items() for x in ((k,) if v is None else (k, v))]
    return [*flags, "--out", str(out)]


def summary(result: dict, *extra: str) -> dict:
    """What a training body sends back: losses, test loss, the figures' paths, and ``extra`` keys."""
    out = {"losses": result["losses"], "files": {name: str(path) for name, path in result["files"].items()}}
    out.update({key: result[key] for key in ("test_loss", *extra) if key in result})
    return out


def help_text(parse_args, capsys) -> str:
    """The example's ``--help`` output; ``--help`` must exit with status 0."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out
