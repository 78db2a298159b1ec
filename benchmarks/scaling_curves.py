"""Parallel efficiency against the local problem size: the curve that says from which size on domain parallelism pays.

For every model and every local size ``n`` (the extent of the sharded dim
each rank holds), one forward + backward step runs on ``P`` ranks holding
``n`` each (global extent ``n * P``) and, as the baseline, on one device
holding the whole global input, interleaved in the same process (median of
repetitions of ``rounds`` runs, see :mod:`._timing`). The figure is the strong-scaling parallel
efficiency at that global size:

    efficiency = single-device work / (P x per-rank work)
               = single-device work / work of all ranks

(``value`` = single-device seconds, ``baseline`` = seconds of all ranks,
``ratio`` = efficiency; 1.0 is ideal). Work is CPU time on CPU meshes (every
thread of every rank: with more ranks than cores, or other jobs on the
machine, the wall clock mostly measures waiting for a core) and wall time of
the slowest rank times ``P`` on GPUs, where it is the speed-up that counts.
At ``P = 1`` the ratio is plain torch over ShardTensor on one rank.

Models: the conv net (three 3x3 convolutions, sharded along its rows; the
columns stay whole), the transformer block (``nn.TransformerEncoderLayer``,
sharded along the sequence: ring attention), the FNO of
``examples/spectral_models.py`` (4 Fourier layers, sharded along its rows:
every FFT transposes), and the MeshGraphNet of ``examples/graph_models.py``
on the plate-with-hole mesh of :mod:`.graph` (nodes in Hilbert order split
in contiguous ranges, graph built as training builds it; every processor
layer fetches its ghost nodes' latents). Every model's promoted weights have
their gradients summed in buckets (:func:`physicsnemo_dp.bucket_gradients`),
as ``parallelize_model`` sets them up by default: the curves show the
recommended setup. ``run.py`` draws one PNG per model, efficiency against
the local size with one line per ``P``, and marks where each line crosses
0.9. There is no target: the curve is what a user reads to choose.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from physicsnemo_dp import bucket_gradients
from physicsnemo_dp.promotion import clear_gradient_buckets

from . import _models, graph
from ._record import Result, over_ranks
from ._timing import fastest_by

SUITE = "scaling_curves"
#: Efficiency above which domain parallelism is considered to pay (marked on the plots).
GOOD = 0.9


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(conv_rows=(4, 8, 16), conv_cols=8, width=4, tokens=(8, 16, 32), dim=16, fno_rows=(8, 16, 32),
                    fno_cols=16, graph_nodes=(32, 64, 128), rounds=1)  # fmt: skip
    return dict(conv_rows=tuple(int(n * scale) for n in (16, 64, 256)), conv_cols=int(256 * scale), width=16,
                tokens=tuple(int(n * scale) for n in (64, 256, 1024)), dim=64,
                fno_rows=tuple(int(n * scale) for n in (16, 64, 128)), fno_cols=int(128 * scale),
                graph_nodes=tuple(_power_of_two(n * scale) for n in (256, 1024, 4096, 16384)), rounds=5)  # fmt: skip


def _power_of_two(x: float) -> int:
    return 1 << max(5, round(math.log2(x)))  # the smallest plate has 32 nodes


def _plate_shape(nodes: int) -> tuple[int, int]:
    """``(around, rings)`` of a plate with exactly ``nodes`` nodes (a power of two, at least 32), about 4x longer around.

    The plate has ``around * (rings + 1)`` nodes; both factors are powers of
    two, and ``plate_with_hole`` needs ``around >= 8`` and ``rings >= 2``.
    """
    across = 1 << max(2, int(math.log2(math.sqrt(nodes / 4))))  # rings + 1
    return nodes // across, across - 1


def _fno(width: int) -> torch.nn.Module:
    """FNO2d of ``examples/spectral_models.py`` (user code: its folder goes on ``sys.path``)."""
    folder = str(Path(__file__).resolve().parents[1] / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from spectral_models import FNO2d

    return FNO2d(width=width, modes=(12, 12), layers=4)


def _cases(conv_cols: int, width: int, dim: int, fno_cols: int) -> dict[str, tuple]:
    """name -> (build, global shape for global extent ``N``, sharded dim, what ``n`` counts)."""
    return {
        "conv net": (lambda: _models.conv_net(4, width), lambda N: (1, 4, N, conv_cols), 2,
                     f"rows per rank ({conv_cols} columns, {width} channels)"),
        "transformer block": (lambda: _models.transformer_block(dim), lambda N: (1, N, dim), 1,
                              f"tokens per rank (dim {dim}, 4 heads)"),
        "fno": (lambda: _fno(width), lambda N: (1, 1, N, fno_cols), 2,
                f"rows per rank ({fno_cols} columns, width {width})"),
    }  # fmt: skip


def _work_clock(mesh):
    """CPU time on CPU meshes; on GPUs wall time after a device sync (the kernels are asynchronous)."""
    device = _models.mesh_device(mesh)
    if device.type == "cpu":
        return time.process_time, lambda: None
    module = getattr(torch, device.type)
    return time.perf_counter, module.synchronize


def run(mesh, conv_rows, conv_cols: int, width: int, tokens, dim: int, fno_rows, fno_cols: int, graph_nodes,
        rounds: int, compare_dtensor: bool = False) -> list[Result]:  # fmt: skip
    P = mesh.size()
    device = _models.mesh_device(mesh)
    extents = {"conv net": conv_rows, "transformer block": tokens, "fno": fno_rows}
    results = []
    try:
        for name, (build, shape, dim_, unit) in _cases(conv_cols, width, dim, fno_cols).items():
            torch.manual_seed(0)
            net = build().to(device)
            bucket_gradients(net)
            for n in extents[name]:
                plain = _models.global_input(shape(n * P)).to(device)
                sharded = _models.shard(plain, mesh, dim_)
                results.append(_efficiency(mesh, f"{name}: parallel efficiency, {unit}", n, rounds,
                                           lambda x: _models.train_step(net, x), plain, sharded))  # fmt: skip
        net = graph.model(width, 4, device)
        bucket_gradients(net)
        for n in graph_nodes:
            plain, sharded, _ = graph.inputs(mesh, *_plate_shape(n * P))
            results.append(_efficiency(mesh, f"meshgraphnet: parallel efficiency, nodes per rank (width {width}, 4 layers)",
                                       n, rounds, lambda args: graph.step(net, args), plain, sharded))  # fmt: skip
    finally:
        clear_gradient_buckets()
    return results


def _efficiency(mesh, case: str, n: int, rounds: int, step, plain, sharded) -> Result:
    """One point of a curve: ``step`` on the whole input on this rank vs on every rank's shard."""
    clock, sync = _work_clock(mesh)

    def timed(x):
        step(x)
        sync()

    best = fastest_by({"plain": lambda: timed(plain), "sharded": lambda: timed(sharded)}, rounds, [clock])
    if clock is time.process_time:
        single, everyone = best["plain"][0], over_ranks(best["sharded"][0])
    else:  # the slowest rank's step, P of them
        single, everyone = best["plain"][0], mesh.size() * over_ranks(best["sharded"][0], "max")
    return Result(SUITE, case, mesh.size(), single, everyone, "s", local_size=n)


def crossing(points: list[tuple[float, float]], level: float = GOOD) -> float | None:
    """Smallest local size at which the efficiency line ``[(size, efficiency), ...]`` reaches ``level``.

    Interpolated linearly in log(size) between the two measured sizes that
    bracket it; ``None`` if no measured size reaches it. (A line that starts
    above the level crosses at its first size.)
    """
    import math

    points = sorted(points)
    for i, (n, e) in enumerate(points):
        if e >= level:
            if i == 0:
                return n
            n0, e0 = points[i - 1]
            t = (level - e0) / (e - e0)
            return math.exp(math.log(n0) + t * (math.log(n) - math.log(n0)))
    return None


def plot(results: list[dict], out: Path) -> list[Path]:
    """One PNG per model: efficiency vs local size (log), one line per P, 0.9 and its crossings marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in results if r["suite"] == SUITE]
    paths = []
    for case in dict.fromkeys(r["case"] for r in mine):
        model, unit = case.split(": parallel efficiency, ")
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for P in sorted({r["world_size"] for r in mine if r["case"] == case}):
            points = sorted((r["local_size"], r["ratio"]) for r in mine if r["case"] == case and r["world_size"] == P)
            (line,) = ax.plot(*zip(*points), marker="o", label=f"P = {P}")
            cross = crossing(points)
            if cross is not None and P > 1:
                ax.axvline(cross, color=line.get_color(), linestyle=":", linewidth=1)
                ax.annotate(f"{cross:.0f}", (cross, GOOD), textcoords="offset points", xytext=(3, -12),
                            color=line.get_color(), fontsize=8)  # fmt: skip
        ax.axhline(GOOD, color="k", linestyle="--", linewidth=0.8, label=f"efficiency {GOOD}")
        ax.set_xscale("log", base=2)
        sizes = sorted({r["local_size"] for r in mine if r["case"] == case})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel(unit)
        ax.set_ylabel("parallel efficiency\nsingle-device work / (P x per-rank work)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{model}: strong scaling at global size = P x local\n"
                     "(dotted: local size where the line reaches 0.9)", fontsize=10)  # fmt: skip
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{SUITE}_{model.replace(' ', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
