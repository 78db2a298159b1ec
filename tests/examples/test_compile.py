"""``--compile``: the examples' model compiled (whole, or regionally around ring attention) trains like eager.

``--compile aot_eager`` traces exactly what ``--compile`` (Inductor) traces,
the library's rules included, without generating code: an Inductor compile
takes minutes on this 2-core machine (benchmarks/compiled.py measures it).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import pointcloud_transformer
import unet_darcy

from physicsnemo_dp.debug import compile_counts

from ._run import argv, context, on_layout

# as in test_pointcloud_transformer / test_unet_darcy: uneven shards over 2 domain ranks
TRANSFORMER = {
    "--points": 70,
    "--samples": 8,
    "--test-samples": 2,
    "--width": 16,
    "--heads": 2,
    "--depth": 1,
    "--batch-size": 4,
    "--steps": 2,
    "--checkpoint-every": 100,
    "--quiet": None,
}
UNET = {
    "--grid": 20,
    "--samples": 8,
    "--test-samples": 2,
    "--width": 4,
    "--depth": 1,
    "--batch-size": 4,
    "--steps": 2,
    "--checkpoint-every": 100,
    "--quiet": None,
}
EXAMPLES = {"transformer": (pointcloud_transformer, TRANSFORMER), "unet": (unet_darcy, UNET)}


def _run(ctx, example: str, out: Path, compile_: bool) -> dict:
    module, options = EXAMPLES[example]
    flags = {**options, **({"--compile": "aot_eager"} if compile_ else {})}
    torch.compiler.reset()
    before = compile_counts()
    try:
        result = module.run(argv(flags, out), context(ctx, "ddp"))
        breaks = compile_counts()["graph_breaks"] - before["graph_breaks"]
    finally:
        torch.compiler.reset()
    model = result["model"]
    model = getattr(model, "module", model)
    compiled = sorted(
        f"{name or '<model>'}.{attr}"
        for name, m in model.named_modules()
        for attr in ("forward", "before", "after", "embed_points", "predict")
        if attr in vars(m)
    )
    return {"losses": result["losses"], "test_loss": result["test_loss"], "compiled": compiled, "breaks": breaks}


def train(ctx, example: str, out: str) -> dict:
    """Rank body: the example's run eager, then with ``--compile aot_eager``; losses and what was compiled."""
    return {kind: _run(ctx, example, Path(out) / kind, kind == "compiled") for kind in ("eager", "compiled")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", ["transformer", pytest.param("unet", marks=pytest.mark.slow)])  # unet: ~30 s more
def test_compiled_run_has_the_eager_losses(tmp_path, example):
    """On (1, 2): the same losses with and without --compile; the transformer compiles around its attention."""
    runs = on_layout(__name__, "train", (1, 2), example=example, out=str(tmp_path))
    eager, compiled = runs["eager"], runs["compiled"]
    assert eager["compiled"] == []
    losses = compiled["losses"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
    assert losses == pytest.approx(eager["losses"], rel=1e-4, abs=1e-6)
    assert compiled["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-4)
    assert compiled["breaks"] == 0  # the compiled parts hold no graph break (ring attention runs between them)
    if example == "unet":
        assert compiled["compiled"] == ["<model>.forward"]
    else:  # regional: the parts around the attention, whose kernel (ring attention) runs eagerly between them
        assert compiled["compiled"] == ["<model>.embed_points", "<model>.predict", "blocks.0.after", "blocks.0.before"]


def test_compile_flag():
    assert unet_darcy.parse_args([]).compile is None
    assert unet_darcy.parse_args(["--compile"]).compile == "inductor"
    assert unet_darcy.parse_args(["--compile", "aot_eager"]).compile == "aot_eager"
    with pytest.raises(SystemExit):
        unet_darcy.parse_args(["--compile", "tvm"])
