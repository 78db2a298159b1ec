"""simulate() against real runs: bytes per collective kind exact, peak memory within 5%, on worlds 2-4 and 2x2."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp.debug import DataDependentError, count_collectives, explain, peak_bytes, sharded_input, simulate
from tests._harness import run_job

from ._setups import SETUPS, weak_unet


def _real_body(ctx, model):
    """This rank's real step: the counter's totals, explain's totals and the measured peak."""
    step = SETUPS[model](ctx.mesh)
    with count_collectives() as counter:
        explanation = explain(step)
    return {"counter": counter.summary(), "explained": explanation.collectives(), "peak": explanation.peak_bytes}


FULL = os.environ.get("PDP_SIMULATE_FULL") == "1"
full_only = pytest.mark.skipif(not FULL, reason="every layout: PDP_SIMULATE_FULL=1 pytest tests/debug (~3 min)")
CASES = [
    pytest.param("unet", (3,), ("domain",), id="unet-ws3"),
    pytest.param("transformer", (2,), ("domain",), id="transformer-ws2"),
    pytest.param("fno", (3,), ("domain",), id="fno-ws3"),
    pytest.param("unet", (2,), ("domain",), id="unet-ws2", marks=full_only),
    pytest.param("unet", (4,), ("domain",), id="unet-ws4", marks=full_only),
    pytest.param("unet", (2, 2), ("ddp", "domain"), id="unet-mesh2x2", marks=full_only),
    pytest.param("transformer", (3,), ("domain",), id="transformer-ws3", marks=full_only),
    pytest.param("transformer", (4,), ("domain",), id="transformer-ws4", marks=full_only),
]


@functools.lru_cache(maxsize=None)
def _compare(model, shape, names):
    """``[(real, simulated)]`` per rank: the harness ranks' step and simulate() of each rank."""
    size = math.prod(shape)
    real = [o.value for o in run_job(size, shape, __name__, "_real_body", {"model": model}, timeout=120)]
    return [(r, simulate(SETUPS[model], size, mesh_shape=shape, mesh_dim_names=names, rank=rank))
            for rank, r in enumerate(real)]  # fmt: skip


@pytest.mark.parametrize("model, shape, names", CASES)
def test_simulated_bytes_equal_a_real_run(model, shape, names):
    for rank, (real, sim) in enumerate(_compare(model, shape, names)):
        assert real["explained"] == real["counter"]  # explain's totals are the counter's
        assert sim.collectives == real["counter"], f"rank {rank}"


@pytest.mark.parametrize("model, shape, names", CASES)
def test_simulated_peak_is_within_5_percent_of_a_real_run(model, shape, names):
    """Every rank of every layout (the real runs are the bytes test's, cached); exact in practice, see docs/simulate.md."""
    for rank, (real, sim) in enumerate(_compare(model, shape, names)):
        assert abs(sim.peak_bytes - real["peak"]) <= 0.05 * real["peak"], (rank, sim.peak_bytes, real["peak"])


def test_largest_rank_is_the_one_with_the_biggest_box():
    def setup(mesh):
        x = sharded_input(mesh, (1, 10, 4), [Shard(1)], sizes=(None, (1, 2, 5, 2), None))
        return lambda: (x * 2).sum()

    assert simulate(setup, 4, rank="largest").rank == 2


@pytest.mark.parametrize("world_size", [1024, pytest.param(4096, marks=full_only)])
def test_simulation_at_scale(world_size):
    """The U-Net on 8 rows per rank at P = 1,024 (~4 s) and 4,096 (~15 s): per-rank traffic does not grow with P.

    Halos are the same at every P; the weights' gradient all-reduces grow
    towards twice the gradient bytes (a ring moves ``2 (P-1)/P`` of the data);
    nothing else is sent, and the peak does not grow either.
    """
    big, small = simulate(weak_unet, world_size), simulate(weak_unet, 4)
    assert set(big.collectives) == {"all_reduce", "halo"}
    assert big.collectives["halo"] == small.collectives["halo"]
    grads = small.collectives["all_reduce"]["sent"] * 4 / (2 * 3)  # the gradient bytes, from P = 4
    assert big.collectives["all_reduce"]["sent"] == pytest.approx(grads * 2 * (world_size - 1) / world_size, rel=0.01)
    assert big.peak_bytes == small.peak_bytes


def _table_setup(mesh):
    """A CPU table moved next to the data, as rules do with index tables: no copy at all on a CPU mesh."""
    x = sharded_input(mesh, (1, 8, 4), [Shard(1)])
    return lambda: torch.arange(1000).to(x.to_local().device) + x.to_local().sum()


def test_a_cpu_table_moved_next_to_the_data_is_counted_once():
    real = peak_bytes(lambda: torch.arange(1000).to("cpu") + torch.zeros(()))  # the ``to`` returns the table
    assert real == 8000 + 4 + 4000  # the table, a 0-dim sum, the float result
    assert simulate(_table_setup, 2).peak_bytes == real


def _nonzero_setup(mesh):
    x = sharded_input(mesh, (1, 8, 4), [Shard(1)])
    return lambda: x[x > 0].sum()


def _item_setup(mesh):
    x = sharded_input(mesh, (8, 4), [Shard(0)])
    return lambda: x.sum().full_tensor().item()


@pytest.mark.parametrize("setup", [_nonzero_setup, _item_setup], ids=["mask", "item"])
def test_data_dependent_ops_raise_naming_the_op(setup):
    with pytest.raises(DataDependentError, match=r"aten\.(index\.Tensor|_local_scalar_dense)"):
        simulate(setup, 4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size=6 but mesh_shape"):
        simulate(SETUPS["unet"], 6, mesh_shape=(2, 2))
    with pytest.raises(ValueError, match="rank must be"):
        simulate(SETUPS["unet"], 2, rank=2)
    with pytest.raises(ValueError, match="mesh_dim_names"):
        simulate(SETUPS["unet"], mesh_shape=(2, 2), mesh_dim_names=("a",))
    with pytest.raises(TypeError, match="must return the step"):
        simulate(lambda mesh: None, 2)


def _pointwise_setup(mesh):
    x = sharded_input(mesh, (4, 8), [Shard(0)] * mesh.ndim)
    return lambda: (x * 2).sum()


def test_default_mesh_dim_names_are_those_of_launch_and_meshcontext():
    """("domain",) and ("ddp", "domain"), as launch(), MeshContext and the CLI name them; dim0.. beyond."""
    assert simulate(_pointwise_setup, 4).mesh_dim_names == ("domain",)
    assert simulate(_pointwise_setup, mesh_shape=(2, 2)).mesh_dim_names == ("ddp", "domain")
    assert simulate(_pointwise_setup, mesh_shape=(2, 1, 2)).mesh_dim_names == ("dim0", "dim1", "dim2")


def test_the_patched_attention_is_restored():
    before = torch.nn.functional.scaled_dot_product_attention
    simulate(SETUPS["transformer"], 2)
    assert torch.nn.functional.scaled_dot_product_attention is before
