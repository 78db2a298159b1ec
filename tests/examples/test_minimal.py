"""``examples/minimal``: each example's function on 4 ranks, and both ways of starting them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests._harness import distributed

from . import EXAMPLES

ROOT = EXAMPLES.parent
NAMES = ("vector_add", "dot_product", "conv")


def _example(name: str):
    """Load ``examples/minimal/<name>.py`` under a name of its own (``conv`` is a common module name)."""
    key = f"minimal_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / "minimal" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]


@distributed(world_sizes=(1, 3, 4), mesh_2d=False, timeout=120)
def test_each_example_on_ranks(ctx):
    assert _example("vector_add").main(ctx.mesh) == [11.0 * i for i in range(ctx.world_size * (ctx.world_size + 1) // 2)]
    _example("dot_product").main(ctx.mesh)  # checks itself against u @ v
    assert _example("conv").main(ctx.mesh)[0] == (1, 8, 30, 20)  # checks output and weight gradient itself


def _run(*command):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(500)
def test_plain_python_starts_four_ranks():
    result = _run(sys.executable, str(EXAMPLES / "minimal" / "vector_add.py"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "a + b = [0.0, 11.0, 22.0" in result.stdout and "[rank 3] rank 3: local" in result.stdout


@pytest.mark.slow  # torchrun itself: tests/distributed/test_example.py and test_training_safety.py; pytest -m slow
@pytest.mark.timeout(500)
def test_under_torchrun():
    result = _run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                  str(EXAMPLES / "minimal" / "conv.py"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("output shape, |weight grad| = ((1, 8, 30, 20)") == 1  # printed by rank 0 only
