"""DomainPipe on real process groups: world sizes 1-4 and the (ddp=2, domain=2) mesh.

Rank 0 writes each test's files into ``tmp_path`` (shared by all ranks) and the
others wait at a barrier. The expected arrays are recomputed on every rank from
the deterministic generators, so every check compares what a rank's pipe
produced with the matching slice of the full array computed in one process.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import threading
import time
import weakref

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
import xarray as xr
from torch.distributed.device_mesh import init_device_mesh

from datapipes import DataPipeError, DecompositionError, DomainPipe, HDF5Fields, InvalidValuesError, MeshSource
from datapipes.decomposition import balanced_sizes
from datapipes.statistics import Normalize, Statistics, compute_statistics
from datapipes.synthetic import darcy_flow, write_hdf5
from datapipes.writer import write_shards
from physicsnemo_dp import Replicate, Shard, ShardTensor, count_collectives
from physicsnemo_dp import collectives as pdp_collectives
from physicsnemo_dp.debug import checks
from tests._harness import distributed

from ._data import GRID_FORMATS, VARIABLES, grid_fields, heat_fields, open_grid, write_grid, write_meshes


def _shared(ctx, write):
    """Rank 0 runs ``write()``; every rank gets its result after a barrier."""
    result = [write() if ctx.rank == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _domain(ctx) -> tuple[int, tuple[int, ...]]:
    """(domain size, this rank's domain coordinate) for the harness's meshes."""
    coord = tuple(ctx.mesh.get_coordinate())
    return ctx.mesh_shape[-1], coord[-1:]


# --------------------------------------------------------------------------- #
# Every format: local shard == slice of the full array; full_tensor == sample
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("fmt", GRID_FORMATS)
@distributed
def test_each_rank_holds_its_slice_of_every_format(ctx, fmt, tmp_path):
    path = _shared(ctx, lambda: write_grid(fmt, tmp_path))
    full = grid_fields()
    split_dim = GRID_FORMATS.index(fmt) % 2  # alternate rows and columns across formats
    with DomainPipe(open_grid(fmt, path), ctx.mesh, batch_size=2, split_dims=(split_dim,), seed=1) as pipe:
        _, coord = _domain(ctx)
        dec = pipe.decompose(0)["pressure"]
        if fmt in ("netcdf", "zarr"):  # xarray formats carry coordinates: the local slab's are available
            coords = pipe.local_coords()
            axis = np.linspace(0, 1, 16)
            assert np.array_equal(coords[("y", "x")[split_dim]], axis[dec.box(coord)[split_dim]])
            assert np.array_equal(coords[("y", "x")[1 - split_dim]], axis)
        for batch in pipe:
            assert set(batch) == set(VARIABLES)
            for name in VARIABLES:
                st = batch[name]
                expected = full[name][list(batch.samples)]
                assert tuple(st.shape) == expected.shape
                assert st._spec.local_offsets() == (0, *dec.offsets(coord))
                assert np.array_equal(st.to_local().numpy(), expected[(slice(None), *dec.box(coord))])
                assert np.array_equal(st.full_tensor().numpy(), expected)


@pytest.mark.parametrize("workers,prefetch", [("thread", 2), ("process", 0), ("process", 1)])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_every_reader_gives_the_same_batches(ctx, workers, prefetch, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    full = grid_fields()
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, batch_size=3, workers=workers, prefetch=prefetch,
                    adaptive_prefetch=False) as pipe:  # every batch through the background reader
        dec = pipe.decompose(0)["permeability"]
        for batch in pipe:
            local = batch["permeability"].to_local().numpy()
            assert np.array_equal(local, full["permeability"][list(batch.samples)][(slice(None), *dec.box(ctx.rank))])


@distributed
def test_explicit_sizes_reach_the_shard_tensor(ctx, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5-chunked", tmp_path))
    size, coord = _domain(ctx)
    sizes = (16 - 3 * (size - 1), *[3] * (size - 1))  # load balancing: rank 0 takes the most rows
    with DomainPipe(open_grid("hdf5-chunked", path), ctx.mesh, sizes=[sizes], shuffle=False) as pipe:
        batch = next(iter(pipe))
        st = batch["pressure"]
        assert st._spec.dim_sizes[1] == sizes
        start = sum(sizes[: coord[0]])
        expected = grid_fields()["pressure"][list(batch.samples)]
        assert np.array_equal(st.to_local().numpy(), expected[:, start : start + sizes[coord[0]]])
        assert np.array_equal(st.full_tensor().numpy(), expected)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_reused_layouts_give_the_specs_from_local_gives(ctx, tmp_path):
    """Batches after the first reuse the layout and ShardTensor spec; a smaller last batch gets its own."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, batch_size=4, halo=1, prefetch=0) as pipe:
        dec = pipe.decompose(0)["pressure"]
        for epoch in range(2):
            pipe.set_epoch(epoch)
            rows = [len(batch.samples) for batch in pipe if _same_spec_as_from_local(batch, ctx, dec)]
            assert rows == [4, 2]


def _same_spec_as_from_local(batch, ctx, dec) -> bool:
    for name in VARIABLES:
        st = batch[name]
        ref = ShardTensor.from_local(st.to_local(), ctx.mesh, dec.placements(1),
                                     sharding_shapes=dec.sharding_shapes(ctx.rank, leading=(len(batch.samples),)))
        got = st._spec
        assert (got.global_shape, got.placements, got.dim_sizes, got.tensor_meta) == (
            ref._spec.global_shape, ref._spec.placements, ref._spec.dim_sizes, ref._spec.tensor_meta)
        assert st.to_local().data_ptr() == batch.padded[name][(slice(None), *dec.interior(ctx.rank))].data_ptr()
        assert not st.requires_grad and st.grad_fn is None
    return True


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_kept_batches_are_never_overwritten_and_dropped_ones_are_reused(ctx, workers, adaptive, tmp_path):
    """Adaptive: this consumer asks at once, so after the first batch the caller reads, into its own pool."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    full = grid_fields()["pressure"]
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, workers=workers, prefetch=2, seed=4,
                    adaptive_prefetch=adaptive) as pipe, _consumer_clock():  # no time passes between batches
        kept = list(pipe)  # every batch alive at once: the pool must grow, not recycle
        dec = pipe.decompose(0)["pressure"]
        for batch in kept:
            assert np.array_equal(batch["pressure"].to_local().numpy(),
                                  full[list(batch.samples)][(slice(None), *dec.box(ctx.rank))])
        del kept, batch
        addresses = {b["pressure"].to_local().data_ptr() for b in pipe}  # each batch dropped at once
        assert len(addresses) <= pipe.prefetch + 2


@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_what_a_consumer_keeps_of_a_batch_is_never_overwritten_while_reads_run_ahead(ctx, workers, tmp_path):
    """Batch buffers are reused with their own arrays (no per-batch teardown): a view of one batch's local
    tensor, its halo-padded tensor and a tensor autograd saved keep their buffer out of reuse while later
    batches are read ahead into the others (fails if a buffer still in use is refilled)."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    full = grid_fields()
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, workers=workers, prefetch=2, shuffle=False,
                    adaptive_prefetch=False) as pipe:
        dec = pipe.decompose(0)["pressure"]
        kept, graphs = [], []
        for k, batch in enumerate(pipe):
            if k % 2 == 0:  # every other batch: keep a part of it, drop the rest
                kept.append((batch.samples, batch["pressure"].to_local()[0, 1:], batch.padded["permeability"][:, :2]))
                leaf = batch.padded["pressure"].detach().requires_grad_()
                graphs.append((batch.samples, (leaf * leaf).sum()))
            del batch
        for _ in range(2):  # more epochs: every buffer not in use is refilled
            addresses = {b["pressure"].to_local().data_ptr() for b in pipe}
        for samples, local, padded in kept:
            assert np.array_equal(local.numpy(), full["pressure"][samples[0]][dec.box(ctx.rank)][1:])
            box = pipe.decompose(0)["permeability"].box(ctx.rank, halo=True)
            assert np.array_equal(padded.numpy(), full["permeability"][list(samples)][(slice(None), *box)][:, :2])
        for samples, loss in graphs:
            leaf = loss.grad_fn.next_functions[0][0].next_functions[0][0].variable
            loss.backward()
            assert torch.equal(leaf.grad, 2 * leaf) and np.array_equal(
                leaf.detach().numpy(), full["pressure"][list(samples)][(slice(None), *dec.box(ctx.rank, halo=True))])
        assert len(addresses) <= pipe.prefetch + 2  # the buffers nobody kept were reused


@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_a_pipe_dropped_without_close_is_collected_and_stops_its_reader(ctx, workers, tmp_path):
    """No frame of the reader's threads keeps the pipe alive (a read holds it until it is finished): the
    pipe's finalizer closes the reader, even after an iteration stopped early."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    pipe = DomainPipe(open_grid("hdf5", path), ctx.mesh, workers=workers, prefetch=2, adaptive_prefetch=False)
    for batch in pipe:
        pass
    iterator = iter(pipe)
    next(iterator)
    del batch, iterator
    collected = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert collected() is None
    assert not [t.name for t in threading.enumerate() if t.name.startswith("datapipes-")]


class _SlowFields(HDF5Fields):
    """HDF5 fields whose every box read takes at least ``_READ_S``: a read long enough to time reliably."""

    def read(self, index, variable, box, out):
        time.sleep(_READ_S)
        return super().read(index, variable, box, out)


_READ_S = 0.003


def _spy_on_background_reads(pipe: DomainPipe) -> list[int]:
    """Start ``pipe``'s reader and record the first sample of every task handed to it."""
    reader = pipe._start_reader()
    submitted: list[int] = []
    submit = reader.submit

    def recording(read):
        submitted.append(read.samples[0])
        submit(read)

    reader.submit = recording
    return submitted


class _ConsumerClock:
    """Stands in for ``time`` in ``datapipes.pipe``, where it only measures the consumer's time between
    batches: the tests declare that time (``advance``) instead of sleeping, so that 4 ranks sharing 2
    cores cannot stretch an "immediate" consumer into a slow one. Reads keep the real clock."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.contextmanager
def _consumer_clock():
    import datapipes.pipe as pipe_module

    clock, saved = _ConsumerClock(), pipe_module.time
    pipe_module.time = clock  # restored by hand: the rank processes outlive the test
    try:
        yield clock
    finally:
        pipe_module.time = saved


@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed
def test_reading_ahead_follows_the_consumer_and_never_changes_the_batches(ctx, workers, tmp_path):
    """A consumer that steps longer than a read gets reads in the background; one that asks at once
    gets them in the caller; switching in the middle of an epoch keeps order and values."""
    fields = darcy_flow(24, 16, seed=3)
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path, fields))
    read_s = 2 * _READ_S  # two variables per sample
    with DomainPipe(_SlowFields(path, VARIABLES), ctx.mesh, workers=workers, prefetch=2, shuffle=False) as pipe, \
            _consumer_clock() as clock:
        dec = pipe.decompose(0)["pressure"]
        _, coord = _domain(ctx)
        background = _spy_on_background_reads(pipe)

        def epoch(step_s: float) -> list[int]:
            seen = []
            for batch in pipe:
                expected = fields["pressure"][list(batch.samples)][(slice(None), *dec.box(coord))]
                assert np.array_equal(batch["pressure"].to_local().numpy(), expected)
                seen.extend(batch.samples)
                clock.advance(step_s)
            return seen

        order = list(pipe.order.batches(0))
        everything = [i for b in order for i in b]
        assert epoch(4 * read_s) == everything  # warm-up: the first reads include opening the file
        switches = pipe._pace.switches
        assert epoch(4 * read_s) == everything and pipe.reading_ahead  # the step hides the reads
        del background[:]
        assert epoch(0.0) == everything and not pipe.reading_ahead  # nothing to hide behind
        # the averages need a few batches to see the change: the first reads are still ahead, the rest in the caller
        assert 0 < len(background) <= len(order) - 4 and background == [b[0] for b in order[: len(background)]]
        del background[:]
        assert epoch(0.0) == everything and background == []
        assert epoch(4 * read_s) == everything and pipe.reading_ahead
        assert len(background) >= len(order) - 2
        assert pipe._pace.switches == switches + 2
        assert pipe.bytes_read == 5 * len(everything) * 2 * int(np.prod(dec.local_shape(coord))) * 4


@distributed(world_sizes=(1, 3), mesh_2d=False)
def test_a_reader_forked_after_reads_in_the_caller_inherits_no_open_file(ctx, tmp_path):
    """A consumer that asks at once gets the reader process's reads in the caller, which opens the
    source's files in the training process. The next pipe's reader is forked after that: the files
    must be closed by then (an inherited netCDF file, kept in xarray's file cache, hung a reader)."""
    path = _shared(ctx, lambda: write_grid("netcdf", tmp_path))
    source = open_grid("netcdf", path)
    full = grid_fields()["pressure"]
    for _ in range(2):
        with DomainPipe(source, ctx.mesh, workers="process", shuffle=False) as pipe, _consumer_clock():
            background = _spy_on_background_reads(pipe)  # forks the reader
            assert source.__dict__.get("_handle_cache", {}) == {}  # nothing open across the fork
            dec = pipe.decompose(0)["pressure"]
            _, coord = _domain(ctx)
            for batch in pipe:
                assert np.array_equal(batch["pressure"].to_local().numpy(),
                                      full[list(batch.samples)][(slice(None), *dec.box(coord))])
            assert not pipe.reading_ahead and len(background) < len(pipe)  # read in the caller ...
            assert source.__dict__.get("_handle_cache")  # ... with the files open here


@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_prefetch_reads_that_many_batches_while_the_consumer_holds_one(ctx, workers, prefetch, tmp_path):
    """While the consumer works on batch k, batches k+1 .. k+prefetch are already with the reader."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, workers=workers, prefetch=prefetch, shuffle=False,
                    adaptive_prefetch=False) as pipe:
        background = _spy_on_background_reads(pipe)
        order = [b[0] for b in pipe.order.batches(0)]
        for k, batch in enumerate(pipe):
            assert batch.samples == (order[k],)
            assert background == order[: min(len(order), k + 1 + prefetch)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(3,), mesh_2d=False)
def test_random_steps_switch_the_reads_anywhere_and_keep_every_batch(ctx, workers, seed, tmp_path):
    fields = darcy_flow(24, 16, seed=5)
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path, fields))
    steps = _runs_of_steps(np.random.default_rng(seed + 10 * ctx.rank), 24)  # per rank: the pipe needs no agreement
    with DomainPipe(_SlowFields(path, VARIABLES), ctx.mesh, workers=workers, prefetch=2, seed=seed,
                    batch_size=2) as pipe, _consumer_clock() as clock:
        dec = pipe.decompose(0)["permeability"]
        for e in range(2):
            seen = []
            for batch, step in zip(pipe, steps[12 * e :]):
                local = batch["permeability"].to_local().numpy()
                assert np.array_equal(local, fields["permeability"][list(batch.samples)][(slice(None), *dec.box(ctx.rank))])
                seen.append(batch.samples)
                clock.advance(step)
            assert seen == [tuple(b) for b in pipe.order.batches(e)]
        assert pipe._pace.switches > 0  # the pattern made it switch (at least once, on every rank)


def _runs_of_steps(rng, n: int) -> list[float]:
    """``n`` step times: alternating runs of 2-5 steps longer than a read and of 7-10 without a step
    (long enough for the averages to cross the threshold: see datapipes._pacing)."""
    steps, busy = [], bool(rng.integers(2))
    while len(steps) < n:
        steps += [0.03] * int(rng.integers(2, 6)) if busy else [0.0] * int(rng.integers(7, 11))
        busy = not busy
    return steps[:n]


@distributed(world_sizes=(2,), mesh_2d=False)
def test_reader_process_starts_from_a_daemonic_rank(ctx, tmp_path):
    """Ranks started by physicsnemo_dp.launch are daemonic; multiprocessing would refuse them children."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    me = multiprocessing.current_process()
    was = me.daemon
    me.daemon = True
    try:
        with DomainPipe(open_grid("hdf5", path), ctx.mesh, workers="process", shuffle=False) as pipe:
            assert [b.samples for b in pipe] == [(i,) for i in range(6)]
    finally:
        me.daemon = was


@distributed(world_sizes=(4,), mesh_2d=False)
def test_a_two_dimensional_domain_mesh_splits_two_dims(ctx, tmp_path):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dx", "dy"))
    fields = heat_fields()
    path = _shared(ctx, lambda: write_hdf5(tmp_path / "heat.h5", fields)[0])
    source = open_grid("hdf5", path, variables=("u0", "u"))
    with DomainPipe(source, mesh, batch_size=2, split_dims=(2, 0), halo=1, shuffle=False) as pipe:
        coord = tuple(mesh.get_coordinate())
        dec = pipe.decompose(0)["u"]
        batch = next(iter(pipe))
        st = batch["u"]
        assert st.placements == dec.placements(1)
        expected = fields["u"][[0, 1]]
        assert np.array_equal(st.to_local().numpy(), expected[(slice(None), *dec.box(coord))])
        assert np.array_equal(batch.padded["u"].numpy(), expected[(slice(None), *dec.box(coord, halo=True))])
        assert np.array_equal(st.full_tensor().numpy(), expected)


# --------------------------------------------------------------------------- #
# Halos
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("fmt", ["hdf5-gzip", "zarr"])
@distributed
def test_halos_hold_the_neighbours_values(ctx, fmt, tmp_path):
    path = _shared(ctx, lambda: write_grid(fmt, tmp_path))
    full = grid_fields()
    size, coord = _domain(ctx)
    with DomainPipe(open_grid(fmt, path), ctx.mesh, halo=2, shuffle=False) as pipe:
        dec = pipe.decompose(0)["pressure"]
        for batch in pipe:
            sample = full["pressure"][list(batch.samples)]
            before, after = batch.halo["pressure"][0]
            assert (before > 0) == (coord[0] > 0) and (after > 0) == (coord[0] < size - 1)
            padded = batch.padded["pressure"].numpy()
            assert np.array_equal(padded, sample[(slice(None), *dec.box(coord, halo=True))])
            rows = dec.box(coord)[0]
            assert np.array_equal(padded[:, :before], sample[:, rows.start - before : rows.start])
            assert np.array_equal(padded[:, before:before + rows.stop - rows.start],
                                  batch["pressure"].to_local().numpy())


# --------------------------------------------------------------------------- #
# Sample order, epochs, resume
# --------------------------------------------------------------------------- #
@distributed
def test_ddp_ranks_partition_each_epoch_and_domain_ranks_agree(ctx, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, batch_size=2, seed=7, prefetch=1) as pipe:
        orders = []
        for epoch in range(2):
            pipe.set_epoch(epoch)
            mine = [i for batch in pipe for i in batch.samples]
            assert len(pipe) == -(-len(mine) // 2)
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, mine)
            ddp_size = ctx.mesh_shape[0] if len(ctx.mesh_shape) == 2 else 1
            domain = ctx.mesh_shape[-1]
            groups = [everyone[g * domain] for g in range(ddp_size)]
            for rank, seen in enumerate(everyone):
                assert seen == groups[rank // domain]  # every domain rank reads its group's samples
            assert sorted(i for g in groups for i in g) == list(range(6))  # a partition of the dataset
            orders.append(groups)
        assert orders[0] != orders[1]  # set_epoch reshuffles
        assert pipe.epoch == 2


@distributed
def test_resume_mid_epoch_continues_exactly(ctx, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5-chunked", tmp_path))
    source = open_grid("hdf5-chunked", path)
    options = dict(batch_size=1, seed=11, drop_last=True)
    with DomainPipe(source, ctx.mesh, **options) as reference:
        reference.set_epoch(3)
        expected = [(b.samples, b["pressure"].to_local().clone()) for b in reference]
    with DomainPipe(source, ctx.mesh, **options) as first:
        first.set_epoch(3)
        iterator = iter(first)
        done = [next(iterator).samples for _ in range(2)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
        del iterator
    assert state["epoch"] == 3 and state["position"] == 2
    with DomainPipe(source, ctx.mesh, **options) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(3)  # a training loop's usual call keeps the loaded position
        rest = [(b.samples, b["pressure"].to_local()) for b in resumed]
    assert done + [s for s, _ in rest] == [s for s, _ in expected]
    for (_, got), (_, want) in zip(rest, expected[2:]):
        assert torch.equal(got, want)
    with DomainPipe(source, ctx.mesh, **{**options, "seed": 12}) as other, pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


# --------------------------------------------------------------------------- #
# No communication, and each rank reads its share of the bytes
# --------------------------------------------------------------------------- #
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
         "broadcast_object_list", "barrier", "all_to_all", "all_to_all_single", "reduce_scatter",
         "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce")


@contextlib.contextmanager
def _record_c10d():
    """Record every torch.distributed collective or point-to-point call made inside the block, with its thread."""
    calls, saved = [], {name: getattr(dist, name) for name in _C10D}

    def recorder(name):
        def call(*args, **kwargs):
            calls.append((name, threading.get_ident()))
            return saved[name](*args, **kwargs)
        return call

    for name in _C10D:
        setattr(dist, name, recorder(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@pytest.mark.parametrize("prefetch", [0, 2])
@distributed
def test_batches_need_no_collective_and_each_rank_reads_its_share(ctx, prefetch, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    size, coord = _domain(ctx)
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, batch_size=2, prefetch=prefetch) as pipe:
        with count_collectives() as counted, _record_c10d() as raw:
            samples = [i for batch in pipe for i in batch.samples]
        assert counted.total_calls == 0 and raw == []
        dec = pipe.decompose(0)["pressure"]
        sample_bytes = 2 * 16 * 16 * 4  # two float32 variables
        share = dec.local_shape(coord)[0] / 16
        assert pipe.bytes_read == len(samples) * sample_bytes * share
        assert share <= 1 / size + 1 / 16  # about 1/domain of a sample (chunk rule rounds up one row)
        total = torch.tensor([pipe.bytes_read])
        dist.all_reduce(total, group=ctx.mesh["domain"].get_group() if len(ctx.mesh_shape) == 2 else None)
        assert total.item() == len(samples) * sample_bytes  # the domain ranks read each sample once


@contextlib.contextmanager
def _record_collectives():
    """``(kind, thread id)`` of every collective inside the block: physicsnemo_dp's (the checks' all-gathers) and
    torch.distributed's."""
    calls, saved = [], pdp_collectives._record

    def record(kind, *args):
        calls.append((kind, threading.get_ident()))
        return saved(kind, *args)

    pdp_collectives._record = record
    try:
        with _record_c10d() as raw:
            yield calls
        calls.extend(raw)
    finally:
        pdp_collectives._record = saved


@contextlib.contextmanager
def _record_wrapping():
    """Record ``(constructor, thread id)`` for every ShardTensor.from_local / from_spec / _of_local call inside
    the block (``_of_local``: a known spec wrapped as it is, how a background reader builds a batch)."""
    names = ("from_local", "from_spec", "_of_local")
    calls, saved = [], {name: ShardTensor.__dict__[name] for name in names}

    def recorder(name):
        method = saved[name]

        def call(*args, **kwargs):
            calls.append((name, threading.get_ident()))
            if isinstance(method, classmethod):
                return method.__func__(ShardTensor, *args, **kwargs)
            return method.__func__(*args, **kwargs)
        return classmethod(lambda cls, *a, **k: call(*a, **k)) if isinstance(method, classmethod) else staticmethod(call)

    for name in saved:
        setattr(ShardTensor, name, recorder(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(ShardTensor, name, fn)


@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_background_readers_build_batches_off_the_training_thread_and_checks_verify_them_on_it(
    ctx, workers, tmp_path
):
    """After a layout's first batch (from_local, training thread) the reader's thread builds every batch read
    ahead; under checks() the training thread builds it again through from_spec and verifies it collectively,
    and no collective ever runs on another thread. The batches are the same either way."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    full, main = grid_fields(), threading.get_ident()
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, workers=workers, prefetch=2, shuffle=False,
                    adaptive_prefetch=False) as pipe:  # every batch through the background reader
        dec = pipe.decompose(0)["permeability"]
        names, n = list(pipe.decompose(0)), len(pipe)
        with _record_wrapping() as built, _record_collectives() as raw:
            kept = list(pipe)
        assert raw == [] and built[: len(names)] == [("from_local", main)] * len(names)
        assert len(built) == n * len(names) and all(c == "_of_local" and t != main for c, t in built[len(names):])
        with checks(), _record_wrapping() as built, _record_collectives() as raw:
            checked = list(pipe)
        on_main = [c for c, t in built if t == main]
        assert on_main == ["from_spec"] * (n * len(names))  # every batch verified here
        assert len(raw) >= n * len(names) and all(t == main for _, t in raw)  # and only here
        for first, second in zip(kept, checked, strict=True):
            assert first.samples == second.samples and _same_spec_as_from_local(second, ctx, dec)
            for name in names:
                assert torch.equal(first[name].to_local(), second[name].to_local())
                assert first[name]._spec == second[name]._spec
                assert np.array_equal(second[name].to_local().numpy(),
                                      full[name][list(second.samples)][(slice(None), *dec.box(ctx.rank))])
        del kept, checked, first, second
        for _ in range(3):  # stopped early: batches built in the background return their buffers exactly once
            for batch in pipe:
                break
            del batch
        idle = pipe._pool._free
        assert len({id(b) for b in idle}) == len(idle) <= pipe._pool.max_idle
        for batch in pipe:
            assert np.array_equal(batch["pressure"].to_local().numpy(),
                                  full["pressure"][list(batch.samples)][(slice(None), *dec.box(ctx.rank))])


# --------------------------------------------------------------------------- #
# Statistics and normalization
# --------------------------------------------------------------------------- #
@distributed
def test_statistics_are_computed_distributed_and_normalize_the_pipe(ctx, tmp_path):
    path = _shared(ctx, lambda: write_grid("netcdf", tmp_path))
    full = grid_fields()
    source = open_grid("netcdf", path)
    stats = compute_statistics(source, ctx.mesh, split_dims=(1,))
    for name in VARIABLES:
        values = full[name].astype(np.float64)
        assert stats.count[name] == values.size
        assert stats.mean[name] == pytest.approx(values.mean(), rel=1e-9)
        assert stats.std[name] == pytest.approx(values.std(), rel=1e-9)
        assert (stats.min[name], stats.max[name]) == (values.min(), values.max())
    saved = _shared(ctx, lambda: stats.save(tmp_path / "stats.json"))
    assert Statistics.load(saved) == stats
    normalize = Normalize(Statistics.load(saved), ["pressure"])
    with DomainPipe(source, ctx.mesh, transforms=[normalize], shuffle=False) as pipe:
        dec = pipe.decompose(0)["pressure"]
        _, coord = _domain(ctx)
        for batch in pipe:
            want = (full["pressure"][list(batch.samples)] - stats.mean["pressure"]) / stats.std["pressure"]
            got = batch["pressure"].to_local().numpy()
            assert np.allclose(got, want[(slice(None), *dec.box(coord))], atol=1e-5)
            assert np.allclose(normalize.inverse("pressure", batch["pressure"].to_local()).numpy(),
                               full["pressure"][list(batch.samples)][(slice(None), *dec.box(coord))], atol=1e-6)


# --------------------------------------------------------------------------- #
# Writing results
# --------------------------------------------------------------------------- #
@distributed
def test_writer_stitches_rank_files_into_one_virtual_dataset(ctx, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path / "in"))
    full = grid_fields()
    ddp = tuple(ctx.mesh.get_coordinate())[0] if len(ctx.mesh_shape) == 2 else 0
    size, _ = _domain(ctx)
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, batch_size=3, split_dims=(1,), seed=2) as pipe:
        batch = next(iter(pipe))
        out = tmp_path / f"out_ddp{ddp}.h5"
        write_shards(out, dict(batch), dim_names={name: ("batch", "y", "x") for name in VARIABLES})
    dist.barrier()
    expected = {name: full[name][list(batch.samples)] for name in VARIABLES}
    with h5py.File(out) as f:
        for name in VARIABLES:
            assert f[name].is_virtual and np.array_equal(f[name][()], expected[name])
    with xr.open_dataset(out, engine="netcdf4") as ds:
        assert ds["pressure"].dims == ("batch", "y", "x")
        assert np.array_equal(ds["pressure"].values, expected["pressure"])
    assert len(list((tmp_path / f"out_ddp{ddp}.h5.parts").iterdir())) == size


@distributed(world_sizes=(), mesh_2d=True)
def test_writer_handles_a_two_dimensional_mesh_with_a_replicated_dim(ctx, tmp_path):
    full = np.arange(7 * 5, dtype=np.float64).reshape(7, 5)
    ddp, domain = ctx.mesh.get_coordinate()
    sizes = (4, 3)
    rows = slice(sum(sizes[:domain]), sum(sizes[: domain + 1]))
    st = ShardTensor.from_local(torch.from_numpy(full[rows].copy()), ctx.mesh, (Replicate(), Shard(0)),
                                sharding_shapes={1: [(n, 5) for n in sizes]})
    out = write_shards(tmp_path / "replicated.h5", {"field": st})
    dist.barrier()
    with h5py.File(out) as f:
        assert np.array_equal(f["field"][()], full)
    assert sorted(p.name for p in (tmp_path / "replicated.h5.parts").iterdir()) == ["rank00000.h5", "rank00001.h5"]


def _failing_h5py_file(*args, **kwargs):
    raise OSError("disk full (injected)")


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_writer_failure_on_one_rank_leaves_nothing(ctx, tmp_path):
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path / "in"))
    size, coord = _domain(ctx)
    with DomainPipe(open_grid("hdf5", path), ctx.mesh) as pipe:
        batch = next(iter(pipe))
    ddp = tuple(ctx.mesh.get_coordinate())[0] if len(ctx.mesh_shape) == 2 else 0
    out = tmp_path / f"failed{ddp}.h5"
    with pytest.MonkeyPatch.context() as patch:
        if coord[0] == size - 1:
            patch.setattr("datapipes.writer.h5py.File", _failing_h5py_file)
        with pytest.raises(DataPipeError, match=rf"failed on mesh rank\(s\) \[{size - 1}\]"):
            write_shards(out, dict(batch))
    dist.barrier()
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(f"failed{ddp}") or p.name.startswith(".failed")]
    assert all(p.is_dir() and not any(p.iterdir()) for p in leftovers)


# --------------------------------------------------------------------------- #
# Meshes
# --------------------------------------------------------------------------- #
@distributed
def test_mesh_ranks_get_contiguous_uneven_ranges_with_their_cells(ctx, tmp_path):
    paths = _shared(ctx, lambda: write_meshes(tmp_path))
    size, coord = _domain(ctx)
    with DomainPipe(MeshSource(paths), ctx.mesh, shuffle=False) as pipe:
        for batch in pipe:
            (index,) = batch.samples
            with h5py.File(paths[index]) as f:
                whole = {"points": f["points"][()], "pressure": f["fields/pressure"][()],
                         "normal": f["fields/normal"][()], "cells": f["cells"][()]}
            decs = pipe.decompose(index)
            assert decs["points"].sizes == (balanced_sizes(len(whole["points"]), size),)
            for name, values in whole.items():
                st = batch[name]
                assert st.to_local().shape[0] == 1
                assert np.array_equal(st.to_local()[0].numpy(), values[decs[name].box(coord)])
                assert np.array_equal(st.full_tensor()[0].numpy(), values)
            start = decs["points"].offsets(coord)[0]
            owners = batch["cells"].to_local()[0].min(dim=1).values
            assert ((owners >= start) & (owners < start + batch["points"].to_local().shape[1])).all()


@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(2,), mesh_2d=False)
def test_batching_meshes_of_different_sizes_is_an_error(ctx, workers, tmp_path):
    """The first read goes to the background reader, whose thread prepares it: the error reaches the consumer."""
    paths = _shared(ctx, lambda: write_meshes(tmp_path, count=2))
    with DomainPipe(MeshSource(paths), ctx.mesh, batch_size=2, shuffle=False, workers=workers) as pipe:
        with pytest.raises(DataPipeError, match="needs samples whose variables split alike"):
            next(iter(pipe))


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("workers", ["process", "thread"])
@distributed(world_sizes=(3,), mesh_2d=False)
def test_nan_validation_names_file_variable_and_sample(ctx, workers, tmp_path):
    def write():
        fields = grid_fields()
        fields["pressure"][2, :, 5] = np.nan  # a NaN column: in every rank's rows
        return write_hdf5(tmp_path / "bad.h5", fields)[0]

    path = _shared(ctx, write)
    with DomainPipe(open_grid("hdf5", path), ctx.mesh, validate=True, shuffle=False, workers=workers) as pipe:
        iterator = iter(pipe)
        next(iterator), next(iterator)
        with pytest.raises(InvalidValuesError, match=r"'pressure' of sample 2 \(.*bad.h5:/pressure\[2\].*NaN"):
            next(iterator)


@distributed(world_sizes=(4,), mesh_2d=False)
def test_splits_that_cannot_be_made_fail_on_every_rank_before_reading(ctx, tmp_path):
    def write():
        small = {name: values[:, :3] for name, values in grid_fields().items()}
        return write_hdf5(tmp_path / "small.h5", small)[0]

    path = _shared(ctx, write)
    source = open_grid("hdf5", path)
    with pytest.raises(DecompositionError, match=r"small.h5.*dim 0 has 3 cells, fewer than the 4 ranks"):
        DomainPipe(source, ctx.mesh)
    with pytest.raises(DecompositionError, match=r"halo of 5 along dim 1 is wider than the shard"):
        DomainPipe(source, ctx.mesh, split_dims=(1,), halo=5)


@distributed(world_sizes=(2,), mesh_2d=False)
def test_batches_read_in_the_caller_wrap_the_buffer_itself_without_halo_and_step_aside_otherwise(ctx, tmp_path):
    """Reads in the caller (prefetch=0): after a layout's first batch (from_local) each variable wraps the cached
    spec as it is (_of_local); without halo its local tensor is the buffer's tensor itself (no indexing), with a
    halo a view of the interior; under checks() every batch goes through from_spec over an interior view."""
    path = _shared(ctx, lambda: write_grid("hdf5", tmp_path))
    full = grid_fields()
    for halo in (0, 1):
        with DomainPipe(open_grid("hdf5", path), ctx.mesh, prefetch=0, shuffle=False, halo=halo) as pipe:
            dec = pipe.decompose(0)["permeability"]
            names, n = list(pipe.decompose(0)), len(pipe)
            with _record_wrapping() as built:
                kept = list(pipe)
            assert [c for c, _ in built] == ["from_local"] * len(names) + ["_of_local"] * ((n - 1) * len(names))
            with checks(), _record_wrapping() as built:
                checked = list(pipe)
            assert [c for c, _ in built] == ["from_spec"] * (n * len(names))
            for k, (first, second) in enumerate(zip(kept, checked, strict=True)):
                for name in names:
                    for batch, fast in ((first, k > 0 and halo == 0), (second, False)):
                        local, padded = batch[name]._local_tensor, batch.padded[name]
                        assert (local is padded) == fast
                        assert local.data_ptr() == padded[(slice(None), *dec.interior(ctx.rank))].data_ptr()
                        assert np.array_equal(local.numpy(),
                                              full[name][list(batch.samples)][(slice(None), *dec.box(ctx.rank))])
                    assert first[name]._spec == second[name]._spec
            del kept, checked, first, second, batch, local, padded
