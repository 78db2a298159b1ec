"""A one-minute tour: 4 CPU ranks split an unevenly sized field and agree with one process.

Run ``python -m physicsnemo_dp.demo`` (or the README's first command). Rank 0
scatters a field whose rows do not divide evenly, every rank runs ordinary
torch code on its piece (with a plain weight promoted automatically), the data
moves from a row split to a column split, and the gathered result and the
gradient are compared with the same computation on the full field in one
process.
"""

from __future__ import annotations

import argparse

import torch

from . import Shard, launch, scatter_tensor


def _reference(field: torch.Tensor, weight: torch.Tensor):
    x = field.clone().requires_grad_(True)
    y = torch.tanh(x * weight) + 0.5 * x
    y.sum().backward()
    return y.detach(), x.grad


def _rank_body(mesh, rows: int, cols: int):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    field = torch.randn(rows, cols, dtype=torch.float64)
    weight = torch.linspace(0.5, 1.5, cols, dtype=torch.float64)

    # 1. rank 0 holds the field; scatter it with the split rule (torch.chunk):
    #    37 rows over 4 ranks are 10, 10, 10, 7 rows.
    x = scatter_tensor(field if rank == 0 else None, 0, mesh, [Shard(0)], requires_grad=True)
    sizes = [shape[0] for shape in x._spec.sharding_shapes(0)]
    start = x.offsets(0)
    # 3. ordinary torch code on the sharded field; `weight` is a plain tensor (promoted)
    y = torch.tanh(x * weight) + 0.5 * x
    # 4. move from a row split to a column split (one all-to-all), gather, compare
    y_cols = y.redistribute(placements=[Shard(1)])
    full = y_cols.full_tensor()
    full.sum().backward()
    full = full.detach()

    ref_y, ref_grad = _reference(field, weight)
    grad_full = x.grad.full_tensor()
    print(
        f"holds rows {start}:{start + sizes[rank]} ({sizes[rank]} of {rows}); "
        f"after redistribute holds {tuple(y_cols.to_local().shape)}"
    )
    return {
        "sizes": sizes,
        "max_abs_diff_output": float((full - ref_y).abs().max()),
        "max_abs_diff_grad": float((grad_full - ref_grad).abs().max()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="number of CPU ranks (default 4)")
    parser.add_argument("--rows", type=int, default=37, help="rows of the field (default 37)")
    parser.add_argument("--cols", type=int, default=29, help="columns of the field (default 29)")
    args = parser.parse_args(argv)
    print(f"starting {args.ranks} CPU ranks (gloo) for a {args.rows}x{args.cols} field ...", flush=True)
    from physicsnemo_dp.demo import _rank_body as body  # by reference, not as __main__ code

    out = launch(body, args.ranks, args=(args.rows, args.cols), backend="gloo")
    ok = out["max_abs_diff_output"] < 1e-12 and out["max_abs_diff_grad"] < 1e-12
    print(f"rows per rank: {out['sizes']}")
    print(f"max |sharded - single process|: output {out['max_abs_diff_output']:.1e}, gradient {out['max_abs_diff_grad']:.1e}")
    print("MATCH: the sharded computation equals the single-process result" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
