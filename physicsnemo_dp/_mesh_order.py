"""Mesh coordinates and process-group ranks: where each coordinate of a mesh dim sits in its group.

Every positional table of the library (shard sizes, boxes, offsets, split
lists, peers, the source of a broadcast) is indexed by *mesh coordinate*:
``mesh.get_coordinate()[mesh_dim]``, the position along ``mesh_dim`` in
``mesh.mesh``. A collective, though, addresses *group ranks* of the mesh dim's
process group: ``all_to_all_single``'s split lists, ``all_gather``'s output
order, ``broadcast(group_src=...)`` and point-to-point peers. The two agree
only when the group numbers its members in mesh order, which
``torch.distributed.new_group`` does not promise: it numbers them by
increasing global rank, whatever order they were listed in. So
``DeviceMesh("cpu", [3, 2, 1, 0])`` puts global rank 3 at coordinate 0 but at
group rank 3 (``mesh.get_local_rank`` is the group rank), and a mesh built
with ``DeviceMesh.from_group`` may pair any groups with any layout.

:func:`line` gives, once per mesh object and mesh dim, this rank's coordinate
and the group rank of every coordinate along the dim (``None`` when they
coincide, which is the common case and costs the collectives nothing);
:mod:`physicsnemo_dp.collectives` translates with it, so every other module
thinks in coordinates only.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _torch_compat

__all__ = ["Line", "line", "coordinate"]


class Line(NamedTuple):
    """One mesh dim as this rank's process group sees it."""

    me: int  # this rank's coordinate along the mesh dim
    to_group: tuple[int, ...] | None  # group rank of each coordinate; None: the same numbers
    to_coord: tuple[int, ...] | None  # coordinate of each group rank (the inverse); None likewise


#: (id(mesh), mesh_dim) -> (weak reference to the mesh, its Line): asked on every collective.
_LINES: dict = {}


def line(mesh: DeviceMesh, mesh_dim: int) -> Line:
    """This rank's :class:`Line` of ``mesh_dim`` (memoised per mesh object and dim)."""
    key = (id(mesh), mesh_dim)
    entry = _LINES.get(key)
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    found = _measure(mesh, mesh_dim)
    _LINES[key] = (weakref.ref(mesh, lambda ref, key=key, lines=_LINES: _drop(lines, key, ref)), found)
    return found


def coordinate(mesh: DeviceMesh, mesh_dim: int) -> int:
    """This rank's coordinate along ``mesh_dim`` (what size tables are indexed by; not ``get_local_rank``)."""
    return line(mesh, mesh_dim).me


@_torch_compat.on_real_tensors  # first asked while torch.compile traces: mesh.mesh must not meet fake modes
def _measure(mesh: DeviceMesh, mesh_dim: int) -> Line:
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"rank {dist.get_rank()} is not part of the device mesh {mesh.mesh.tolist()}")
    me = int(coord[mesh_dim])
    if mesh.size(mesh_dim) == 1:
        return Line(me, None, None)
    index = list(coord)
    index[mesh_dim] = slice(None)
    members = mesh.mesh[tuple(index)].tolist()  # global ranks, in coordinate order
    group = mesh.get_group(mesh_dim)
    to_group = tuple(_group_rank(group, r) for r in members)
    if sorted(to_group) != list(range(len(members))) or to_group[me] != dist.get_rank(group):
        raise RuntimeError(
            f"mesh dim {mesh_dim} of the device mesh {mesh.mesh.tolist()} holds global ranks {members} along this "
            f"rank's line, but its process group numbers them {list(to_group)}: the mesh and its process groups "
            "disagree; build the mesh from groups over exactly these ranks"
        )
    if to_group == tuple(range(len(members))):
        return Line(me, None, None)
    to_coord = [0] * len(members)
    for c, g in enumerate(to_group):
        to_coord[g] = c
    return Line(me, to_group, tuple(to_coord))


def _group_rank(group, global_rank: int) -> int:
    try:
        return dist.get_group_rank(group, global_rank)
    except (ValueError, RuntimeError):  # not a member of the group
        return -1


def _drop(lines: dict, key, ref) -> None:
    """A mesh object is gone: drop its entry, unless the id already names a newer object."""
    entry = lines.get(key)
    if entry is not None and entry[0] is ref:
        del lines[key]
