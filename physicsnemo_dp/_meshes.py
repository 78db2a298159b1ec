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

A canonical mesh whose groups were destroyed (``destroy_process_group``) is
replaced by the next equal mesh, whose groups are live, and lets the destroyed
groups go; at interpreter exit the canonical meshes drop the destroyed groups
they still hold, so the groups' worker threads stop before Python shuts down.
"""

from __future__ import annotations

import atexit
import gc
import weakref

from torch.distributed.device_mesh import DeviceMesh

from . import _torch_compat

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
    key = (mesh, _groups(mesh))
    found = _CANONICAL.get(key)
    if found is None or (found is not mesh and _torch_compat.holds_destroyed_groups(found)):
        if found is not None:
            _torch_compat.release_destroyed_groups(found)
        _CANONICAL[key] = found = mesh
    _SEEN[id(mesh)] = (weakref.ref(mesh, lambda ref, key=id(mesh), seen=_SEEN: _drop(seen, key, ref)), found)
    return found


def forget() -> None:
    """Forget every canonical mesh (the simulator does, between the ranks it plays in one process)."""
    _CANONICAL.clear()
    _SEEN.clear()


@atexit.register
def _release_destroyed_groups() -> None:
    """At exit, let destroyed process groups go while Python is still whole (see the module doc).

    Garbage cycles can hold a group too (a model's wrappers keep their groups);
    they are collected here, once, when the script had destroyed its groups.
    """
    released = [_torch_compat.release_destroyed_groups(mesh) for mesh in list(_CANONICAL.values())]
    if any(released):
        gc.collect()


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
