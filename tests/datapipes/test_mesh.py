"""Mesh preparation and the mesh reader in one process."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from datapipes import DataPipeError, DecompositionError, MeshSource, Split, prepare_mesh
from datapipes.mesh import load_mesh_input
from datapipes.prepare_cli import main as prepare_main
from datapipes.synthetic import point_cloud, write_mesh_input


def _rows(points: np.ndarray) -> list[tuple]:
    return [tuple(r) for r in points.round(6)]


def _triangles(points: np.ndarray, cells: np.ndarray) -> set:
    """Each cell as a set of its points' coordinates: independent of the point numbering."""
    return {frozenset(map(tuple, points[c].round(6))) for c in cells}


@pytest.mark.parametrize("curve", ["hilbert", "morton"])
def test_prepare_reorders_points_and_renumbers_cells_consistently(curve, tmp_path):
    mesh = point_cloud(400, kind="surface", seed=3)
    path = prepare_mesh(tmp_path / "m.h5", mesh.points, mesh.fields, mesh.cells, curve=curve)
    with h5py.File(path) as f:
        points, cells, owner = f["points"][()], f["cells"][()], f["cell_owner"][()]
        pressure = f["fields/pressure"][()]
        assert f.attrs["curve"] == curve and f.attrs["num_cells"] == len(mesh.cells)
    assert sorted(_rows(points)) == sorted(_rows(mesh.points))
    by_point = dict(zip(_rows(mesh.points), mesh.fields["pressure"]))
    assert np.array_equal(pressure, [by_point[k] for k in _rows(points)])
    assert _triangles(points, cells) == _triangles(mesh.points, mesh.cells)
    assert np.array_equal(owner, cells.min(axis=1)) and (np.diff(owner) >= 0).all()


@pytest.mark.parametrize("via", ["arrays", "vtu"])
def test_reader_ranges_are_contiguous_uneven_and_cells_follow_their_owner(via, tmp_path):
    mesh = point_cloud(500, kind="surface", seed=1)
    if via == "vtu":  # the same mesh through a solver's file format (meshio), with its cell types
        pytest.importorskip("meshio")
        from datapipes.mesh_formats import CELL_TYPES, MeshArrays, write_mesh

        types = np.full(len(mesh.cells), CELL_TYPES["triangle"], np.uint8)
        vtu = write_mesh(tmp_path / "m.vtu", MeshArrays(mesh.points, mesh.fields, mesh.cells, types))
        path = prepare_mesh(tmp_path / "m.h5", vtu)
    else:
        path = prepare_mesh(tmp_path / "m.h5", mesh.points, mesh.fields, mesh.cells)
    source = MeshSource(path)
    typed = {"cell_type"} if via == "vtu" else set()
    assert set(source.variables) == {"points", "pressure", "normal", "cells"} | typed
    with h5py.File(path) as f:
        owner = f["cell_owner"][()]
    n = source.num_points(0)
    for parts in (1, 3, 4):
        decs = source.decompose(0, (parts,), Split())
        sizes = decs["points"].sizes[0]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
        for rank in range(parts):
            start, stop = decs["points"].box(rank)[0].start, decs["points"].box(rank)[0].stop
            cell_box = decs["cells"].box(rank)[0]
            assert ((owner[cell_box] >= start) & (owner[cell_box] < stop)).all()
        assert sum(decs["cells"].sizes[0]) == len(owner)
        assert decs["normal"].global_shape == (n, 3)


def test_reader_errors(tmp_path):
    mesh = point_cloud(50, kind="volume")
    path = prepare_mesh(tmp_path / "v.h5", mesh.points, mesh.fields)
    source = MeshSource(path, ["temperature"])
    assert source.variables == ("points", "temperature")
    with pytest.raises(DecompositionError, match="1-D domain mesh"):
        source.decompose(0, (2, 2), Split())
    with pytest.raises(DecompositionError, match="split_dims, halo and sizes do not apply"):
        source.decompose(0, (2,), Split(halo=1))
    with pytest.raises(DecompositionError, match="50 points cannot be split over 64 ranks"):
        source.decompose(0, (64,), Split())
    with pytest.raises(Exception, match=r"v.h5: no dataset /fields/nope \(variable 'nope'\)"):
        MeshSource(path, ["nope"])
    with h5py.File(tmp_path / "raw.h5", "w") as f:
        f["points"] = mesh.points
    with pytest.raises(DataPipeError, match="raw.h5 is not a prepared mesh"):
        MeshSource(tmp_path / "raw.h5")


def test_prepare_rejects_bad_input(tmp_path):
    points = np.random.default_rng(0).random((10, 3))
    with pytest.raises(DataPipeError, match=r"field 'p' has shape \(9,\); a per-point field needs 10 rows"):
        prepare_mesh(tmp_path / "x.h5", points, {"p": np.zeros(9)})
    with pytest.raises(DataPipeError, match=r"cells reference point indices in \[0, 10\]"):
        prepare_mesh(tmp_path / "x.h5", points, cells=np.array([[0, 1, 10]]))
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary file


def test_command_line_prepares_several_inputs_with_progress(tmp_path, capsys):
    inputs = [write_mesh_input(tmp_path / f"raw{i}.npz", point_cloud(200, seed=i)) for i in range(2)]
    assert prepare_main([*map(str, inputs), "-o", str(tmp_path / "out"), "--curve", "morton"]) == 0
    assert "100%" in capsys.readouterr().err  # tqdm's bars
    source = MeshSource(tmp_path / "out" / "*.h5")
    assert len(source) == 2
    points, fields, cells = load_mesh_input(inputs[1])
    assert source.num_points(1) == len(points) and cells is not None and set(fields) == {"pressure", "normal"}
    with pytest.raises(SystemExit) as info:
        prepare_main(["--help"])
    assert info.value.code == 0 and "space-filling curve" in capsys.readouterr().out
    assert prepare_main([str(tmp_path / "missing.npz"), "-o", str(tmp_path / "m.h5"), "-q"]) == 1
    assert "missing.npz: no such file" in capsys.readouterr().err
