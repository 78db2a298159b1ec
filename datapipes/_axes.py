"""Which dims of a device mesh split samples ("ddp") and which split one sample (the domain)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshAxes"]


@dataclass(frozen=True)
class MeshAxes:
    """This rank's place on a ``(ddp, *domain)`` mesh.

    The mesh dim named ``ddp_dim`` (if any) splits samples; every other dim
    belongs to the domain mesh that splits one sample. A 1-D mesh without a
    ddp dim is all domain. Slicing the submesh happens here, once, so that no
    mesh bookkeeping runs while batches are built.
    """

    domain_mesh: DeviceMesh
    domain_shape: tuple[int, ...]
    domain_coord: tuple[int, ...]
    ddp_size: int
    ddp_rank: int

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, ddp_dim: str = "ddp") -> "MeshAxes":
        names = tuple(mesh.mesh_dim_names or ())
        coord = mesh.get_coordinate()
        if coord is None:
            raise RuntimeError("this rank is not part of the device mesh given to the pipe")
        if ddp_dim not in names:
            if mesh.ndim > 1 and not names:
                raise ValueError(
                    f"a {mesh.ndim}-D mesh needs mesh_dim_names so the pipe knows which dim is "
                    f"'{ddp_dim}' (samples) and which split the domain"
                )
            return cls(mesh, tuple(mesh.shape), tuple(coord), 1, 0)
        k = names.index(ddp_dim)
        domain_names = tuple(n for n in names if n != ddp_dim)
        if not domain_names:
            raise ValueError(f"the mesh {names} has no domain dim besides '{ddp_dim}'")
        domain = mesh[domain_names[0]] if len(domain_names) == 1 else mesh[domain_names]
        domain_coord = tuple(c for i, c in enumerate(coord) if i != k)
        return cls(domain, tuple(domain.shape), domain_coord, mesh.shape[k], coord[k])
