"""Draw the plots of docs/simulate.md: bytes and memory per rank vs P, simulated up to 4,096 ranks.

    .venv/bin/python tools/simulate_plots.py            # ~20 min on 2 cores: the ring at P = 4,096 alone ~10 min
    .venv/bin/python tools/simulate_plots.py --max-p 256 # quicker

Weak scaling (every rank holds the same local extent), the rank with the
largest shard, one training step (forward, mean-square loss, backward):

* the U-Net of examples/unet_darcy.py (width 16, depth 2), 1 sample of
  ``(64 P) x 256`` points sharded by rows: 64 rows per rank;
* ``nn.TransformerEncoderLayer`` (dim 64, 4 heads) on ``64 P`` tokens sharded
  along the sequence: its SDPA runs as ring attention.

Writes docs/images/simulate_unet.png, simulate_transformer.png and prints the
rows (also kept in docs/images/simulate_rows.txt).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from physicsnemo_dp.debug.__main__ import _row, model_step, plot, sweep  # noqa: E402


def unet():
    from unet_darcy import UNet

    return UNet(width=16, depth=2)


def transformer():
    return nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-p", type=int, default=4096)
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = parser.parse_args()
    sizes = [p for p in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if p <= args.max_p]
    out = Path(args.out)
    lines = []
    cases = {
        "unet": (lambda p: model_step(unet, (1, 1, 64 * p, 256), [2]), "U-Net (examples/unet_darcy.py), 64x256 points per rank"),
        "transformer": (lambda p: model_step(transformer, (1, 64 * p, 64), [1]),
                        "TransformerEncoderLayer (dim 64, 4 heads, ring attention), 64 tokens per rank"),
    }  # fmt: skip
    for name, (setup_for, title) in cases.items():
        sims = [sweep(setup_for(p), [p])[0] for p in sizes]
        lines += [f"{name}: {_row(s)}" for s in sims]
        plot(sims, f"{title}: one step, largest-shard rank, weak scaling", out / f"simulate_{name}.png")
        torch.manual_seed(0)
    (out / "simulate_rows.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
