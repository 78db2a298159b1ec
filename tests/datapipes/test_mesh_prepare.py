"""Preparation out of core and on many ranks gives the file of the in-memory preparation, dataset for dataset.

The per-rank peak memory at P = 4 is checked here on a small mesh; the
benchmark measures it at P = 1, 2, 4 on a larger one:
``python -m benchmarks.mesh_prepare --points 200000 --out outputs/mesh_prepare``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path


import h5py
import numpy as np
import pytest
import torch.distributed as dist

from datapipes import DataPipeError, DomainPipe, MeshSource, prepare_mesh
from datapipes.decomposition import balanced_sizes
from datapipes.mesh import parse_memory
from datapipes.mesh_formats import CELL_TYPES, MeshArrays, write_mesh, write_pvtu
from datapipes.prepare_cli import main as prepare_main
from datapipes.synthetic import obstacle_mesh
from tests._harness import distributed

pytest.importorskip("meshio")

#: the obstacle mesh's pieces repeat the nodes they share, as a solver's .pvtu does
SHARED_NODES = {"allow_duplicate_points": True}


def _content(path) -> dict:
    """Attributes and every dataset (dtype, values) of a prepared file."""
    out = {}
    with h5py.File(path) as f:
        out["attrs"] = {k: np.asarray(v).tolist() for k, v in f.attrs.items()}
        f.visititems(lambda name, obj: out.__setitem__(name, (obj.dtype, obj[()]))
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _assert_same(a, b) -> None:
    first, second = _content(a), _content(b)
    assert first.keys() == second.keys()
    assert first.pop("attrs") == second.pop("attrs")
    for name, (dtype, values) in first.items():
        assert dtype == second[name][0], name
        assert np.array_equal(values, second[name][1]), name


def _mixed_pieces(n_points: int, count: int = 4) -> list[MeshArrays]:
    """Obstacle-mesh pieces; the last piece's cells become triangles, so widths differ between pieces."""
    pieces = obstacle_mesh(n_points, pieces=count, seed=1)
    third = pieces[-1]
    third.cells = np.ascontiguousarray(third.cells[:, :3])
    third.cell_types = np.full(len(third.cells), CELL_TYPES["triangle"], np.uint8)
    return pieces


def _write_input(directory: Path, kind: str, n_points: int = 1500, count: int = 4) -> Path:
    if kind == "pvtu-2":  # fewer pieces than ranks: some ranks read nothing
        kind, count = "pvtu", 2
    pieces = _mixed_pieces(n_points, count)
    if kind == "pvtu":
        return write_pvtu(directory / "in.pvtu", pieces)
    from datapipes.mesh_formats import _concat

    offsets = np.cumsum([0, *(len(p.points) for p in pieces)])
    for piece, offset in zip(pieces, offsets):
        piece.cells = np.where(piece.cells >= 0, piece.cells + offset, -1)
    whole = _concat(pieces, "test")
    if kind == "h5":
        with h5py.File(directory / "in.h5", "w") as f:
            f["points"], f["cells"], f["cell_types"] = whole.points, whole.cells, whole.cell_types
            for k, v in whole.point_data.items():
                f[f"fields/{k}"] = v
            for k, v in whole.cell_data.items():
                f[f"cell_fields/{k}"] = v
        return directory / "in.h5"
    return write_mesh(directory / f"in.{kind}", whole, binary=True)


def _mesh_bytes(path) -> int:
    with h5py.File(path) as f:
        sizes = []
        f.visititems(lambda _, obj: sizes.append(obj.nbytes) if isinstance(obj, h5py.Dataset) else None)
    return sum(sizes)


@pytest.mark.parametrize("kind, curve", [("pvtu", "hilbert"), ("h5", "morton"), ("vtu", "hilbert")])
def test_out_of_core_equals_in_memory(kind, curve, tmp_path):
    source = _write_input(tmp_path, kind, count=16)
    reference = prepare_mesh(tmp_path / "ref.h5", source, curve=curve, **SHARED_NODES)
    budget = _mesh_bytes(reference) // (2 if kind == "pvtu" else 8)  # the budget must hold a piece twice
    chunked = prepare_mesh(tmp_path / "ooc.h5", source, curve=curve, max_memory=budget, **SHARED_NODES)
    _assert_same(reference, chunked)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temporary files removed


def test_out_of_core_from_arrays_and_the_command_line(tmp_path, capsys):
    rng = np.random.default_rng(0)
    points, cells = rng.random((3000, 3)), rng.integers(0, 3000, (5000, 4))
    fields, cell_fields = {"p": rng.random(3000).astype(np.float32)}, {"q": rng.random((5000, 2))}
    reference = prepare_mesh(tmp_path / "ref.h5", points, fields, cells, cell_fields=cell_fields)
    chunked = prepare_mesh(tmp_path / "ooc.h5", points, fields, cells, cell_fields=cell_fields, max_memory="50kB")
    _assert_same(reference, chunked)
    source = _write_input(tmp_path, "pvtu", 800)
    assert prepare_main([str(source), "-o", str(tmp_path / "cli.h5"), "--max-memory", "1MiB",
                        "--allow-duplicate-points"]) == 0
    assert "sort cells" in capsys.readouterr().err  # the progress bar names the phases
    _assert_same(prepare_mesh(tmp_path / "ref2.h5", source, **SHARED_NODES), tmp_path / "cli.h5")
    assert parse_memory("4GB") == 4 * 10**9 and parse_memory("512MiB") == 512 * 2**20 and parse_memory(10) == 10
    with pytest.raises(DataPipeError, match="max_memory='lots'"):
        prepare_mesh(tmp_path / "x.h5", source, max_memory="lots")
    with pytest.raises(DataPipeError, match=r"in.pvtu: max_memory=1000 bytes is too small for its largest piece"):
        prepare_mesh(tmp_path / "x.h5", source, max_memory=1000, **SHARED_NODES)


@pytest.mark.parametrize("kind", ["pvtu", "h5", "vtu", "pvtu-2"])
@distributed(world_sizes=(2, 3, 4), mesh_2d=False, timeout=120)
def test_many_ranks_equal_one_process(ctx, kind, tmp_path):
    """Every rank reads a part (pvtu pieces, HDF5 rows; a .vtu is read by rank 0 and sent out)."""
    if kind == "pvtu-2" and ctx.world_size == 2:
        pytest.skip("2 pieces on 2 ranks is the pvtu case")
    source = [None]
    if ctx.rank == 0:
        source = [_write_input(tmp_path, kind)]
        prepare_mesh(tmp_path / "ref.h5", source[0], **SHARED_NODES)
    dist.broadcast_object_list(source, src=0)
    path = prepare_mesh(tmp_path / "dist.h5", source[0], group=dist.group.WORLD, **SHARED_NODES)
    if ctx.rank == 0:
        _assert_same(tmp_path / "ref.h5", path)
        assert MeshSource(path).variables == ("points", "pressure", "velocity", "cells", "cell_type", "volume")
    dist.barrier()


@distributed(world_sizes=(3,), mesh_2d=False, timeout=120)
def test_bad_input_fails_on_every_rank(ctx, tmp_path):
    if ctx.rank == 0:
        with h5py.File(tmp_path / "bad.h5", "w") as f:
            f["points"], f["cells"] = np.random.default_rng(0).random((30, 3)), np.full((9, 3), 30)
    dist.barrier()
    with pytest.raises(DataPipeError, match=r"bad.h5: cells reference point indices in \[30, 30\]"):
        prepare_mesh(tmp_path / "out.h5", tmp_path / "bad.h5", group=dist.group.WORLD)
    with pytest.raises(DataPipeError, match="no such file"):
        prepare_mesh(tmp_path / "out.h5", tmp_path / "missing.vtu", group=dist.group.WORLD)
    dist.barrier()
    assert not (tmp_path / "out.h5").exists()


@distributed
def test_the_pipe_reads_prepared_vtu_meshes_with_mixed_cells(ctx, tmp_path):
    """Each rank's ShardTensors are its slices of the file; cells, cell types and cell fields by owner."""
    from datapipes.synthetic import write_obstacle_vtu

    def write():
        tmp_path.joinpath("b").mkdir()
        return [str(prepare_mesh(tmp_path / "a.h5", _write_input(tmp_path, "vtu", 500), **SHARED_NODES)),
                str(prepare_mesh(tmp_path / "b.h5", write_obstacle_vtu(tmp_path / "b" / "o.vtu", 700, pieces=1)))]

    paths = [write() if ctx.rank == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    paths = paths[0]
    size, coord = ctx.mesh_shape[-1], tuple(ctx.mesh.get_coordinate())[-1:]
    names = {"points": "points", "pressure": "fields/pressure", "velocity": "fields/velocity", "cells": "cells",
             "cell_type": "cell_type", "volume": "cell_fields/volume"}
    with DomainPipe(MeshSource(paths), ctx.mesh, shuffle=False) as pipe:
        for batch in pipe:
            (index,) = batch.samples
            with h5py.File(paths[index]) as f:
                whole = {name: f[dataset][()] for name, dataset in names.items()}
                owner = f["cell_owner"][()]
            decs = pipe.decompose(index)
            assert decs["points"].sizes == (balanced_sizes(len(whole["points"]), size),)
            for name, values in whole.items():
                st = batch[name]
                assert np.array_equal(st.to_local()[0].numpy(), values[decs[name].box(coord)]), name
                assert np.array_equal(st.full_tensor()[0].numpy(), values), name
            start = decs["points"].offsets(coord)[0]
            mine = owner[decs["cells"].box(coord)[0]]
            assert ((mine >= start) & (mine < start + batch["points"].to_local().shape[1])).all()
            cells = batch["cells"].to_local()[0].numpy()
            assert np.array_equal(np.where(cells < 0, len(whole["points"]), cells).min(axis=1), mine)


# --------------------------------------------------------------------------- #
# Bad points: refused before anything is written, naming the file, the same error on every rank
# --------------------------------------------------------------------------- #
def _bad_points(kind: str, n: int = 400) -> np.ndarray:
    """``n`` points with one defect. ``"cluster"``: two corners fix the cube, every other point lies in one
    cell of the curve (one run of equal keys, split over ranks and chunks) and points 1 and n - 1 coincide."""
    rng = np.random.default_rng(3)
    points = rng.random((n, 3))
    if kind == "nan":
        points[n // 2, 1] = np.nan
    elif kind == "inf":
        points[n // 3, 0] = -np.inf
    elif kind == "duplicate":
        points[n - 2] = points[5]
    elif kind.startswith("cluster"):
        points = 0.5 + 1e-12 * rng.random((n, 3))
        points[0], points[-2] = 0.0, 1.0
        if kind == "cluster":
            points[-1] = points[1]
    elif kind == "empty":
        points = points[:0]
    return points


BAD = {"nan": "1 point(s) have NaN or infinite coordinates, the first is input point 200 at",
       "inf": "1 point(s) have NaN or infinite coordinates, the first is input point 133 at",
       "duplicate": "input points 5 and 398 have the same coordinates",
       "cluster": "input points 1 and 399 have the same coordinates",
       "empty": "no points (an empty mesh cannot be prepared)"}


def _write_bad(directory: Path, kind: str, suffix: str) -> Path:
    points = _bad_points(kind)
    fields = {"t": np.arange(len(points), dtype=np.float32)}
    if suffix == ".h5":
        with h5py.File(directory / f"{kind}.h5", "w") as f:
            f["points"], f["fields/t"] = points, fields["t"]
        return directory / f"{kind}.h5"
    if suffix == ".pvtu":  # two pieces: the defect may be in either
        half = len(points) // 2
        return write_pvtu(directory / f"{kind}.pvtu", [MeshArrays(points[:half], {"t": fields["t"][:half]}),
                                                       MeshArrays(points[half:], {"t": fields["t"][half:]})])
    np.savez(directory / f"{kind}.npz", points=points, **fields)
    return directory / f"{kind}.npz"


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("how", ["memory", "out-of-core", "arrays"])
def test_bad_points_are_refused_naming_the_file(kind, how, tmp_path):
    source = _write_bad(tmp_path, kind, ".h5")
    where = "prepare_mesh" if how == "arrays" else str(source)
    with pytest.raises(DataPipeError) as raised:
        if how == "arrays":
            prepare_mesh(tmp_path / "out.h5", _bad_points(kind))
        else:
            prepare_mesh(tmp_path / "out.h5", source, max_memory="20kB" if how == "out-of-core" else None)
    assert str(raised.value).startswith(f"{where}: {BAD[kind]}"), raised.value
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]  # nothing written, no temporary file


def test_equal_curve_keys_without_duplicates_are_prepared(tmp_path):
    """398 points in one cell of the curve, all different: no false alarm in memory or across chunks."""
    source = _write_bad(tmp_path, "cluster-distinct", ".h5")
    _assert_same(prepare_mesh(tmp_path / "ref.h5", source),
                 prepare_mesh(tmp_path / "ooc.h5", source, max_memory="20kB"))


@distributed(world_sizes=(3,), mesh_2d=False, timeout=120)
def test_equal_curve_keys_without_duplicates_are_prepared_on_many_ranks(ctx, tmp_path):
    """The run of equal keys spans the ranks (sorted by input index within it): no false alarm at the edges."""
    source = _broadcast(_write_bad(tmp_path, "cluster-distinct", ".h5") if ctx.rank == 0 else None)
    if ctx.rank == 0:
        prepare_mesh(tmp_path / "ref.h5", source)
    prepare_mesh(tmp_path / "dist.h5", source, group=dist.group.WORLD)
    if ctx.rank == 0:
        _assert_same(tmp_path / "ref.h5", tmp_path / "dist.h5")
    dist.barrier()


def test_duplicate_points_can_be_kept_on_purpose(tmp_path):
    points = _bad_points("duplicate")
    path = prepare_mesh(tmp_path / "out.h5", points, allow_duplicate_points=True)
    with h5py.File(path) as f:
        assert f["points"].shape == points.shape
    assert prepare_main([str(_write_bad(tmp_path, "duplicate", ".npz")), "-o", str(tmp_path / "cli.h5"), "-q"]) == 1
    assert prepare_main([str(tmp_path / "duplicate.npz"), "-o", str(tmp_path / "cli.h5"), "-q",
                         "--allow-duplicate-points"]) == 0


@pytest.mark.parametrize("suffix", [".h5", ".pvtu", ".npz"])
@distributed(world_sizes=(3,), mesh_2d=False, timeout=120)
def test_bad_points_fail_on_every_rank_alike(ctx, suffix, tmp_path):
    """HDF5 rows and .pvtu pieces are read by every rank, .npz by rank 0: each defect is one message everywhere."""
    for kind in sorted(BAD):
        source = _write_bad(tmp_path, kind, suffix) if ctx.rank == 0 else None
        source = _broadcast(source)
        with pytest.raises(DataPipeError) as raised:
            prepare_mesh(tmp_path / "out.h5", source, group=dist.group.WORLD)
        message = str(raised.value)
        assert f"{source}: {BAD[kind]}" in message, message
        messages: list = [None] * ctx.world_size
        dist.all_gather_object(messages, message)
        assert messages == [message] * ctx.world_size
        assert not (tmp_path / "out.h5").exists()
    dist.barrier()


def _broadcast(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@distributed(world_sizes=(3,), mesh_2d=False, timeout=120)
def test_a_pvtu_with_a_missing_piece_fails_on_every_rank_alike(ctx, tmp_path):
    source = None
    if ctx.rank == 0:
        source = write_pvtu(tmp_path / "m.pvtu", _mixed_pieces(600, 3))
        (tmp_path / "m_1.vtu").unlink()
    source = _broadcast(source)
    with pytest.raises(DataPipeError) as raised:
        prepare_mesh(tmp_path / "out.h5", source, group=dist.group.WORLD)
    message = str(raised.value)
    assert f"{source}: 1 of its 3 pieces do not exist: ['{tmp_path / 'm_1.vtu'}']" in message, message
    messages: list = [None] * ctx.world_size
    dist.all_gather_object(messages, message)
    assert messages == [message] * ctx.world_size
    dist.barrier()


def test_a_pvtu_with_a_missing_piece_names_it_in_one_process(tmp_path):
    source = write_pvtu(tmp_path / "m.pvtu", _mixed_pieces(600, 3))
    (tmp_path / "m_2.vtu").unlink()
    for budget in (None, "1MB"):
        with pytest.raises(DataPipeError, match=re.escape(f"{source}: 1 of its 3 pieces do not exist: "
                                                          f"['{tmp_path / 'm_2.vtu'}']")):
            prepare_mesh(tmp_path / "out.h5", source, max_memory=budget)


# --------------------------------------------------------------------------- #
# The command line joins a process group only when told to (--distributed)
# --------------------------------------------------------------------------- #
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(n_points: int, n_cells: int, pieces: int, output, ranks: str = "") -> re.Pattern:
    return re.compile(rf"^prepare-mesh: {n_points} points, {n_cells} cells, {pieces} piece\(s\) read, "
                      rf"[0-9.]+ s{ranks} -> {re.escape(str(output))}$", re.M)


def test_the_command_run_by_a_torchrun_rank_prepares_in_one_process(tmp_path):
    """A training rank's subprocess inherits RANK, WORLD_SIZE, MASTER_*: without --distributed they are ignored
    (before: it joined that job's rendezvous and waited forever)."""
    source = _write_input(tmp_path, "pvtu", 800)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "datapipes.prepare_cli", str(source), "-o", str(tmp_path / "o.h5"),
                           "--allow-duplicate-points", "-q"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ignoring RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment" in done.stderr
    with h5py.File(tmp_path / "o.h5") as f:
        n_points, n_cells = f.attrs["num_points"], f.attrs["num_cells"]
    assert _summary(n_points, n_cells, 4, tmp_path / "o.h5").search(done.stdout), done.stdout


def test_joining_times_out_with_what_to_do(tmp_path, monkeypatch, capsys):
    """--distributed with no other rank: the join gives up after --join-timeout, saying why and what to do."""
    port = _free_port()
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    np.savez(tmp_path / "m.npz", points=np.random.default_rng(0).random((50, 3)))
    started = time.monotonic()
    assert prepare_main([str(tmp_path / "m.npz"), "-o", str(tmp_path / "o.h5"), "--distributed",
                         "--join-timeout", "2"]) == 1
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert f"--distributed: rank 1 of 2 could not join the process group at 127.0.0.1:{port} within " \
           "--join-timeout 2 s" in err, err
    assert "Are all ranks started" in err and not dist.is_initialized()
    monkeypatch.delenv("MASTER_PORT")
    assert prepare_main([str(tmp_path / "m.npz"), "-o", str(tmp_path / "o.h5"), "--distributed"]) == 1
    assert "--distributed: MASTER_PORT not set; start the ranks with torchrun" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


@distributed(world_sizes=(2,), mesh_2d=False, timeout=120)
def test_the_command_with_distributed_prepares_on_the_ranks(ctx, tmp_path):
    """In a process group already joined (here: the harness's), --distributed prepares on its ranks."""
    source = _broadcast(_write_input(tmp_path, "pvtu") if ctx.rank == 0 else None)
    if ctx.rank == 0:
        prepare_mesh(tmp_path / "ref.h5", source, **SHARED_NODES)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert prepare_main([str(source), "-o", str(tmp_path / "dist.h5"), "--distributed", "-q",
                             "--allow-duplicate-points"]) == 0
    assert dist.is_initialized()  # the caller's group is left alone
    if ctx.rank == 0:
        _assert_same(tmp_path / "ref.h5", tmp_path / "dist.h5")
        with h5py.File(tmp_path / "dist.h5") as f:
            n_points, n_cells = f.attrs["num_points"], f.attrs["num_cells"]
        assert _summary(n_points, n_cells, 4, tmp_path / "dist.h5", " on 2 ranks").search(out.getvalue())
    else:
        assert out.getvalue() == ""
    dist.barrier()
