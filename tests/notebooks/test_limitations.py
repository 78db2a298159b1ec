"""Every limitation docs/limitations.md lists raises the error it says, with the message it quotes.

``EXPECTED`` maps a case to the exception class name and a fragment of its
message; the page must quote both, and the multi-rank bodies below trigger
each case and check both, so the page and the code cannot drift apart.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import physicsnemo_dp
from physicsnemo_dp import Partial, Replicate, Shard, ShardTensor, launch, promotion_mode, scatter_tensor
from tests._harness import distributed

DOC = Path(__file__).resolve().parents[2] / "docs" / "limitations.md"

EXPECTED = {
    # layouts
    "placement count": ("PlacementError", "give exactly one placement per mesh dim"),
    "shard dim out of range": ("PlacementError", "is out of range for a"),
    "partial op": ("PlacementError", "only Partial reduce ops 'sum', 'avg', 'max' and 'min' are supported"),
    "from_local dtypes": ("PlacementError", "ranks passed local tensors of different dtypes"),
    "from_local dict nested": ("PlacementError", "a sharding_shapes dict cannot describe that"),
    "redistribute other mesh": ("PlacementError", "cannot move a ShardTensor to a different device mesh"),
    "op across meshes": ("PlacementError", "ShardTensor arguments live on different device meshes"),
    # ops
    "no rule": ("NotImplementedError", "ShardTensor has no rule for"),
    "fallback in-place": ("NotImplementedError", "physicsnemo_dp.fallback('gather') does not run it"),
    "as_strided": ("NotImplementedError", "strides of the global tensor do not describe any rank's local memory"),
    "view dtype wider": ("PlacementError", "elements into one along the last dim, which is sharded"),
    "view_as_complex sharded pair": ("PlacementError", "view_as_complex: the last dim (the real and imaginary parts, size 2) is sharded"),
    "several masks": ("NotImplementedError", "ShardTensor indexing supports one boolean mask as the only tensor index"),
    "einsum diagonal": ("NotImplementedError", "ShardTensor does not support that: take the diagonal"),
    "partial max gradient": ("NotImplementedError", "no gradient through a Partial('max') tensor"),
    "batched grads": ("NotImplementedError", "is_grads_batched=True) is not supported for ShardTensors"),
    "promotion disabled": ("PromotionError", "while promotion is DISABLED"),
    # spatial and attention
    "negative halo": ("ValueError", "halo widths must be >= 0"),
    "halo nested": ("PlacementError", "a halo exchange needs it sharded by one mesh dim"),
    "attention dropout": ("ValueError", "needs dropout_p=0"),
    "attention mask gradient": ("ValueError", "gives attn_mask no gradient"),
    "attention debug mask": ("ValueError", "cannot return the debug attention mask"),
    "zigzag nested": ("PlacementError", "zig-zag reordering needs the sequence sharded by mesh dim"),
    # training
    "capabilities": ("CapabilityError", "does not declare supports_domain=True"),
    "mixed precision with ddp": ("ValueError", "mixed_precision is applied by FSDP2"),
    "mesh names": ("ValueError", "the mesh must have dim names"),
    "sync after fully_shard": ("RuntimeError", "must run before fully_shard"),
    # data
    "halo wider than shard": ("DecompositionError", "is wider than the shard"),
    "dim split twice": ("DecompositionError", "use a 1-D domain mesh of their product size instead"),
    "dim smaller than mesh": ("DecompositionError", "fewer than the"),
    "batch split differently": ("DataPipeError", "needs samples whose variables split alike"),
    "file changed under a run": ("FileChangedError", "the file changed while it was being read"),
    "checksum mismatch": ("ChecksumError", "does not match its Fletcher-32 checksum"),
    "data never written": ("DataPipeError", "never written"),
    "virtual source missing": ("MissingDataError", "which does not exist"),
    # launcher
    "launch returns ShardTensor": ("RankError", "return x.full_tensor() or x.to_local() from a launched function"),
}


def _check(name: str, thunk) -> None:
    kind, fragment = EXPECTED[name]
    with pytest.raises(Exception) as info:
        thunk()
    names = [c.__name__ for c in type(info.value).__mro__]
    assert kind in names, f"{name}: raised {type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value), f"{name}: {info.value}"


def _rows(ctx, shape=(6, 4), dim=0):
    return scatter_tensor(torch.randn(shape) if ctx.rank == 0 else None, 0, ctx.mesh, [Shard(dim)])


def test_every_case_is_documented():
    text = DOC.read_text()
    missing = [(name, kind, fragment) for name, (kind, fragment) in EXPECTED.items()
               if kind not in text or fragment not in text]
    assert not missing, f"docs/limitations.md does not quote: {missing}"


@distributed(world_sizes=(2,), mesh_2d=False)
def test_one_dim_mesh_cases(ctx, tmp_path):
    x = _rows(ctx)
    _check("placement count", lambda: x.redistribute(placements=[Shard(0), Shard(1)]))
    _check("shard dim out of range", lambda: x.redistribute(placements=[Shard(5)]))
    _check("partial op", lambda: ShardTensor.from_local(torch.ones(3), ctx.mesh, [Partial("prod")]))
    wrong = torch.ones(3, dtype=torch.float64 if ctx.rank else torch.float32)
    _check("from_local dtypes", lambda: ShardTensor.from_local(wrong, ctx.mesh, [Shard(0)]))
    other = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("other",))
    _check("redistribute other mesh", lambda: x.redistribute(other, [Replicate()]))
    y = scatter_tensor(torch.randn(6, 4) if ctx.rank == 0 else None, 0, other, [Shard(0)])
    _check("op across meshes", lambda: x + y)

    _check("no rule", lambda: x.index_fill(0, torch.tensor([1]), 1.0))
    with physicsnemo_dp.fallback("gather"):
        _check("fallback in-place", lambda: x.clone().index_fill_(0, torch.tensor([1]), 1.0))
    _check("as_strided", lambda: x.as_strided((2, 2), (1, 1)))
    _check("view dtype wider", lambda: _rows(ctx, (2, 6), dim=1).view(torch.float64))  # shards of 3 floats
    _check("view_as_complex sharded pair", lambda: torch.view_as_complex(_rows(ctx, (3, 2), dim=1)))
    _check("several masks", lambda: x[torch.ones(6, dtype=torch.bool), torch.ones(4, dtype=torch.bool)])
    _check("einsum diagonal", lambda: torch.einsum("ii->i", _rows(ctx, (4, 4))))
    pending_max = ShardTensor.from_local(torch.ones(3), ctx.mesh, [Partial("max")]).requires_grad_()
    _check("partial max gradient", lambda: pending_max.full_tensor().sum().backward())
    leaf = _rows(ctx).requires_grad_()
    _check("batched grads", lambda: torch.autograd.grad(leaf.sum(), leaf, torch.ones(2), is_grads_batched=True))
    with promotion_mode("disabled"):
        _check("promotion disabled", lambda: x * torch.ones(4))

    from physicsnemo_dp.spatial import halo_exchange

    _check("negative halo", lambda: halo_exchange(x, {0: (-1, 1)}))
    q = _rows(ctx, (1, 2, 6, 4), dim=2)
    _check("attention dropout", lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1))
    mask = torch.zeros(6, 6, requires_grad=True)
    _check("attention mask gradient", lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    flash = torch.ops.aten._scaled_dot_product_flash_attention  # what SDPA runs on CUDA, asked for its debug mask
    _check("attention debug mask", lambda: flash(q, q, q, 0.0, False, True))

    from physicsnemo_dp.distributed import MeshContext

    _check("mesh names", lambda: MeshContext.from_mesh(ctx.mesh))
    _check("batch split differently", lambda: _batch_of_two_meshes(ctx, tmp_path))


def _batch_of_two_meshes(ctx, folder):
    from datapipes import DomainPipe, MeshSource, prepare_mesh
    from datapipes.synthetic import point_cloud

    if ctx.rank == 0:
        for n in (60, 90):
            prepare_mesh(folder / f"mesh{n}.h5", point_cloud(n, kind="volume").points)
    torch.distributed.barrier()
    source = MeshSource([folder / "mesh60.h5", folder / "mesh90.h5"])
    next(iter(DomainPipe(source, ctx.mesh, batch_size=2, shuffle=False, prefetch=0)))


@distributed(world_sizes=(), mesh_2d=True)
def test_two_dim_mesh_cases(ctx):
    from physicsnemo_dp.distributed import MeshContext, MixedPrecisionPolicy, parallelize_model
    from physicsnemo_dp.spatial import halo_exchange

    local = torch.ones(2, 3)
    _check("from_local dict nested",
           lambda: ShardTensor.from_local(local, ctx.mesh, [Shard(0), Shard(0)], sharding_shapes={0: [(2, 3)] * 2}))
    nested = ShardTensor.from_local(local, ctx.mesh, [Shard(0), Shard(0)])
    _check("halo nested", lambda: halo_exchange(nested, {0: (1, 1)}))
    context = MeshContext.from_mesh(ctx.mesh, strategy="ddp")
    _check("capabilities", lambda: parallelize_model(torch.nn.Linear(2, 2), context))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    _check("mixed precision with ddp", lambda: MeshContext.from_mesh(ctx.mesh, strategy="ddp", mixed_precision=bf16))

    from torch.distributed.fsdp import fully_shard

    from physicsnemo_dp import sync_module_over_mesh

    sharded = fully_shard(torch.nn.Linear(2, 2), mesh=ctx.mesh["ddp"])
    _check("sync after fully_shard", lambda: sync_module_over_mesh(sharded, ctx.mesh["domain"]))

    from physicsnemo_dp.attention import to_zigzag

    sequence = ShardTensor.from_local(torch.ones(1, 2, 3), ctx.mesh, [Shard(1), Shard(1)])
    _check("zigzag nested", lambda: to_zigzag(sequence, dim=1, mesh_dim=1))


def test_decomposition_cases():
    from datapipes import DomainDecomposition

    _check("halo wider than shard", lambda: DomainDecomposition((12, 8), 3, halo=2, sizes=[(5, 1, 6)]))
    _check("dim split twice", lambda: DomainDecomposition((10, 8), (2, 2), split_dims=(0, 0)))
    _check("dim smaller than mesh", lambda: DomainDecomposition((2, 8), 3))


def test_data_file_cases(tmp_path):
    import h5py
    import numpy as np

    from datapipes import HDF5Fields
    from datapipes.synthetic import write_hdf5

    fields = {"u": np.arange(4 * 8 * 8, dtype=np.float32).reshape(4, 8, 8)}
    box, out = (slice(0, 8), slice(0, 8)), np.empty((8, 8), np.float32)
    path = write_hdf5(tmp_path / "a.h5", fields, checksums=True)[0]  # chunks of one sample
    with h5py.File(path) as f:
        offset = f["u"].id.get_chunk_info_by_coord((2, 0, 0)).byte_offset
    with open(path, "r+b") as fh:  # one bit of sample 2
        fh.seek(offset + 5)
        byte = fh.read(1)[0]
        fh.seek(offset + 5)
        fh.write(bytes([byte ^ 1]))
    source = HDF5Fields(path, ["u"])
    _check("checksum mismatch", lambda: source.read(2, "u", box, out))
    os.truncate(path, os.path.getsize(path) // 2)
    _check("file changed under a run", lambda: source.check_files([0]))

    empty = tmp_path / "empty.h5"
    with h5py.File(empty, "w") as f:
        f.create_dataset("u", shape=(4, 8, 8), dtype=np.float32)
    _check("data never written", lambda: HDF5Fields(empty, ["u"]))

    write_hdf5(tmp_path / "part.h5", fields)
    with h5py.File(tmp_path / "virtual.h5", "w", libver="latest") as f:
        layout = h5py.VirtualLayout(shape=(4, 8, 8), dtype=np.float32)
        layout[:] = h5py.VirtualSource("part.h5", "u", shape=(4, 8, 8))
        f.create_virtual_dataset("u", layout, fillvalue=np.nan)
    (tmp_path / "part.h5").unlink()
    _check("virtual source missing", lambda: HDF5Fields(tmp_path / "virtual.h5", ["u"]))


def _return_a_shard_tensor(mesh):
    return ShardTensor.from_local(torch.ones(2), mesh, [Shard(0)])


def test_launch_refuses_to_return_a_shard_tensor():
    _check("launch returns ShardTensor", lambda: launch(_return_a_shard_tensor, 2, timeout=120))
