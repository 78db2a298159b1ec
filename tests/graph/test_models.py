"""MeshGraphNet and the radius point-cloud network on sharded graphs equal one process.

The meshes and point clouds are written by ``datapipes.synthetic``, prepared
along a Hilbert curve and read back per rank by ``DomainPipe`` (near-equal,
uneven point ranges); one case cuts the nodes with deliberately uneven sizes
(an empty shard at 3 and 4 ranks) and hands all cells to rank 0; there the
MeshGraphNet's MLPs are marked ``physicsnemo_dp.rowwise`` (fused on the local
rows), in the other case they run op by op. The models
are the plain torch code of ``examples/graph_models.py``; the reference runs
the same weights on full tensors with plain index tensors. Compared: the
output, the gradient of every input (node and edge features) and of every
parameter, in float64 (relative to the largest reference magnitude, 1e-10).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from datapipes import DomainPipe, MeshSource, prepare_mesh
from datapipes.mesh_graph import MeshGraphCache, mesh_graph
from datapipes.synthetic import plate_with_hole, point_cloud
import physicsnemo_dp
from physicsnemo_dp import Shard, ShardTensor
from physicsnemo_dp.graph import radius
from tests._harness import distributed
from tests.examples import EXAMPLES  # noqa: F401  (puts the examples on sys.path)

from ..core._util import make_spec, shard_from_global
from ..spectral._conformance import assert_close

import graph_models  # noqa: E402

FIELDS = ["temperature", "source", "dirichlet", "boundary"]
RTOL = 1e-10


@pytest.fixture(scope="module")
def plates(tmp_path_factory) -> list[str]:
    """Two prepared plates of 14 x 5 = 70 nodes (uneven over 3 and 4 ranks), one per ddp group of the 2x2 mesh."""
    folder = tmp_path_factory.mktemp("plates")
    paths = []
    for i, mesh in enumerate(plate_with_hole(2, n_around=14, n_radial=4, seed=3)):
        paths.append(str(prepare_mesh(folder / f"plate_{i}.h5", mesh.points, mesh.fields, mesh.cells)))
    return paths


@pytest.fixture(scope="module")
def clouds(tmp_path_factory) -> list[str]:
    """Two prepared volume point clouds of 61 points."""
    folder = tmp_path_factory.mktemp("clouds")
    return [str(prepare_mesh(folder / f"cloud_{i}.h5", c.points, c.fields))
            for i, c in enumerate(point_cloud(61, kind="volume", seed=s) for s in (1, 2))]


def _read(ctx, paths: list[str], fields, cells: bool):
    """This rank's batch of one sample (one per ddp group), float64, and its source."""
    source = MeshSource(paths, fields, cells=cells, dtype=np.float64)
    with DomainPipe(source, ctx.mesh, batch_size=1, shuffle=False, prefetch=0) as pipe:
        batch = next(iter(pipe))
    return batch, source


def _node_features(batch) -> ShardTensor:
    return torch.cat([batch["points"][0], batch["boundary"][0], batch["source"][0].unsqueeze(-1) / 10,
                      batch["dirichlet"][0].unsqueeze(-1)], dim=-1)


def _reference_edges(cells: np.ndarray) -> set[tuple[int, int]]:
    """Every directed edge joining two corners of a triangle, once."""
    pairs = {tuple(sorted((int(c[i]), int(c[j])))) for c in cells for i, j in ((0, 1), (1, 2), (0, 2))}
    return pairs | {(b, a) for a, b in pairs}


def _compare(model, sharded_inputs: list, plain_inputs: list, src: ShardTensor, dst: ShardTensor, what: str):
    """``model`` on sharded inputs (leaves) vs a copy on the full tensors: output, input and parameter gradients."""
    reference = copy.deepcopy(model)
    src_full, dst_full = src.full_tensor(), dst.full_tensor()
    assert type(src_full) is torch.Tensor and src_full.dtype == torch.int64
    leaves = [t.detach().requires_grad_(True) for t in sharded_inputs]
    plain = [t.detach().clone().requires_grad_(True) for t in plain_inputs]
    out = model(*leaves, src, dst)
    expected = reference(*plain, src_full, dst_full)
    assert isinstance(out, ShardTensor) and out.placements == leaves[0].placements, (what, type(out))
    assert_close(out.full_tensor().detach(), expected.detach(), RTOL, f"{what}: output")
    cotangent = torch.randn(tuple(expected.shape), generator=torch.Generator().manual_seed(5), dtype=expected.dtype)
    expected.backward(cotangent)
    out.backward(shard_from_global(cotangent.to(out.device), out.spec))
    for k, (leaf, ref) in enumerate(zip(leaves, plain)):
        if ref.requires_grad and ref.grad is not None:
            assert isinstance(leaf.grad, ShardTensor), f"{what}: input {k}'s gradient is {type(leaf.grad)}"
            assert_close(leaf.grad.full_tensor(), ref.grad, RTOL, f"{what}: gradient of input {k}")
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p_ref.grad is not None and p.grad is not None, f"{what}: parameter {name} got no gradient"
        assert not isinstance(p.grad, ShardTensor), f"{what}: parameter {name}'s gradient is a ShardTensor"
        assert_close(p.grad, p_ref.grad, RTOL, f"{what}: gradient of {name}")


@pytest.mark.parametrize("layout", ["datapipe", "uneven"])
@distributed(timeout=120)
def test_meshgraphnet_matches_one_process(ctx, plates, layout):
    """10 processor layers on a plate read by DomainPipe (or cut unevenly, all cells on rank 0)."""
    batch, source = _read(ctx, plates, FIELDS, cells=True)
    x = _node_features(batch)
    sample = batch.samples[0]
    if layout == "datapipe":
        graph = MeshGraphCache(source)(batch, 0)
    else:  # the same nodes with other (uneven, maybe empty) shard sizes; any distribution of cells works
        domain = batch["points"].device_mesh
        full = x.full_tensor()
        x = shard_from_global(full, make_spec(domain, (Shard(0),), tuple(full.shape), dtype=full.dtype, salt=2))
        with _h5(plates[sample]) as f:
            cells = torch.from_numpy(f["cells"][()]) if domain.get_local_rank() == 0 else torch.empty(0, 3)
        graph = mesh_graph(cells.to(device=ctx.device, dtype=torch.int64), x[:, :2].contiguous())
    g = graph.graph
    points = x.full_tensor()[:, :2]
    with _h5(plates[sample]) as f:
        assert torch.equal(points, torch.from_numpy(f["points"][()]))
        expected_edges = _reference_edges(f["cells"][()])
    src, dst = g.src.full_tensor(), g.dst.full_tensor()
    found = list(zip(src.tolist(), dst.tolist()))
    assert len(found) == len(set(found)) and set(found) == expected_edges, layout
    offset = points[src] - points[dst]
    assert_close(graph.edge_features.full_tensor(), torch.cat([offset, offset.norm(dim=-1, keepdim=True)], -1),
                 RTOL, "edge features")
    torch.manual_seed(0)
    model = graph_models.MeshGraphNet(6, 3, 1, width=8, layers=10).double().to(ctx.device)
    if layout == "uneven":  # the MLPs fused on the local rows (physicsnemo_dp.rowwise); the datapipe case runs them per op
        for m in model.modules():
            if isinstance(m, graph_models.MLP):
                physicsnemo_dp.rowwise(m)
    _compare(model, [x, graph.edge_features], [x.full_tensor(), graph.edge_features.full_tensor()], g.src, g.dst,
             f"meshgraphnet, {layout}")
    if layout == "uneven":
        # the fused path was the one compared: one node, or at one rank torch's autograd between entry and exit
        expected = "_LeaveBackward" if ctx.world_size == 1 else "_FusedBackward"
        assert type(model.node_encoder(x).grad_fn).__name__ == expected


@distributed(timeout=120)
def test_point_cloud_net_matches_one_process(ctx, clouds):
    """Three radius blocks (max aggregation, self loops) on a point cloud read by DomainPipe."""
    batch, _ = _read(ctx, clouds, ["temperature", "velocity"], cells=False)
    pos = batch["points"][0]
    x = torch.cat([batch["temperature"][0].unsqueeze(-1), batch["velocity"][0]], dim=-1)
    g, distances = radius(pos, 0.3, max_neighbours=8, loop=True)
    full = pos.full_tensor()
    src, dst = g.src.full_tensor(), g.dst.full_tensor()
    assert_close(distances.full_tensor(), (full[src] - full[dst]).norm(dim=-1), RTOL, "radius distances")
    assert torch.equal(torch.bincount(dst, minlength=len(full)).clamp(max=1), torch.ones(len(full), dtype=torch.int64))
    torch.manual_seed(0)
    model = graph_models.PointCloudNet(4, 2, ndim=3, width=8, layers=3).double().to(ctx.device)
    _compare(model, [x, pos], [x.full_tensor(), full], g.src, g.dst, "point cloud net")


def _h5(path: str):
    import h5py

    return h5py.File(path, "r")
