"""One mesh object per mesh: every spec holds the canonical object of its mesh.

Why: ``DeviceMesh`` compares equal by ranks and dim names, but each call of
``mesh["domain"]`` (and so ``MeshContext.domain_mesh``) returns a new object,
and a mesh rebuilt over new process groups equals the old one too. The
library relies on the mesh *object*: promotion keeps a weight's view, and a
gradient bucket its node, while the mesh object stays the same; the common
dispatch path needs all ShardTensors of a call on one object; and plans are
memoised on specs. Before, a spec built on a second, equal mesh object hit the
plans cached for the first, so an op's output came back on the first object
while its input was on the second: a model's first layer and the rest saw two
meshes, a bucket promoted twice (one all-reduce more), and a mesh rebuilt over
new process groups could get plans holding the old groups.

So :func:`canonical` maps every mesh to the first object seen with the same
ranks, dim names, device type *and process groups*; specs are built on that
object (:meth:`ShardTensorSpec.from_sizes`) and compare by its identity, so
equal meshes over the same groups share plans and views, and a mesh over other
groups never receives theirs.
"""

from __future__ import annotations

import weakref

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["canonical", "forget"]

#: (mesh by value, its groups' names) -> the first such mesh object. Few entries: one per set of groups.
_CANONICAL: dict = {}
#: id(mesh) -> (weak reference to that object, its canonical mesh): the per-call lookup.
_SEEN: dict = {}


def canonical(mesh: DeviceMesh) -> DeviceMesh:
    """The one mesh object this process uses for meshes equal to ``mesh`` over the same process groups."""
    seen = _SEEN.get(id(mesh))
    if seen is not None and seen[0]() is mesh:
        return seen[1]
    found = _CANONICAL.setdefault((mesh, _groups(mesh)), mesh)
    _SEEN[id(mesh)] = (weakref.ref(mesh, lambda ref, key=id(mesh), seen=_SEEN: _drop(seen, key, ref)), found)
    return found


def forget() -> None:
    """Forget every canonical mesh (the simulator does, between the ranks it plays in one process)."""
    _CANONICAL.clear()
    _SEEN.clear()


def _drop(seen: dict, key: int, ref) -> None:
    """A mesh object is gone: drop its entry, unless the id already names a newer object."""
    entry = seen.get(key)
    if entry is not None and entry[0] is ref:
        del seen[key]


def _groups(mesh: DeviceMesh) -> tuple:
    """The names of the process groups of the mesh's dims (None for a mesh without them)."""
    try:
        return tuple(mesh.get_group(d).group_name for d in range(mesh.ndim))
    except (RuntimeError, ValueError, AttributeError):  # a mesh made without a backend
        return None
