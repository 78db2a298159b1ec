"""The ``python -m physicsnemo_dp.debug simulate`` command line: its errors, counts, warm-up and plot."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from physicsnemo_dp.debug import __main__ as cli


def tiny():
    """Three convolutions: three layer calls whose gradients are promoted over the domain."""
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1),
                               torch.nn.Conv2d(4, 1, 3, padding=1))  # fmt: skip


@pytest.mark.parametrize(
    "target", ["examples/unet_darcy.py:UNet", "examples/unet_darcy.py", "examples\\unet_darcy.py:UNet"]
)
def test_a_file_path_is_refused_naming_the_expected_form(target):
    with pytest.raises(SystemExit) as error:
        cli.main(["simulate", target, "--input-shape", "1", "1", "8", "8"])
    message = str(error.value)
    assert "module:attribute" in message and "not a file path" in message and repr(target) in message
    assert "examples.unet_darcy:" in message  # the form to use instead


@pytest.mark.parametrize(
    "target", ["examples.unet_darcy", "no_such_package_xyz.models:Net", "tests.debug.test_simulate_cli:NoSuch"]
)
def test_bad_targets_are_named(target):
    with pytest.raises(SystemExit) as error:
        cli.main(["simulate", target, "--input-shape", "1", "1", "8", "8"])
    assert target.partition(":")[0] in str(error.value)


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    text = capsys.readouterr().out
    assert "module:attribute" in text and "--per-layer" in text
    for markup in ("``", ":func:", ":class:"):
        assert markup not in text


def test_counts_are_those_of_parallelize_model_unless_per_layer(capsys):
    """Buckets (the default) reduce the three layers' gradients in one all-reduce; --per-layer in three; same bytes."""
    counts = {}
    for extra in ([], ["--per-layer"]):
        cli.main(["simulate", f"{__name__}:tiny", "--input-shape", "1", "1", "12", "12", "--world-sizes", "2", *extra])
        row = capsys.readouterr().out.strip().splitlines()[-1]
        counts[bool(extra)] = row.split("all_reduce ")[1].split(",")[0].split(")")[0]
    bytes_bucketed, calls_bucketed = counts[False].split(" in ")
    bytes_per_layer, calls_per_layer = counts[True].split(" in ")
    assert bytes_bucketed == bytes_per_layer
    assert int(calls_bucketed) < int(calls_per_layer)


def test_the_first_world_size_is_warmed_up_first(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "simulate", lambda setup, p, rank: seen.append(p) or SimpleNamespace(world_size=p))
    sims = cli.sweep(lambda mesh: None, [4, 8], echo=False)
    assert seen == [4, 4, 8] and [s.world_size for s in sims] == [4, 8]


def test_the_plot_does_not_draw_zero_bytes(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)

    def sim(p, sent):
        return SimpleNamespace(world_size=p, bytes_sent=sent, peak_bytes=1000 // p,
                               collectives={"all_reduce": {"calls": 1, "sent": sent}})  # fmt: skip

    cli.plot([sim(1, 0), sim(2, 100), sim(4, 150)], "title", tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    comm = figures[0].axes[0]
    for line in comm.get_lines():
        assert 1 not in list(line.get_ydata()) and 0 not in list(line.get_ydata())
        assert list(line.get_xdata()) == [2, 4]
    labels = [t.get_text() for t in comm.get_legend().get_texts()]
    assert all("0 B at P = 1: not drawn" in label for label in labels), labels
