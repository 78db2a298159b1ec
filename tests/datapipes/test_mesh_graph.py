"""The plate-with-hole generator and the mesh graph glue (``datapipes.mesh_graph``) against one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from datapipes import DataPipeError, DomainPipe, MeshSource, prepare_mesh
from datapipes.mesh_graph import MeshGraphCache, cell_edges, mesh_edges, mesh_graph
from datapipes.synthetic import _p1_poisson, plate_with_hole
from physicsnemo_dp import PlacementError
from tests._harness import distributed


def test_plate_is_a_valid_mesh_with_its_heat_solution():
    meshes = plate_with_hole(2, n_around=16, n_radial=4, seed=1)
    a, b = meshes
    assert a.points.shape == (16 * 5, 2) and a.cells.shape == (2 * 16 * 4, 3) and a.points.dtype == np.float32
    assert not np.allclose(np.sort(a.points, axis=0), np.sort(b.points, axis=0))  # geometry differs per sample
    p = a.points[a.cells].astype(np.float64)
    d1, d2 = p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]
    area = d1[:, 0] * d2[:, 1] - d1[:, 1] * d2[:, 0]
    assert (area > 0).all()  # counter-clockwise, none degenerate or folded
    outer, hole = a.fields["boundary"].T.astype(bool)
    assert outer.sum() == hole.sum() == 16 and np.allclose(np.abs(a.points[outer]).max(axis=1), 1)
    u = a.fields["temperature"]
    assert np.allclose(u[outer], 0) and np.allclose(u[hole], a.fields["dirichlet"][hole]) and u[hole].min() > 0
    assert u.min() >= -1e-6  # a non-negative source and boundary values: maximum principle


def test_p1_solver_converges_at_second_order():
    """A harmonic function is reproduced to O(h^2): halving h divides the error by about 4 (first order: 2)."""
    errors = []
    for n in (48, 96):
        mesh = plate_with_hole(1, n, n // 4, seed=2)[0]
        points = mesh.points.astype(np.float64)
        exact = np.sin(points[:, 0]) * np.exp(points[:, 1])
        fixed = mesh.fields["boundary"].sum(axis=1) > 0
        u = _p1_poisson(points, mesh.cells, np.zeros(len(points)), fixed, exact, 1e-12, 5000)
        errors.append(np.abs(u - exact).max())
    assert errors[1] < errors[0] / 3, errors


def test_cell_edges():
    triangles = torch.tensor([[0, 1, 2], [2, 1, 3], [3, 3, 4]])  # the last is degenerate: edge 3-4 only
    assert cell_edges(triangles).tolist() == [[0, 0, 1, 1, 2, 3], [1, 2, 2, 3, 3, 4]]
    quads = torch.tensor([[0, 1, 2, 3]])
    assert cell_edges(quads, pairs=((0, 1), (1, 2), (2, 3), (3, 0))).tolist() == [[0, 0, 1, 2], [1, 3, 2, 3]]
    mixed = torch.tensor([[0, 1, 2, 3], [2, 3, 4, -1]])  # a tetrahedron and a triangle padded with -1
    assert cell_edges(mixed).tolist() == [[0, 0, 0, 1, 1, 2, 2, 3], [1, 2, 3, 2, 3, 3, 4, 4]]
    assert cell_edges(torch.empty(0, 3, dtype=torch.int64)).shape == (2, 0)
    with pytest.raises(DataPipeError, match="integer tensor"):
        cell_edges(torch.zeros(2, 3))
    with pytest.raises(DataPipeError, match=r"corner indices in \[0, 3\)"):
        cell_edges(triangles, pairs=((0, 3),))


def test_cache_needs_cells(tmp_path):
    mesh = plate_with_hole(1, n_around=8, n_radial=2)[0]
    path = prepare_mesh(tmp_path / "plate.h5", mesh.points, mesh.fields, mesh.cells)
    with pytest.raises(DataPipeError, match="cells=True"):
        MeshGraphCache(MeshSource([path], cells=False))


@pytest.fixture(scope="module")
def plates(tmp_path_factory) -> list[str]:
    """Two plates of 120 nodes: one per ddp group of the 2x2 mesh."""
    folder = tmp_path_factory.mktemp("plates")
    return [str(prepare_mesh(folder / f"plate_{i}.h5", m.points, m.fields, m.cells))
            for i, m in enumerate(plate_with_hole(2, n_around=20, n_radial=5, seed=4))]


@distributed(timeout=90)
def test_each_edge_once_on_some_rank_and_cached(ctx, plates):
    """Edges from each rank's owned cells: together every directed mesh edge exactly once; built once per layout."""
    import h5py

    source = MeshSource(plates, ["temperature"])
    cache = MeshGraphCache(source)
    with DomainPipe(source, ctx.mesh, batch_size=1, shuffle=False, prefetch=0) as pipe:
        for _ in range(2):  # two epochs
            for batch in pipe:
                graph = cache(batch, 0).graph
                edges = mesh_edges(batch["cells"].to_local()[0], batch["points"][0])
    assert cache.builds == (1 if ctx.mesh.ndim == 2 else 2)  # per ddp group one plate, else both, each once
    domain = batch["points"].device_mesh
    mine = edges.t().tolist()
    low = edges.min(dim=0).values
    start, stop = graph.node_offset, graph.node_offset + graph.num_local_nodes
    assert ((low >= start) & (low < stop)).all()  # kept by the rank owning the lower end
    everyone: list = [None] * domain.size()
    dist.all_gather_object(everyone, mine, group=domain.get_group())
    found = [tuple(e) for part in everyone for e in part]
    with h5py.File(plates[batch.samples[0]], "r") as f:
        cells = f["cells"][()]
    pairs = {tuple(sorted((int(c[i]), int(c[j])))) for c in cells for i, j in ((0, 1), (1, 2), (0, 2))}
    assert len(found) == len(set(found)) and set(found) == pairs | {(b, a) for a, b in pairs}
    assert sorted(zip(graph.src.full_tensor().tolist(), graph.dst.full_tensor().tolist())) == sorted(found)


@distributed(world_sizes=(3,), mesh_2d=False)
def test_bad_input_raises_on_every_rank(ctx, plates):
    """Malformed cells on one rank, nodes that do not exist, points that are not node-sharded: every rank raises."""
    source = MeshSource(plates[:1], ["temperature"])
    with DomainPipe(source, ctx.mesh, batch_size=1, shuffle=False, prefetch=0) as pipe:
        batch = next(iter(pipe))
    points, cells = batch["points"][0], batch["cells"].to_local()[0]
    bad = cells.float() if ctx.rank == 1 else cells
    with pytest.raises(DataPipeError, match=r"(?s)rank\(s\) 1 failed.*cells must be an integer tensor"):
        mesh_edges(bad, points)
    beyond = cells + 1000 if ctx.rank == 2 else cells
    with pytest.raises(PlacementError, match="references node .* but nodes has 120 rows"):
        mesh_graph(beyond, points)
    with pytest.raises(DataPipeError, match="ShardTensor"):
        mesh_edges(cells, points.full_tensor())
