"""Cost per element of decomposition-invariant random draws, against torch's native generator.

A sharded draw evaluates Philox4x32-10 in torch integer ops at the global
indices of each rank's box (``physicsnemo_dp._philox``); torch's CPU generator
(Mersenne Twister + a fused kernel) is faster per element but sequential, so
it cannot give the values of another rank's box. Figures (CPU time of all
ranks per global element, median of repetitions of interleaved rounds, one intra-op thread
per rank):

* ``randn_like`` (float32) and ``F.dropout`` (p = 0.1, float32) on a
  ShardTensor over the same op on the whole plain tensor in one process;
* ``physicsnemo_dp.random.randn`` without a mesh (the generator alone, no
  dispatch) over ``torch.randn``.

No target: the ratio is the price of the guarantee (Philox in eager torch ops
runs ~130 elementwise passes over a quarter of the elements), reported
honestly; per rank the work is O(local), so it falls as 1/P with the shard.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

import physicsnemo_dp as pdp
from physicsnemo_dp.collectives import mesh_device

from ._record import Result, over_ranks
from ._timing import fastest_by

SUITE = "throughput_scaling"


def draw_cost(mesh, rows: int, cols: int, rounds: int) -> list[Result]:
    """Random-draw cost per element: sharded (summed over ranks) / plain torch in one process."""
    P = mesh.size()
    shape = (4 * rows, 4 * cols)
    numel = shape[0] * shape[1]
    device = mesh_device(mesh)
    plain = torch.zeros(shape, device=device)
    sharded = pdp.randn(shape, mesh, [Shard(0)] * mesh.ndim)
    runs = {
        "randn_like sharded": lambda: torch.randn_like(sharded),
        "randn_like plain": lambda: torch.randn_like(plain),
        "dropout sharded": lambda: F.dropout(sharded, 0.1),
        "dropout plain": lambda: F.dropout(plain, 0.1),
        "counter-based plain": lambda: pdp.random.randn(shape, device=device),
        "torch.randn": lambda: torch.randn(shape, device=device),
    }
    best = fastest_by(runs, rounds, [time.process_time])
    work = {name: over_ranks(b[0]) / numel for name, b in best.items()}  # CPU seconds per element, all ranks
    alone = {name: w / P for name, w in work.items()}  # per process (the plain baselines run whole on each rank)
    return [
        Result(SUITE, "random draw, randn_like float32: CPU per element, all ranks / plain torch", P,
               work["randn_like sharded"], alone["randn_like plain"], "s"),
        Result(SUITE, "random draw, F.dropout float32: CPU per element, all ranks / plain torch", P,
               work["dropout sharded"], alone["dropout plain"], "s"),
        Result(SUITE, "random draw, counter-based generator alone (no mesh) / torch.randn", P,
               alone["counter-based plain"], alone["torch.randn"], "s"),
    ]  # fmt: skip
