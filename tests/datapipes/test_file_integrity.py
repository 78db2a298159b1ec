"""A data file that changes under a run, or bytes that changed after writing, raise instead of reading wrong.

Without these checks, a file truncated while a pipe reads it came back as
zeros (HDF5 fills a read past the end of a file with zeros), a file copied or
renamed over it gave the other file's finite values, and a flipped byte gave
a wrong finite value: all silently. Each test here fails that way on the
code before the checks (no error is raised).
"""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist

from datapipes import (ChecksumError, DataPipeError, DomainPipe, FileChangedError, HDF5Fields, MissingDataError,
                       check_all_ranks, write_shards)
from datapipes._buffers import ArraySpec
from datapipes.prefetch import ReadTask, fill
from datapipes.synthetic import write_hdf5, write_netcdf
from physicsnemo_dp import ShardTensor
from tests._harness import distributed

from ._data import N_SAMPLES, RESOLUTION, VARIABLES, grid_fields, open_grid, write_grid

_FULL = (slice(0, RESOLUTION), slice(0, RESOLUTION))
_READERS = [pytest.param("thread", 0, id="prefetch0"), pytest.param("thread", 2, id="thread"),
            pytest.param("process", 2, id="process")]


def _age(path) -> None:
    """Date the file back a minute: a later rewrite then has another mtime whatever the clock's granularity."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 60_000_000_000))


def _other(tmp_path, fmt: str):
    """A file of the same format and shapes with other values (what a replacement looks like)."""
    fields = {name: np.flip(v, axis=0).copy() + 1.0 for name, v in grid_fields().items()}
    return write_grid(fmt, tmp_path / "other", fields)


def _change(path, how: str, tmp_path, fmt: str) -> None:
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "copy over":  # same inode, same size: only the mtime tells
        shutil.copyfile(_other(tmp_path, fmt), path)
    elif how == "rename over":  # another inode at the same path (what an atomic rewrite does)
        os.replace(_other(tmp_path, fmt), path)
    else:
        raise ValueError(how)


def _read_all(pipe) -> list:
    return [{name: t.to_local().clone() for name, t in batch.items()} for batch in pipe]


@pytest.mark.parametrize("workers,prefetch", _READERS)
@pytest.mark.parametrize("fmt,how", [("hdf5", "truncate"), ("hdf5", "copy over"), ("hdf5", "rename over"),
                                     ("hdf5-chunked", "truncate"), ("netcdf", "truncate"), ("netcdf", "copy over")])
@distributed(world_sizes=(1,), mesh_2d=False, timeout=120)
def test_a_file_changed_while_a_pipe_reads_it_raises_naming_the_file(ctx, fmt, workers, prefetch, how, tmp_path):
    path = write_grid(fmt, tmp_path)
    _age(path)
    source = open_grid(fmt, path)
    with DomainPipe(source, ctx.mesh, shuffle=False, prefetch=prefetch, workers=workers,
                    adaptive_prefetch=False) as pipe:
        batches = iter(pipe)
        first = next(batches)
        assert np.array_equal(first["pressure"].to_local()[0].numpy(), grid_fields()["pressure"][0])
        _change(path, how, tmp_path, fmt)
        with pytest.raises(FileChangedError) as raised:
            for _ in batches:
                pass
    message = str(raised.value)
    assert str(path) in message and "changed while it was being read" in message
    expected = {"truncate": "(truncated)", "copy over": "modified at", "rename over": "replaced by another file"}
    assert expected[how] in message


@pytest.mark.parametrize("fmt", ["hdf5", "netcdf"])
@distributed(world_sizes=(1,), mesh_2d=False, timeout=120)
def test_a_reader_process_that_opens_a_replaced_file_raises(ctx, fmt, tmp_path):
    """The source is built, then the file is replaced, then the reader process (forked later) opens it."""
    path = write_grid(fmt, tmp_path)
    source = open_grid(fmt, path)
    _change(path, "rename over", tmp_path, fmt)
    with DomainPipe(source, ctx.mesh, shuffle=False, prefetch=1, workers="process", adaptive_prefetch=False) as pipe:
        with pytest.raises(FileChangedError, match="replaced by another file") as raised:
            _read_all(pipe)
    assert "reopening it" in str(raised.value) and str(path) in str(raised.value)


def _flip_byte(path, name: str, sample: int) -> None:
    """Flip one bit inside sample ``sample``'s data of dataset ``name`` (keeping size and mtime)."""
    with h5py.File(path, "r") as f:
        dset = f[name]
        if dset.chunks is None:
            offset = dset.id.get_offset() + sample * dset[0].nbytes
        else:
            offset = dset.id.get_chunk_info_by_coord((sample, *[0] * (dset.ndim - 1))).byte_offset
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset + 37)
        byte = fh.read(1)[0]
        fh.seek(offset + 37)
        fh.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _read_sample(source, index: int, name: str = "pressure") -> np.ndarray:
    out = np.empty((RESOLUTION, RESOLUTION), np.float32)
    source.read(index, name, _FULL, out)
    return out


def test_a_flipped_byte_in_a_checksummed_file_raises_naming_file_variable_and_sample(tmp_path):
    path = write_hdf5(tmp_path / "data.h5", grid_fields(), checksums=True)[0]
    _flip_byte(path, "pressure", 3)
    source = HDF5Fields(path, VARIABLES)
    for index in (0, 2, 4):  # other samples' chunks verify
        assert np.array_equal(_read_sample(source, index), grid_fields()["pressure"][index])
    with pytest.raises(ChecksumError) as raised:
        _read_sample(source, 3)
    message = str(raised.value)
    assert "variable 'pressure' of sample 3" in message and str(path) in message and "Fletcher-32" in message
    # the opt-out reads the damaged bytes as they are (to measure the check's cost, or to salvage)
    unchecked = _read_sample(HDF5Fields(path, VARIABLES, verify_checksums=False), 3)
    assert not np.array_equal(unchecked, grid_fields()["pressure"][3])


def test_a_file_without_checksums_still_reads_and_a_flipped_byte_goes_unseen(tmp_path):
    """What checksums buy: the same damage in a file written without them is read as a wrong value."""
    path = write_hdf5(tmp_path / "plain.h5", grid_fields(), checksums=False)[0]
    with h5py.File(path) as f:
        assert f["pressure"].chunks is None  # contiguous
    _flip_byte(path, "pressure", 3)
    got = _read_sample(HDF5Fields(path, VARIABLES), 3)
    assert not np.array_equal(got, grid_fields()["pressure"][3])


def test_a_flipped_byte_in_a_checksummed_netcdf_file_raises(tmp_path):
    path = write_netcdf(tmp_path / "data.nc", grid_fields(), checksums=True)
    with h5py.File(path, "r") as f:
        assert f["pressure"].fletcher32
    _flip_byte(path, "pressure", 2)
    source = open_grid("netcdf", path)
    assert np.array_equal(_read_sample(source, 1), grid_fields()["pressure"][1])
    with pytest.raises(DataPipeError, match=rf"'pressure' at sample=2 of {path}"):
        _read_sample(source, 2)


def _fill_task(index: int) -> tuple[ReadTask, bytearray]:
    arrays = (ArraySpec("pressure", 0, (1, RESOLUTION, RESOLUTION), "float32"),)
    return ReadTask(1, None, arrays, (index,), ({"pressure": _FULL},)), bytearray(RESOLUTION * RESOLUTION * 4)


def test_datasets_swapped_in_place_keeping_size_and_mtime_are_caught_by_their_headers_at_reopen(tmp_path):
    """Renaming datasets inside the file keeps its size, inode and (restored) mtime; the headers tell."""
    path = write_hdf5(tmp_path / "a.h5", grid_fields(), checksums=False)[0]
    source = HDF5Fields(path, VARIABLES)
    st = os.stat(path)
    with h5py.File(path, "r+") as f:  # 'pressure' now holds the permeability: same shape and dtype
        f.move("pressure", "swap")
        f.move("permeability", "pressure")
        f.move("swap", "permeability")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_size, now.st_ino, now.st_mtime_ns) == (st.st_size, st.st_ino, st.st_mtime_ns)
    with pytest.raises(FileChangedError, match=r"variable 'pressure' of sample 0 .*storage offset"):
        _read_sample(source, 0)


def test_unwritten_storage_and_missing_virtual_sources_are_refused_when_the_source_is_built(tmp_path):
    """HDF5 reads the fill value (zeros, or NaN for a virtual dataset) where data was never written."""
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("permeability", data=grid_fields()["permeability"])
        f.create_dataset("pressure", shape=(N_SAMPLES, RESOLUTION, RESOLUTION), dtype=np.float32)  # never written
    with pytest.raises(DataPipeError, match=r"empty.h5:/pressure: the dataset's data was never written"):
        HDF5Fields(path, VARIABLES)
    with h5py.File(path, "w") as f:
        f.create_dataset("permeability", data=grid_fields()["permeability"])
        dset = f.create_dataset("pressure", shape=(N_SAMPLES, RESOLUTION, RESOLUTION), dtype=np.float32,
                                chunks=(1, RESOLUTION, RESOLUTION))
        dset[:4] = 1.0  # two samples' chunks never written
    with pytest.raises(DataPipeError, match=r"2 of 6 chunks of the dataset were never written"):
        HDF5Fields(path, VARIABLES)
    part = tmp_path / "part.h5"
    write_hdf5(part, grid_fields())
    virtual = tmp_path / "virtual.h5"
    with h5py.File(virtual, "w", libver="latest") as f:
        for name in VARIABLES:
            layout = h5py.VirtualLayout(shape=(N_SAMPLES, RESOLUTION, RESOLUTION), dtype=np.float32)
            layout[:] = h5py.VirtualSource("part.h5", name, shape=(N_SAMPLES, RESOLUTION, RESOLUTION))
            f.create_virtual_dataset(name, layout, fillvalue=np.nan)
    assert np.array_equal(_read_sample(HDF5Fields(virtual, VARIABLES), 5), grid_fields()["pressure"][5])
    part.unlink()
    with pytest.raises(MissingDataError, match=r"maps part.h5, which does not exist"):
        HDF5Fields(virtual, VARIABLES)


def test_a_truncated_part_file_of_a_virtual_dataset_raises_at_the_next_batch(tmp_path):
    """The virtual file itself is unchanged: its mapped files are watched too (else NaN fill values)."""
    part = tmp_path / "part.h5"
    write_hdf5(part, grid_fields())
    virtual = tmp_path / "virtual.h5"
    with h5py.File(virtual, "w", libver="latest") as f:
        for name in VARIABLES:
            layout = h5py.VirtualLayout(shape=(N_SAMPLES, RESOLUTION, RESOLUTION), dtype=np.float32)
            layout[:] = h5py.VirtualSource("part.h5", name, shape=(N_SAMPLES, RESOLUTION, RESOLUTION))
            f.create_virtual_dataset(name, layout, fillvalue=np.nan)
    source = HDF5Fields(virtual, VARIABLES)
    task, memory = _fill_task(1)
    fill(source, task, memory, (), False)
    os.truncate(part, os.path.getsize(part) // 2)
    with pytest.raises(FileChangedError, match=rf"{part}: .*\(truncated\)"):
        fill(source, task, memory, (), False)


# --------------------------------------------------------------------------- #
# Every rank raises
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("workers,prefetch", [("thread", 2), ("process", 1)])
@distributed(world_sizes=(2, 3), mesh_2d=False, timeout=120)
def test_a_file_truncated_under_a_run_is_raised_on_every_rank_naming_it(ctx, workers, prefetch, tmp_path):
    path = [write_grid("hdf5", tmp_path) if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    path = path[0]
    source = open_grid("hdf5", path)
    with DomainPipe(source, ctx.mesh, shuffle=False, workers=workers, prefetch=prefetch,
                    adaptive_prefetch=False) as pipe:
        batches = iter(pipe)
        with pytest.raises(FileChangedError) as raised:
            for step in range(len(pipe)):
                try:
                    error, _batch = None, next(batches)
                except Exception as err:
                    error = err
                check_all_ranks(error, ctx.mesh)
                dist.all_reduce(torch.ones(1))  # the step's first collective: reached only when all agree
                if step == 0:
                    if ctx.rank == 0:
                        os.truncate(path, os.path.getsize(path) // 2)
                    dist.barrier()
    message = str(raised.value)
    assert "failed, so every rank stops here" in message
    assert f"{path}: the file changed while it was being read" in message and "(truncated)" in message


@distributed(world_sizes=(2,), mesh_2d=False, timeout=120)
def test_write_shards_part_files_carry_checksums(ctx, tmp_path):
    out = [tmp_path / "out.h5" if ctx.rank == 0 else None]
    dist.broadcast_object_list(out, src=0)
    full = torch.arange(4 * 16 * 8, dtype=torch.float32).reshape(4, 16, 8)
    local = full.chunk(ctx.world_size, dim=1)[ctx.rank].contiguous()
    st = ShardTensor.from_local(local, ctx.mesh, [torch.distributed.tensor.Shard(1)])
    path = write_shards(out[0], {"u": st}, checksums=True)
    dist.barrier()
    if ctx.rank == 0:
        with h5py.File(path.with_name(f"{path.name}.parts") / "rank00001.h5") as f:
            assert f["u"].fletcher32 and f["u"].chunks is not None
        _flip_byte(path.with_name(f"{path.name}.parts") / "rank00001.h5", "u", 2)
        source = HDF5Fields(path, ["u"])
        out_array = np.empty((16, 8), np.float32)
        source.read(1, "u", (slice(0, 16), slice(0, 8)), out_array)
        assert np.array_equal(out_array, full[1].numpy())
        with pytest.raises(ChecksumError, match=r"variable 'u' of sample 2"):
            source.read(2, "u", (slice(0, 16), slice(0, 8)), out_array)
    dist.barrier()
