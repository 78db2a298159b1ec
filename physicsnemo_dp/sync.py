"""``sync_module_over_mesh``: make every rank of a mesh axis start with the same plain weights.

DDP broadcasts initial weights only over its own (``"ddp"``) group and FSDP2
broadcasts nothing, so the ranks that split one sample over ``"domain"`` must
be synchronized separately — once, after building the model and before
wrapping it. Distributed state (DTensor, ShardTensor) is skipped: its layout
is the caller's business and a broadcast would overwrite shards.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import collectives

__all__ = ["sync_module_over_mesh"]


def _is_fully_sharded(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - very old torch
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _plain_state(module: nn.Module):
    """(name, tensor) of plain parameters and buffers, and whether any state is distributed."""
    from .shard_tensor import ShardTensor

    plain, distributed = [], False
    named = list(module.named_parameters(remove_duplicate=True)) + list(module.named_buffers(remove_duplicate=True))
    for name, t in named:
        if t is None:
            continue
        if isinstance(t, (DTensor, ShardTensor)):
            distributed = True
        else:
            plain.append((name, t))
    return plain, distributed


def _metadata_code(plain) -> int:
    text = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in plain)
    return zlib.crc32(text.encode())


def _checksum(t: torch.Tensor) -> float:
    """A cheap position-weighted sum that differs when values differ (diagnostic, not cryptographic)."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(97).add_(1)
    return float((flat * weights).sum())


def sync_module_over_mesh(module: nn.Module, mesh: DeviceMesh, src_mesh_rank: int = 0, verify: bool = False) -> None:
    """Broadcast ``module``'s plain parameters and buffers over the 1-D ``mesh`` from ``src_mesh_rank``.

    ``src_mesh_rank`` is a position in the mesh (``mesh.mesh[src_mesh_rank]``
    is the source's global rank), whatever order the mesh lists its ranks in.

    The metadata (names, shapes, dtypes) is always compared first with one
    small collective, so a mismatch raises the same ``RuntimeError`` on every
    rank instead of corrupting weights or hanging. With ``verify=True`` a
    per-tensor checksum is compared after the broadcast as well.

    Raises:
        ValueError: ``mesh`` is not 1-D (pass ``mesh["domain"]``), or
            ``src_mesh_rank`` is out of range.
        RuntimeError: the module is already wrapped by ``fully_shard``; it has
            no plain state (all distributed, or none at all); its plain state
            is on a device the mesh cannot use; ranks disagree on metadata or
            (with ``verify``) on values after the broadcast.
    """
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        hint = f'e.g. mesh["{names[-1]}"]' if names else "a 1-D submesh"
        raise ValueError(f"sync_module_over_mesh needs a 1-D mesh, got {mesh.ndim}-D; pass the axis to sync over, {hint}")
    if not 0 <= src_mesh_rank < mesh.size():
        raise ValueError(f"src_mesh_rank={src_mesh_rank} is outside the mesh of size {mesh.size()}")
    if _is_fully_sharded(module):
        raise RuntimeError(
            "sync_module_over_mesh must run before fully_shard: the module is already wrapped, "
            "so its parameters are sharded DTensors"
        )
    plain, distributed = _plain_state(module)
    if not plain:
        what = "all of its parameters and buffers are already distributed" if distributed else "it has no parameters or buffers"
        raise RuntimeError(f"sync_module_over_mesh: nothing plain to synchronize ({what})")
    wrong = [n for n, t in plain if t.device.type != mesh.device_type]
    if wrong:
        raise RuntimeError(
            f"sync_module_over_mesh: {wrong[:3]} live on a device other than the mesh's "
            f"{mesh.device_type!r}; move the module to that device first"
        )

    codes = collectives.gather_ints([len(plain), _metadata_code(plain)], mesh)
    if len({tuple(c) for c in codes}) != 1:
        raise RuntimeError(
            "sync_module_over_mesh: ranks disagree on the module's parameters and buffers "
            f"(count, metadata hash per rank: {codes}); build the same model on every rank"
        )

    with torch.no_grad():
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, t in plain:
            by_dtype.setdefault(t.dtype, []).append(t)
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            flat = collectives.broadcast(flat, src_mesh_rank, mesh, 0)
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(piece.view_as(t))

    if verify:
        sums = torch.tensor([_checksum(t) for _, t in plain], dtype=torch.float64, device=collectives.mesh_device(mesh))
        gathered = collectives.all_gather_v(sums.unsqueeze(0), [1] * mesh.size(), 0, mesh, 0)
        differs = [plain[i][0] for i in range(len(plain)) if not torch.all(gathered[:, i] == gathered[0, i])]
        if differs:
            raise RuntimeError(f"sync_module_over_mesh(verify=True): values still differ across ranks for {differs[:5]}")
