"""Layout and ownership helpers shared by the indexing rules.

Index tensors carry *global* coordinates. A rank whose data tensor is sharded
along an indexed dim holds one box ``[offset, offset + size)`` of it, so it can
serve exactly the index entries that fall into its box ("owned" entries);
:func:`localize` turns global coordinates into local ones and says which
entries are owned. Everything else here is pure layout arithmetic.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ... import _gathers, _layout, collectives
from ..._redistribute import redistribute_local, target_layout
from ..._torch_compat import assert_in_graph, traced
from ...rule_kit import shard_tensor_cls, to_layout, wrap

SUM = Partial("sum")


def as_shard(t, mesh):
    """``t`` as a ShardTensor: plain tensors that reached the dispatcher are replicated data."""
    if isinstance(t, shard_tensor_cls()):
        return t
    from ...spec import ShardTensorSpec

    return wrap(t, ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, tuple(t.shape), t.dtype))


def mesh_of(*tensors):
    """The mesh of the first ShardTensor among ``tensors``."""
    ShardTensor = shard_tensor_cls()
    return next(t._spec.mesh for t in tensors if isinstance(t, ShardTensor))


def spec_like(spec, placements, shape, tables, dtype=None):
    """A spec on ``spec``'s mesh with the given placements, global shape and size tables."""
    return type(spec).from_sizes(
        spec.mesh, placements, tuple(shape), dtype or spec.tensor_meta.dtype, tuple(tables)
    )


def relayout_spec(spec, placements, tables: dict | None = None):
    """``spec`` moved to ``placements``; sizes default as in ``redistribute``, ``tables`` override dims."""
    layout = target_layout(spec, placements)
    sizes = list(layout.dim_sizes)
    for d, table in (tables or {}).items():
        sizes[d] = table
    return spec.with_layout(layout.placements, tuple(sizes))


def replicated_spec(spec):
    """``spec`` with every mesh dim Replicate."""
    return spec.with_layout((Replicate(),) * spec.mesh.ndim, (None,) * len(spec.global_shape))


def replicated_local(t, *, implicit: bool = True) -> torch.Tensor:
    """The whole of ShardTensor ``t`` on this rank (a gather only where it is sharded or pending)."""
    return to_layout(t, replicated_spec(t._spec), implicit=implicit)


def note_index_gather(x_spec, index_specs, out_spec, start: int, ndims: int) -> None:
    """Record a read whose sharded index is gathered: the output holds the global index length on every rank.

    ``index_specs`` are the index tensors' own layouts, ``out_spec`` the planned
    output, whose index dims are ``[start, start + ndims)``. Mesh dims that
    shard an index but none of the output's index dims lose the index's
    sharding (the index is all-gathered there; where ``x`` is sharded along
    the indexed dim the output is a pending sum of the whole index length).
    From layouts alone: the same decision and numbers on every rank.
    """
    sharding = {m for s in index_specs for m, p in enumerate(s.placements) if issubclass(type(p), Shard)}
    if not sharding:
        return
    kept = {m for m, p in enumerate(out_spec.placements) if issubclass(type(p), Shard) and start <= p.dim < start + ndims}
    lost = sharding - kept
    if not lost:
        return
    mesh = out_spec.mesh
    split = 1
    for m in kept:
        split *= mesh.size(m)
    index_bytes = sum(_numel(s.global_shape) * s.tensor_meta.dtype.itemsize for s in index_specs) // split
    out_bytes = _gathers.box_bytes(
        out_spec.placements, out_spec.dim_sizes, out_spec.global_shape, out_spec.tensor_meta.dtype.itemsize
    )
    pending = any(issubclass(type(out_spec.placements[m]), Partial) for m in lost)
    kind = "pending sum of the global index length" if pending else "index gathered, output of the global index length"
    what = (
        f"(x {_gathers.describe_layout(x_spec.placements)} {_shape(x_spec.global_shape)}, index "
        f"{' '.join(_gathers.describe_layout(s.placements) + ' ' + _shape(s.global_shape) for s in index_specs)}"
        f" -> {_gathers.describe_layout(out_spec.placements)} {_shape(out_spec.global_shape)})"
    )
    _gathers.note(kind, what, index_bytes + out_bytes, mesh, _gathers.FIX_INDEX)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "()"


def box(spec, d: int) -> tuple[int, int]:
    """``(offset, size)`` of this rank's box along tensor dim ``d``."""
    return spec.local_offsets()[d], spec.local_shape[d]


def sharded_dims(spec) -> set[int]:
    return {p.dim for p in spec.placements if issubclass(type(p), Shard)}


def resolved_spec(spec, mesh_dims) -> object:
    """``spec`` with the pending reductions on ``mesh_dims`` done (Replicate there)."""
    placements = tuple(
        Replicate() if issubclass(type(p), Partial) and m in mesh_dims else p for m, p in enumerate(spec.placements)
    )
    return spec if placements == spec.placements else spec.with_layout(placements, spec.dim_sizes)


def reading_spec(spec, indexed_dims) -> object:
    """Layout a tensor must have before entries of ``indexed_dims`` are read from it.

    Reading along a sharded dim makes each rank contribute its owned entries
    to a zero-filled output, a pending *sum*. Pending max/min reductions do
    not commute with that sum, so they are resolved first; bool data cannot
    be summed, so bool tensors are gathered along the indexed dims instead.
    """
    if not sharded_dims(spec) & set(indexed_dims):
        return spec
    if spec.tensor_meta.dtype == torch.bool:
        placements = tuple(
            Replicate() if (issubclass(type(p), Shard) and p.dim in indexed_dims) or issubclass(type(p), Partial) else p
            for p in spec.placements
        )
        return relayout_spec(spec, placements)
    nonlinear = {m for m, p in enumerate(spec.placements) if issubclass(type(p), Partial) and p.reduce_op in ("max", "min")}
    return resolved_spec(spec, nonlinear)


def without_partial(spec):
    return resolved_spec(spec, range(spec.mesh.ndim))


def check_range(values: torch.Tensor, size: int, allow_negative: bool, op: str, dim: int) -> None:
    """Raise ``IndexError`` like torch for indices outside dim ``dim`` of extent ``size``.

    While torch.compile traces, the indices are not known yet: the check becomes
    an op of the graph instead (a ``RuntimeError`` with the valid range when the
    compiled code runs), never a read of the data into Python.
    """
    if values.numel() == 0:
        return
    lo = -size if allow_negative else 0
    if traced(values):
        in_range = ((values >= lo) & (values < size)).all()
        assert_in_graph(in_range, f"{op}: an index is out of bounds for dim {dim} with size {size} "
                                  f"(valid: [{lo}, {size - 1}])")
        return
    vmin, vmax = int(values.min()), int(values.max())
    if vmin < lo or vmax >= size:
        bad = vmin if vmin < lo else vmax
        raise IndexError(
            f"{op}: index {bad} is out of bounds for dim {dim} with size {size} "
            f"(valid: [{lo}, {size - 1}])"
        )


def localize(values: torch.Tensor, size: int, offset: int, extent: int, allow_negative: bool):
    """Local coordinates of global ``values`` in the box ``[offset, offset + extent)``, and ownership.

    Entries outside the box map to 0 (a valid position when ``extent > 0``) and
    are reported as not owned.
    """
    if allow_negative:
        values = torch.where(values < 0, values + size, values)
    local = values - offset
    owned = (local >= 0) & (local < extent)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def gather_count_table(count: int, spec_mesh, mesh_dims: Sequence[int]) -> tuple[int, ...]:
    """Size table of a data-dependent dim sharded over ``mesh_dims``: every rank's ``count``.

    One all-gather of one int per rank. Ranks with the same coordinates on
    ``mesh_dims`` hold the same data and report the same count.
    """
    mesh_shape = tuple(spec_mesh.shape)
    counts = collectives.gather_ints([count], spec_mesh)
    table: dict[int, int] = {}
    for coord, (c,) in zip(_layout.all_coords(mesh_shape), counts):
        table.setdefault(_layout.table_index(mesh_shape, mesh_dims, coord), c)
    return tuple(table[k] for k in sorted(table))


def grad_spec_for(input_spec, grad_pending_dims: set[int]):
    """Layout of an input's gradient: the input's layout with Partial read as Replicate,
    except mesh dims in ``grad_pending_dims``, where every rank holds an additive
    contribution (Partial("sum")) — left pending so that the consumer decides
    when to reduce (a promoted weight reduces once, in its backward)."""
    placements = tuple(
        SUM if m in grad_pending_dims else (Replicate() if issubclass(type(p), Partial) else p)
        for m, p in enumerate(input_spec.placements)
    )
    return input_spec.with_layout(placements, input_spec.dim_sizes)


def to_input_layout(local: torch.Tensor, spec, input_spec):
    """A gradient (``local`` laid out as ``spec``) in the layout of the input it belongs to.

    Mesh dims where the input is replicated (or pending) keep a pending sum if
    the gradient is one, and turn a sharded gradient into one by zero-padding
    (no communication); sharded mesh dims take the input's shard sizes.
    """
    pending = {
        m for m, p in enumerate(input_spec.placements)
        if not issubclass(type(p), Shard) and (issubclass(type(spec.placements[m]), Shard) or spec.placements[m] == SUM)
    }
    target = grad_spec_for(input_spec, pending)
    if target.placements == spec.placements and target.dim_sizes == spec.dim_sizes:
        return local, spec
    return redistribute_local(local, spec, target, implicit=False), target  # a gradient in its input's layout


def result_shape(x_shape: Sequence[int], positions: Sequence[int], bshape: Sequence[int]):
    """Shape of ``x[indices]`` and where the broadcast index dims start in it.

    ``positions`` are the indexed dims of ``x``. Adjacent positions keep the
    index dims in place; separated ones put them first (torch/NumPy rules).
    """
    positions = list(positions)
    adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
    rest = [d for d in range(len(x_shape)) if d not in positions]
    start = positions[0] if adjacent else 0
    before = [d for d in rest if d < start] if adjacent else []
    after = [d for d in rest if d not in before]
    shape = [x_shape[d] for d in before] + list(bshape) + [x_shape[d] for d in after]
    where = {d: i for i, d in enumerate(before)}
    where.update({d: start + len(bshape) + i for i, d in enumerate(after)})
    return tuple(shape), start, where


def clip_sizes(table, n: int) -> tuple:
    """Shard sizes of the first ``n`` entries of a dim split as ``table``."""
    out, start = [], 0
    for size in table:
        out.append(max(0, min(start + size, n) - min(start, n)))
        start += size
    return tuple(out)
