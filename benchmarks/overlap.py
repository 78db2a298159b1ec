"""Wait / step: how long the main thread waits in collectives per training step, with and without overlap.

The time is summed by :func:`physicsnemo_dp.collectives.wait_clock` (only the
waits: from the call that blocks on a posted collective to its return), over
whole forward + backward steps, and reported over the step's wall time.

* **U-Net** (the model of ``examples/unet_darcy.py``, sharded along its rows):
  every 3x3 convolution's halo exchange posted before the interior is
  convolved and waited for only for the seam rows, forward and backward
  (``overlap("auto")``, the default: after) against exchange-then-compute
  (``overlap("off")``: before), interleaved in the same run. Target for the
  U-Net's halo waits: after <= 0.8 x before (P >= 2). The three-conv net is
  reported alike, without a target: its interiors take a few ms, too little
  to hide the skew other jobs put between the ranks here. All waits (GroupNorm's
  statistics and the gradient reductions included) are reported too: a
  blocking all-reduce after the convolution absorbs what the halo no
  longer waits for when the ranks are out of step.
* **Transformer block** (ring attention over the sequence): the next hop's
  K/V is posted before the current block is computed and the accumulated
  dK/dV travel while the next tiles run (this was so before this suite
  existed), against each hop waited for as soon as it is posted
  (``overlap("off")``). Target: after <= 0.8 x before (P >= 2).

Each figure is the median of three repetitions (consecutive groups of the
interleaved rounds), each the median over its rounds of each rank's figure,
averaged over ranks. On this CPU machine gloo's transport threads share the two cores
with the ranks, so a wait also holds the time a peer needs to reach the same
exchange (its skew) and the transfer itself.
"""

from __future__ import annotations

import time

import numpy as np
import torch.distributed as dist

from physicsnemo_dp.collectives import overlap, wait_clock

from . import _models
from ._record import Result, over_ranks
from ._timing import REPETITIONS

SUITE = "overlap"


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(rows=16, width=4, seq=32, dim=16, rounds=REPETITIONS)
    # 256x256 and 4,096 tokens at scale 1: a smaller grid's local inputs are mostly under the size from which a
    # convolution overlaps its halo (docs/performance.md), so the figure would time skew, not overlap
    return dict(rows=int(256 * scale), width=16, seq=int(4096 * scale), dim=64, rounds=2 * REPETITIONS)


def _timed(step) -> tuple[float, float, dict]:
    """``(wait seconds, step seconds, wait seconds per kind)`` of one ``step()``, started on every rank together."""
    if dist.is_initialized():
        dist.barrier()
    with wait_clock() as clock:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return clock.total, seconds, dict(clock.seconds)


def _medians(samples: list) -> tuple[np.ndarray, np.ndarray]:
    """``(wait, step)`` per repetition: the rounds split into :data:`~._timing.REPETITIONS` consecutive groups
    (interleaved between the modes), each rank's median over a group's rounds, averaged over ranks."""
    P = dist.get_world_size() if dist.is_initialized() else 1
    groups = [g for g in np.array_split(np.asarray(samples, float), REPETITIONS) if len(g)]
    wait = np.array([np.median(g[:, 0]) for g in groups])
    step = np.array([np.median(g[:, 1]) for g in groups])
    return over_ranks(wait) / P, over_ranks(step) / P


def _pair(net, x, rounds: int) -> dict:
    """``{mode: [(wait, step, waits per kind)] per round}``: ``net``'s training step overlapped ("auto") and not ("off")."""
    samples = {"off": [], "auto": []}
    for round_ in range(rounds + 1):  # interleaved, one warm-up round
        for mode in samples:
            with overlap(mode):
                sample = _timed(lambda: _models.train_step(net, x))
            if round_:
                samples[mode].append(sample)
    return samples


def _of(samples: dict, kind: str | None) -> dict:
    """``{mode: (wait, step)}`` counting only the waits of collective ``kind`` (None: every wait)."""
    pick = (lambda s: s[0]) if kind is None else (lambda s: s[2].get(kind, 0.0))
    return {mode: _medians([(pick(s), s[1]) for s in got]) for mode, got in samples.items()}


def _figures(name: str, what: str, pair: dict, P: int, target: float | None) -> list[Result]:
    (w_on, s_on), (w_off, s_off) = pair["auto"], pair["off"]
    return [
        Result(SUITE, f"{name}: {what} / step, overlapped / exchange then compute", P, w_on / s_on, w_off / s_off,
               "s/s", ("<=", target) if P > 1 and target is not None else None),
        Result(SUITE, f"{name}, overlapped: {what} / step", P, w_on, s_on, "s"),
        Result(SUITE, f"{name}, exchange then compute: {what} / step", P, w_off, s_off, "s"),
    ]  # fmt: skip


def run(mesh, rows: int, width: int, seq: int, dim: int, rounds: int, compare_dtensor: bool = False) -> list[Result]:
    P = mesh.size()
    device = _models.mesh_device(mesh)
    results = []
    nets = {
        f"U-Net {rows}x{rows}, rows sharded": (_models.UNet(1, 1, width).to(device), (1, 1, rows, rows)),
        f"conv net {rows}x{rows}, rows sharded": (_models.model(_models.cases(width, rows, dim)["conv net"], mesh),
                                                 (1, 4, rows, rows)),
    }  # fmt: skip
    for name, (net, shape) in nets.items():
        x = _models.shard(_models.global_input(shape).to(device), mesh, 2)
        samples = _pair(net, x, rounds)
        # the target on the U-Net only: the conv net's interiors (a few ms each) hide little of the skew that
        # other jobs put between the ranks here, so its figure swings between runs (0.13-1.27)
        results += _figures(name, "halo waits", _of(samples, "halo"), P, 0.8 if name.startswith("U-Net") else None)
        results += _figures(name, "all waits", _of(samples, None), P, None)
        # the conv net's all-reduces are its parameter gradients' (Promote.backward); the U-Net's add GroupNorm's
        results += _figures(name, "all-reduce waits", _of(samples, "all_reduce"), P, None)
    case = _models.cases(16, 16, dim)["transformer block"]
    tokens = _models.scaling_inputs(case, mesh, seq, seq)["strong"][1]
    ring = _of(_pair(_models.model(case, mesh), tokens, rounds), "send_recv")
    results += _figures(f"transformer block, {seq} tokens (ring attention)", "ring hops' waits", ring, P, 0.8)
    return results
