"""explain(): one row per op with layouts, collectives and peaks; its totals are count_collectives()'."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp.debug import count_collectives, explain, sharded_input
from tests._harness import distributed

from ._setups import SETUPS


@distributed(world_sizes=(2, 3, 4), mesh_2d=True, timeout=120)
def test_explain_rows_of_a_unet_step(ctx):
    step = SETUPS["unet"](ctx.mesh)
    with count_collectives() as counter:
        e = explain(step)
    assert e.collectives() == counter.summary()  # the same stream, summed
    records = e.records
    assert {r["phase"] for r in records} == {"forward", "backward"}
    convs = [r for r in records if r["op"] == "conv2d"]
    assert len(convs) == 11  # 5 blocks of 2 convs and the 1x1 head
    assert all("S(" in r["inputs"] and "plain" in r["inputs"] for r in convs)  # sharded input, plain weights
    domain = ctx.mesh.mesh_dim_names[-1]
    assert all(f"halo@{domain}" in r["collectives"] for r in convs if "x3x3" in r["inputs"])
    assert not any(r["collectives"] for r in convs if "x1x1; plain" in r["inputs"])  # the 1x1 head needs no halo
    # Every plain weight gets its gradient summed over the mesh in its Promote node.
    promotes = [r for r in records if r["op"] == "PromoteBackward"]
    assert promotes and all("all_reduce" in r["collectives"] for r in promotes)
    assert all(r["source"] for r in records if r["phase"] == "backward" and r["op"] != "(autograd engine)")
    assert e.peak_bytes == max(r["peak_bytes"] for r in records)
    assert sum(r["sent"] for r in records) == counter.total_sent
    lines = str(e).splitlines()
    assert len(lines) == len(records) + 3 and max(map(len, lines[:-1])) < 300


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_explain_reports_layouts_and_local_shapes(ctx):
    x = sharded_input(ctx.mesh, (7, 4), [Shard(0)])
    w = torch.ones(4, 3, requires_grad=True)
    e = explain(lambda: (x @ w).sum().backward())
    mm = e.rows[0]
    rows = x.to_local().shape[0]
    assert (mm.phase, mm.op) == ("forward", "matmul")
    assert mm.inputs == [f"S(0) {rows}x4", "plain 4x3"] and mm.outputs == [f"S(0) {rows}x3"]
    total = next(r for r in e.rows if r.op == "sum")
    assert total.outputs == ["P ()"]  # a pending sum, no communication yet
    promote = [r for r in e.rows if r.op == "PromoteBackward"]
    assert len(promote) == 1 and promote[0].source == "matmul" and promote[0].outputs == ["plain 4x3"]
    # w's gradient summed once over the mesh: a ring all-reduce of 12 floats
    assert [(c.kind, c.sent) for c in promote[0].collectives] == [("all_reduce", 2 * (ctx.world_size - 1) * 48 // ctx.world_size)]


def test_explain_without_a_mesh_runs_plain_steps():
    x = torch.randn(3, 4, requires_grad=True)
    e = explain(lambda: torch.tanh(x).sum().backward())
    assert [r.op for r in e.rows if r.phase == "forward"] == ["tanh", "sum"]
    assert e.collectives() == {}
    assert e.peak_bytes >= 3 * 4 * 4  # tanh's output, saved for backward
    with pytest.raises(ImportError, match="records"):
        import builtins

        real_import = builtins.__import__

        def no_pandas(name, *args, **kwargs):
            if name == "pandas":
                raise ImportError("no pandas here")
            return real_import(name, *args, **kwargs)

        builtins.__import__ = no_pandas
        try:
            e.to_pandas()
        finally:
            builtins.__import__ = real_import
