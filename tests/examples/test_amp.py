"""``--amp``: the examples' training step under ``torch.autocast`` (bf16, fp16 with a GradScaler) on a (2, 2) mesh."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import _common
import fno_darcy
import unet_darcy

from ._run import argv, context, on_layout

# as in test_unet_darcy / test_fno_darcy: uneven shards, a few seconds per run
UNET = {"--grid": 20, "--samples": 16, "--test-samples": 2, "--width": 8, "--batch-size": 4,
        "--checkpoint-every": 100, "--quiet": None}
FNO = {"--grid": 18, "--samples": 12, "--test-samples": 2, "--width": 12, "--modes": 4, "--layers": 2,
       "--batch-size": 4, "--lr": 2e-2, "--model": "plain", "--quiet": None}
EXAMPLES = {"unet": unet_darcy, "fno": fno_darcy}


def train(ctx, example: str, out: str, options: dict, strategy: str) -> dict:
    """Rank body: the example's run; its losses, test loss, log, and the dtypes the weights ended in."""
    result = EXAMPLES[example].run(argv({**options, "--strategy": strategy}, out), context(ctx, strategy))
    dtypes = sorted({str(p.dtype) for p in result["model"].parameters()})
    return {"losses": result["losses"], "test_loss": result["test_loss"], "dtypes": dtypes,
            "log": (Path(out) / "train.log").read_text()}


@pytest.mark.timeout(600)
def test_bf16_trains_like_float32_one_process(tmp_path):
    """U-Net, --amp bf16 on (2, 2) with DDP: learns, stays finite, and follows one float32 process within bf16."""
    options = {**UNET, "--steps": 5}
    fp32 = on_layout(__name__, "train", (1, 1), example="unet", out=tmp_path / "fp32", options=options,
                     strategy="ddp")
    bf16 = on_layout(__name__, "train", (2, 2), example="unet", out=tmp_path / "bf16",
                     options={**options, "--amp": "bf16"}, strategy="ddp")
    losses = bf16["losses"]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-2:]) < 0.7 * sum(losses[:2]), losses  # it learns
    assert "--amp bf16 (autocast on cpu)" in bf16["log"]
    assert bf16["dtypes"] == ["torch.float32"]  # autocast computes in bf16; the weights stay float32
    # bf16 has 8 bits of mantissa: 2**-8 relative, compounded over 5 steps
    assert losses == pytest.approx(fp32["losses"], rel=3e-2, abs=1e-3)
    assert losses != fp32["losses"]  # the autocast was on: bf16 rounding shows in the losses
    assert bf16["test_loss"] == pytest.approx(fp32["test_loss"], rel=5e-2)


@pytest.mark.timeout(600)
def test_fp16_with_grad_scaler_under_fsdp2_and_resume(tmp_path):
    """U-Net, --amp fp16 on (2, 2) with FSDP2: the GradScaler steps (finite, learning); its state resumes; a resumed
    run may change --amp."""
    out = tmp_path / "fp16"
    first = on_layout(__name__, "train", (2, 2), example="unet", out=out,
                      options={**UNET, "--amp": "fp16", "--steps": 3, "--checkpoint-every": 3}, strategy="fsdp2")
    losses = first["losses"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert first["dtypes"] == ["torch.float32"]
    # one more step, resumed: the checkpoint holds the scaler's state, which the resumed run loads
    again = on_layout(__name__, "train", (2, 2), example="unet", out=out,
                      options={**UNET, "--amp": "fp16", "--steps": 4, "--resume": None}, strategy="fsdp2")
    assert again["losses"][:3] == losses and math.isfinite(again["losses"][3])
    assert "--amp fp16: the loss scale 65536 of the checkpoint was restored" in again["log"]
    # --amp may change on resume: applied and logged (the weights are float32 either way)
    other = on_layout(__name__, "train", (2, 2), example="unet", out=out,
                      options={**UNET, "--amp": "bf16", "--steps": 5, "--resume": None}, strategy="fsdp2")
    assert other["losses"][:4] == again["losses"] and math.isfinite(other["losses"][4])
    assert "--amp changed fp16 → bf16 on resume" in other["log"]


def overflowing(ctx, out: str, strategy: str) -> dict:
    """Rank body: the U-Net in fp16 with a loss scale of 2**40, so every step's float16 gradients overflow."""
    make = _common._grad_scaler
    _common._grad_scaler = lambda args, context, model: torch.amp.GradScaler(context.device.type, init_scale=2.0**40)
    try:
        options = {**UNET, "--amp": "fp16", "--steps": 3}
        result = unet_darcy.run(argv({**options, "--strategy": strategy}, out), context(ctx, strategy))
    finally:
        _common._grad_scaler = make
    args = unet_darcy.parse_args(argv(options, out))

    def make_model():
        return unet_darcy.UNet(width=args.width, depth=args.depth)

    torch.manual_seed(args.seed)  # the initial weights, as build_training makes them
    start = make_model().state_dict()
    end = _common.plain_replica(result["model"], make_model).state_dict()  # FSDP2's shards gathered
    return {"losses": result["losses"], "log": (Path(out) / "train.log").read_text(),
            "unchanged": all(torch.equal(end[k], v) for k, v in start.items())}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.timeout(600)
def test_fp16_overflow_skips_the_step_on_every_rank(tmp_path, strategy):
    """Overflowing fp16 gradients on (2, 2): every rank skips every step, logs it, the scale backs off. Under
    FSDP2 each ddp rank holds a shard of the gradients: DTensor all-reduces the scaler's inf flag."""
    result = on_layout(__name__, "overflowing", (2, 2), out=str(tmp_path), strategy=strategy)
    assert result["unchanged"]  # no optimizer step was taken (the full weights; a step on any rank would show)
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"])  # the loss is finite
    for step, scale in ((1, 2.0**40), (2, 2.0**39), (3, 2.0**38)):
        assert (f"step {step}: --amp fp16 gradients overflowed at loss scale {scale:g}; the optimizer step was "
                f"skipped, the scale is now {scale / 2:g}") in result["log"]


def refused_then_float32(ctx, out: str) -> dict:
    """Rank body: fno_darcy with --amp fp16 (the message every rank stops with), then the same run in float32."""
    with pytest.raises(SystemExit) as stop:
        fno_darcy.run(argv({**FNO, "--amp": "fp16", "--steps": 1}, Path(out) / "fp16"), context(ctx, "ddp"))
    return {"refusal": str(stop.value), **train(ctx, "fno", str(Path(out) / "fp32"), {**FNO, "--steps": 4}, "ddp")}


@pytest.mark.timeout(600)
def test_fno_bf16_under_fsdp2_and_fp16_refused(tmp_path):
    """The FNO (FFTs, complex spectral weights): bf16 on (2, 2) with FSDP2 follows one float32 process; fp16 is
    refused by name, since torch's GradScaler cannot unscale complex gradients."""
    fp32 = on_layout(__name__, "refused_then_float32", (1, 1), out=str(tmp_path))
    assert "--amp fp16: the model has complex parameters" in fp32["refusal"] and "use --amp bf16" in fp32["refusal"]
    bf16 = on_layout(__name__, "train", (2, 2), example="fno", out=tmp_path / "bf16",
                     options={**FNO, "--steps": 4, "--amp": "bf16"}, strategy="fsdp2")
    assert all(math.isfinite(v) for v in bf16["losses"]) and bf16["losses"][-1] < bf16["losses"][0], bf16["losses"]
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=3e-2, abs=1e-3)
    assert bf16["losses"] != fp32["losses"]
    assert bf16["dtypes"] == fp32["dtypes"] == ["torch.complex64", "torch.float32"]


def test_amp_flag():
    assert unet_darcy.parse_args([]).amp == "off"
    assert fno_darcy.parse_args(["--amp", "bf16"]).amp == "bf16"
    with pytest.raises(SystemExit):
        unet_darcy.parse_args(["--amp", "fp8"])
    assert _common.AMP_DTYPES == {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert "amp" in _common.MAY_CHANGE_ON_RESUME
