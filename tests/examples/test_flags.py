"""Bad flags are refused while parsing (or, for the mesh's shape, right after joining), the same on every rank.

Before, ``--checkpoint-every 0`` trained a step and died with ZeroDivisionError;
``--grid 1``, ``--seed -1`` and ``--out <a file>`` failed on rank 0 while the
others reported gloo's "Connection closed by peer"; ``--test-samples 1`` on
two ddp ranks crashed after the data was generated.
"""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import _common
import _flags
import diffusion_darcy
import fno_darcy
import meshgraphnet_heat
import pointcloud_transformer
import train_ddp_domain
import unet_darcy

from ._run import argv, context, on_layout

TRAINING = [unet_darcy, diffusion_darcy, fno_darcy, meshgraphnet_heat, pointcloud_transformer]
COMMON = [("--checkpoint-every", "0"), ("--steps", "0"), ("--batch-size", "0"), ("--lr", "0"), ("--lr", "nan"),
          ("--seed", "-1"), ("--seed", "4294967296"), ("--prefetch", "-1"), ("--max-skips", "-1"),
          ("--domain-size", "0"), ("--ddp-size", "-2"), ("--steps", "ten")]
OWN = {
    unet_darcy: [("--grid", "1"), ("--samples", "0"), ("--test-samples", "0"), ("--width", "6"), ("--depth", "-1"),
                 ("--grid", "4", "--depth", "3")],
    diffusion_darcy: [("--grid", "2"), ("--sample-steps", "0"), ("--churn", "-1"), ("--churn", "inf"),
                      ("--width", "2")],
    fno_darcy: [("--grid", "0"), ("--width", "0"), ("--modes", "0"), ("--layers", "0"), ("--test-samples", "-3")],
    meshgraphnet_heat: [("--around", "2"), ("--rings", "0"), ("--samples", "0"), ("--test-samples", "0"),
                        ("--width", "0"), ("--layers", "0")],
    pointcloud_transformer: [("--points", "0"), ("--noise", "-0.1"), ("--samples", "0"), ("--test-samples", "0"),
                             ("--width", "0"), ("--heads", "0"), ("--heads", "5"), ("--depth", "0")],
    train_ddp_domain: [("--domain-size", "0"), ("--steps", "0"), ("--batch", "0"), ("--tokens", "0"),
                       ("--features", "0"), ("--hidden", "0"), ("--depth", "0"), ("--lr", "-1")],
}
CASES = [pytest.param(m, flags, id=f"{m.__name__}{''.join(flags)}") for m in TRAINING for flags in COMMON]
CASES += [pytest.param(m, flags, id=f"{m.__name__}{''.join(flags)}") for m, cases in OWN.items() for flags in cases]


def _refusal(parse_args, flags) -> str:
    """The error line argparse prints for ``flags`` (it must exit with status 2 while parsing)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        parse_args(list(flags))
    assert exit_.value.code == 2, err.getvalue()
    return err.getvalue().strip().splitlines()[-1]


@pytest.mark.parametrize("module, flags", CASES)
def test_bad_values_are_refused_while_parsing(module, flags):
    line = _refusal(module.parse_args, flags)
    flag = flags[0]
    assert f"error: argument {flag}: " in line, line


def test_an_output_folder_that_cannot_be_made_is_refused_while_parsing(tmp_path):
    (tmp_path / "file").write_text("x")
    for module in TRAINING:
        assert _refusal(module.parse_args, ["--out", str(tmp_path / "file")]).endswith(
            f"argument --out: {tmp_path / 'file'} is a file, not a folder; pass a folder (created if missing)")
        assert _refusal(module.parse_args, ["--out", str(tmp_path / "file" / "run")]).endswith(
            f"argument --out: {tmp_path / 'file' / 'run'} cannot be created: {tmp_path / 'file'} is a file, "
            "not a folder")
        assert module.parse_args(["--out", str(tmp_path / "new" / "run")]).out == tmp_path / "new" / "run"


def test_good_values_still_parse():
    args = unet_darcy.parse_args(["--seed", "4294967295", "--prefetch", "0", "--max-skips", "0", "--lr", "1e-4",
                                  "--grid", "3", "--depth", "1", "--width", "4"])
    assert (args.seed, args.prefetch, args.max_skips, args.lr, args.grid) == (2**32 - 1, 0, 0, 1e-4, 3)
    assert diffusion_darcy.parse_args(["--churn", "0"]).churn == 0.0
    assert pointcloud_transformer.parse_args(["--width", "30", "--heads", "3"]).heads == 3


def test_flags_that_do_not_fit_the_mesh_are_refused_before_any_data_is_made():
    mesh = SimpleNamespace(ddp_size=2, domain_size=4)
    args = SimpleNamespace(batch_size=4, samples=4, test_samples=2, grid=4)
    _flags.check_layout(args, mesh)  # fits
    with pytest.raises(SystemExit) as exit_:
        _flags.check_layout(SimpleNamespace(batch_size=3, samples=2, test_samples=1, points=3), mesh)
    assert str(exit_.value.code) == (
        "invalid flags for the mesh (ddp=2, domain=4):\n"
        "  --batch-size 3 must be a multiple of the ddp size 2\n"
        "  --samples 2 is less than one global batch (--batch-size 3): pass --samples >= 3\n"
        "  --test-samples 1: each of the 2 ddp ranks evaluates at least one test sample; pass --test-samples >= 2\n"
        "  --points 3 cannot be split over the 4 domain ranks; pass --points >= 4 or a smaller --domain-size")


# --------------------------------------------------------------------------- #
# On every rank alike, through the examples' runs on harness ranks
# --------------------------------------------------------------------------- #
TINY = {"--grid": 12, "--samples": 4, "--test-samples": 2, "--width": 4, "--batch-size": 2, "--steps": 2,
        "--quiet": None}
REFUSED = {
    "checkpoint-every": (unet_darcy, {**TINY, "--checkpoint-every": 0},
                         "argument --checkpoint-every: must be an integer >= 1, got 0"),
    "grid": (unet_darcy, {**TINY, "--grid": 1}, "argument --grid: must be an integer >= 3, got 1"),
    "seed": (unet_darcy, {**TINY, "--seed": -1}, "argument --seed: must be an integer in [0, 4294967295], got -1"),
    "test-samples": (meshgraphnet_heat, {"--around": 8, "--rings": 2, "--samples": 2, "--test-samples": 1,
                                         "--quiet": None},
                     "--test-samples 1: each of the 2 ddp ranks evaluates at least one test sample"),
    "pointcloud test-samples": (pointcloud_transformer, {"--points": 16, "--samples": 2, "--test-samples": 1,
                                                        "--batch-size": 2, "--quiet": None},
                                "--test-samples 1: each of the 2 ddp ranks evaluates at least one test sample"),
}


def refused_on_every_rank(ctx, out: str, case: str) -> list[str]:
    """Rank body: the example's run with bad flags; every rank's message (exit status and text)."""
    module, options, _ = REFUSED[case]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        module.run(argv(options, out), context(ctx, "ddp"))
    code = exit_.value.code
    mine = f"{code}: {err.getvalue().strip().splitlines()[-1]}" if isinstance(code, int) else f"1: {code}"
    messages: list = [None] * ctx.world_size
    dist.all_gather_object(messages, mine)
    return messages


def output_refused_on_every_rank(ctx, out: str) -> list[str]:
    """Rank body: ``--out`` that rank 0 cannot create (a file), past the parser: every rank gets rank 0's verdict."""
    with pytest.raises(SystemExit) as exit_:
        _common.prepare_output(SimpleNamespace(out=out, resume=None))
    messages: list = [None] * ctx.world_size
    dist.all_gather_object(messages, str(exit_.value.code))
    return messages


@pytest.mark.timeout(300)
def test_bad_flags_stop_every_rank_with_the_same_message(tmp_path):
    for case, (_, _, expected) in REFUSED.items():
        out = tmp_path / case.replace(" ", "-")
        messages = on_layout(__name__, "refused_on_every_rank", (2, 2), out=out, case=case)
        assert len(set(messages)) == 1 and expected in messages[0], (case, messages)
        assert not out.exists(), case  # refused before anything was made
    (tmp_path / "file").write_text("x")
    messages = on_layout(__name__, "output_refused_on_every_rank", (2, 2), out=str(tmp_path / "file"))
    assert len(set(messages)) == 1, messages
    assert f"--out {tmp_path / 'file'}: cannot write there" in messages[0] and "rank(s) 0 failed" in messages[0]
