"""Readers in one process: every format returns exactly the requested box, errors name the culprit."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import xarray as xr

from datapipes import DataPipeError, DomainDecomposition, HDF5Fields, MissingDataError, Split, XarrayFields, aligned_chunks
from datapipes.synthetic import write_hdf5, write_netcdf

from ._data import GRID_FORMATS, VARIABLES, grid_fields, open_grid, write_grid

BOX = (slice(3, 9), slice(5, 16))


@pytest.mark.parametrize("fmt", GRID_FORMATS)
def test_every_format_reads_exactly_the_box(fmt, tmp_path):
    fields = grid_fields()
    source = open_grid(fmt, write_grid(fmt, tmp_path))
    assert len(source) == 6 and source.sample_shape == (16, 16) and source.variables == VARIABLES
    for index in (0, 5):
        for name in VARIABLES:
            out = np.empty((6, 11), source.dtype(name))
            nbytes = source.read(index, name, BOX, out)
            assert np.array_equal(out, fields[name][index][BOX])
            assert nbytes == out.nbytes
            assert f"'{name}'" in source.where(index, name)
    source.close()


@pytest.mark.parametrize("fmt", ["hdf5", "hdf5-groups"])
def test_hdf5_boxes_the_fast_path_does_not_cover_behave_like_read_direct(fmt, tmp_path):
    fields = grid_fields()
    source = open_grid(fmt, write_grid(fmt, tmp_path))
    stepped = (slice(0, 16, 2), slice(5, 16))
    out = np.empty((8, 11), np.float32)
    source.read(4, "pressure", stepped, out)
    assert np.array_equal(out, fields["pressure"][4][stepped])
    source.read(2, "pressure", BOX, np.empty((6, 11), np.float32))  # caches the box's dataspaces
    with h5py.File(next(iter(source.paths)), "r") as f:  # a buffer of another shape: read_direct's error
        dset = f["pressure"] if fmt == "hdf5" else f[sorted(f)[2]]["pressure"]
        with pytest.raises(TypeError) as expected:
            dset.read_direct(np.empty((5, 11), np.float32), source_sel=(2, *BOX) if fmt == "hdf5" else BOX)
    with pytest.raises(TypeError) as got:
        source.read(2, "pressure", BOX, np.empty((5, 11), np.float32))
    assert str(got.value) == str(expected.value)
    source.close()


@pytest.mark.parametrize("fmt", ["hdf5", "hdf5-groups"])
def test_hdf5_reads_of_one_box_object_follow_each_buffer_and_make_one_memory_type_per_dtype(fmt, tmp_path, monkeypatch):
    """The reader recognises the box read last by identity and keeps one memory type per buffer dtype: reads that
    alternate buffers of other dtypes and shapes, boxes equal but not identical, and samples, still return exactly
    what read_direct returns, converted to the buffer's dtype."""
    fields = grid_fields()
    source = open_grid(fmt, write_grid(fmt, tmp_path))
    made = []
    create = h5py.h5t.py_create
    monkeypatch.setattr(h5py.h5t, "py_create", lambda dtype, *a, **k: made.append(np.dtype(dtype)) or create(dtype, *a, **k))
    same = (slice(3, 9), slice(5, 16))
    reads = [(0, BOX, np.float32), (1, BOX, np.float64), (0, same, np.float32), (1, BOX, np.float64),
             (0, BOX, np.float32), (1, (slice(0, 16), slice(0, 16)), np.float32), (0, BOX, np.float64)]  # fmt: skip
    for index, box, dtype in reads:
        out = np.full(tuple(s.stop - s.start for s in box), np.nan, dtype)
        source.read(index, "pressure", box, out)
        assert np.array_equal(out, fields["pressure"][index][box].astype(dtype)), (index, dtype)
    # one per dataset (a group's sample is a dataset of its own) and dtype, not one per read
    datasets = {(index if fmt == "hdf5-groups" else 0, np.dtype(dtype)) for index, _, dtype in reads}
    assert len(made) == len(datasets) and set(made) == {np.dtype(np.float32), np.dtype(np.float64)}
    source.close()


def test_stacked_files_are_concatenated_and_dtype_converts_on_read(tmp_path):
    fields = grid_fields()
    write_hdf5(tmp_path / "a.h5", {k: v[:4] for k, v in fields.items()})
    write_hdf5(tmp_path / "b.h5", {k: v[4:] for k, v in fields.items()})
    source = HDF5Fields(tmp_path / "*.h5", ["pressure"], dtype=np.float64)
    assert len(source) == 6 and source.dtype("pressure") == np.float64
    out = np.empty((16, 16))
    source.read(5, "pressure", (slice(0, 16), slice(0, 16)), out)
    assert np.array_equal(out, fields["pressure"][5].astype(np.float64))
    assert "b.h5:/pressure[1]" in source.where(5, "pressure")


def test_grid_decomposition_is_shared_by_the_variables(tmp_path):
    source = open_grid("hdf5", write_grid("hdf5", tmp_path))
    decs = source.decompose(0, (3,), Split(split_dims=(1,), halo=1))
    assert set(decs) == set(VARIABLES)
    dec = decs["pressure"]
    assert dec.split_dims == (1,) and dec.sizes == ((6, 6, 4),) and dec.halo == (1,)
    assert "stacked.h5" in dec.label


def test_xarray_selections_and_local_coordinates(tmp_path):
    fields = grid_fields()
    path = write_netcdf(tmp_path / "d.nc", fields, dims=("time", "lat", "lon"))
    source = XarrayFields(path, ["pressure"], sample_dim="time", dims=("lon", "lat"),
                          isel={"time": slice(1, 5)}, sel={"lat": slice(0.2, 0.8)})
    assert len(source) == 4
    lat = np.linspace(0, 1, 16)
    rows = np.flatnonzero((lat >= 0.2) & (lat <= 0.8))
    assert source.sample_shape == (16, len(rows))  # (lon, lat): transposed as asked
    out = np.empty((16, 3), np.float32)
    source.read(2, "pressure", (slice(0, 16), slice(1, 4)), out)
    assert np.array_equal(out, fields["pressure"][3][rows[1:4]].T)
    coords = source.coords((slice(0, 16), slice(1, 4)))
    assert np.allclose(coords["lat"], lat[rows[1:4]]) and len(coords["lon"]) == 16


@pytest.mark.parametrize("fmt,wrapper", [("netcdf", xr.backends.netCDF4_.NetCDF4ArrayWrapper),
                                         ("zarr", xr.backends.zarr.ZarrArrayWrapper)])
def test_xarray_reads_only_the_box_from_the_backend(fmt, wrapper, tmp_path, monkeypatch):
    source = open_grid(fmt, write_grid(fmt, tmp_path))
    source.read(0, "pressure", BOX, np.empty((6, 11), np.float32))  # opens the file: coordinates load here
    fetched = []
    original = wrapper._getitem

    def recording(self, key):
        values = original(self, key)
        fetched.append(np.asarray(values).size)
        return values

    monkeypatch.setattr(wrapper, "_getitem", recording)
    source.read(4, "pressure", BOX, np.empty((6, 11), np.float32))
    assert fetched == [6 * 11]
    source.close()


def test_aligned_chunks_fall_on_shard_boundaries():
    dec = DomainDecomposition((1024, 64), (4,))
    assert aligned_chunks(dec, itemsize=4) == (1, 256, 64)
    small = aligned_chunks(dec, itemsize=4, max_bytes=16 << 10)
    assert 256 % small[1] == 0 and small[1] * small[2] * 4 <= 16 << 10
    uneven = DomainDecomposition((10, 8), (3,))  # boundaries 4 and 8
    assert aligned_chunks(uneven, itemsize=4, leading=())[0] == 4
    assert aligned_chunks(DomainDecomposition((9, 8), (3,), sizes=[(3, 3, 3)]), itemsize=8)[1] == 3


# ---------------------------------------------------------------------------- errors
def test_missing_file_and_pattern(tmp_path):
    with pytest.raises(MissingDataError, match="nothere.h5: no such file"):
        HDF5Fields(tmp_path / "nothere.h5", ["p"])
    with pytest.raises(MissingDataError, match="matches no file"):
        HDF5Fields(tmp_path / "*.h5", ["p"])
    with pytest.raises(MissingDataError, match="no such file or store"):
        XarrayFields(tmp_path / "x.nc", ["p"])


def test_missing_variable_names_file_and_alternatives(tmp_path):
    path = write_grid("hdf5", tmp_path)
    with pytest.raises(MissingDataError, match=r"stacked.h5: no variable 'velocity' .*\['permeability', 'pressure'\]"):
        HDF5Fields(path, ["pressure", "velocity"])
    nc = write_grid("netcdf", tmp_path)
    with pytest.raises(MissingDataError, match=r"data.nc: no variable\(s\) \['velocity'\]"):
        XarrayFields(nc, ["velocity"], sample_dim="sample")


def test_inconsistent_shapes_across_samples_name_both_shapes(tmp_path):
    fields = grid_fields()
    write_hdf5(tmp_path / "a.h5", fields)
    write_hdf5(tmp_path / "b.h5", {k: v[:, :8] for k, v in fields.items()})
    with pytest.raises(DataPipeError, match=r"b.h5:/permeability \(shape \(6, 8, 16\)\) has shape \(8, 16\).*\(16, 16\)"):
        HDF5Fields([tmp_path / "a.h5", tmp_path / "b.h5"], VARIABLES)
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["a"] = np.zeros((3, 4))
        f["b"] = np.zeros((2, 4))
    with pytest.raises(DataPipeError, match=r"c.h5: dataset 'b' has shape \(2, 4\).*same leading sample dim \(3"):
        HDF5Fields(tmp_path / "c.h5", ["a", "b"])


def test_group_layout_errors(tmp_path):
    path = write_grid("hdf5-groups", tmp_path)
    with pytest.raises(MissingDataError, match=r"no sample group\(s\) \['nope'\]"):
        HDF5Fields(path, VARIABLES, layout="groups", groups=["sample_00000", "nope"])
    with pytest.raises(DataPipeError, match="is a group, not a dataset"):
        HDF5Fields(path, ["sample_00000"], layout="files")


def test_xarray_variables_with_other_dims_are_rejected(tmp_path):
    fields = grid_fields()
    path = tmp_path / "mixed.nc"
    write_netcdf(path, fields)
    with xr.open_dataset(path) as ds:
        mixed = ds.load().assign(extra=(("sample", "x"), np.zeros((6, 16))))
    mixed.to_netcdf(tmp_path / "mixed2.nc")
    with pytest.raises(DataPipeError, match=r"variable 'extra' has dims \('sample', 'x'\)"):
        XarrayFields(tmp_path / "mixed2.nc", ["pressure", "extra"], sample_dim="sample")
