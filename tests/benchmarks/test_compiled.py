"""The ``compiled`` benchmark suite at tiny sizes (``--tiny`` leaves it out: it compiles on every rank).

Timing ratios are noise at these sizes; the counts are exact: a step of the
regionally compiled transformer block (ring attention between its compiled
parts) breaks no graph and compiles nothing after its warm-up steps. (The
U-Net, whole-model compiled, takes another minute of tracing here; the compile
matrix of tests/compile and tests/examples/test_compile.py compile it.)
"""

import math

import pytest
import torch

from benchmarks import compiled
from tests._harness import distributed


@pytest.mark.slow  # ~35 s: tests/examples/test_compile.py compiles the same regions (losses, no graph break)
@distributed(world_sizes=(2,), mesh_2d=False, timeout=600)
def test_compiled_steps_break_no_graph_and_do_not_recompile(ctx):
    torch.set_num_threads(1)
    results = compiled.run(ctx.mesh, **{**compiled.sizes(True, 1.0), "models": ("transformer block",)})
    cases = {r.case: r for r in results}
    for model in ("transformer block, regional [aot_eager]",):
        assert cases[f"{model}: graph breaks in a compiled ShardTensor step"].value == 0, model
        assert cases[f"{model}: graphs compiled per step after warm-up (recompilations)"].value == 0, model
        ratio = cases[f"{model}, CPU: compiled step / eager step, all ranks"]
        assert ratio.target == ("<=", 1.0) and math.isfinite(ratio.ratio) and ratio.ratio > 0
    assert all(r.suite == "compiled" and r.world_size == 2 for r in results)


@distributed(world_sizes=(1,), mesh_2d=False, timeout=300)
def test_one_rank_reports_the_transformer_next_to_a_subclass_that_does_nothing(ctx):
    torch.set_num_threads(1)
    results = compiled.run(ctx.mesh, **{**compiled.sizes(True, 1.0), "models": ("transformer block",)})
    cases = {r.case: r for r in results}
    title = "transformer block, regional [aot_eager]"
    ours = cases[f"{title}: compiled ShardTensor step / compiled plain step"]
    floor = cases[f"{title}: compiled step of a subclass that does nothing / compiled plain step (torch's floor)"]
    assert ours.target == ("<=", 1.05) and floor.target is None
    assert all(math.isfinite(r.ratio) and r.ratio > 0 for r in (ours, floor))
    assert cases[f"{title}: graph breaks in a compiled ShardTensor step"].value == 0


def test_tiny_run_leaves_compiled_out_and_full_run_has_it():
    from benchmarks import run

    assert "compiled" in run.SUITES and "compiled" in run.NOT_TINY
