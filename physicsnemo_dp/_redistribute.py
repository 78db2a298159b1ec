"""Execution of redistribution plans on local tensors.

:func:`run_plan` applies the steps of :func:`physicsnemo_dp._plan.plan` to this
rank's local tensor. Each step reads the sizes of its group members from the
layouts recorded in the step, so nothing is exchanged but payload.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from . import _agreement, _gathers, _layout, collectives
from ._plan import Layout, Step, default_dst_sizes, plan
from ._checking import checks_enabled
from .split import offsets_from_sizes


def _sizes(layout: Layout, mesh: DeviceMesh, coord, mesh_dim: int, tensor_dim: int):
    return _layout.group_sizes(
        tuple(mesh.shape), layout.placements, layout.dim_sizes, coord, mesh_dim, tensor_dim
    )


def _fill_value(reduce_op: str, dtype: torch.dtype):
    """Identity element of a reduction (what absent contributions hold)."""
    if reduce_op in ("sum", "avg"):
        return 0
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if reduce_op == "max":
        return -float("inf") if dtype.is_floating_point else info.min
    return float("inf") if dtype.is_floating_point else info.max


def _pad(local, step: Step, mesh, coord):
    d, m = step.tensor_dim, step.mesh_dim
    sizes = _sizes(step.before, mesh, coord, m, d)
    me = coord[m]
    reduce_op = step.after.placements[m].reduce_op
    shape = list(local.shape)
    shape[d] = sum(sizes)
    out = local.new_full(shape, _fill_value(reduce_op, local.dtype))
    block = local * mesh.size(m) if reduce_op == "avg" else local
    out.narrow(d, offsets_from_sizes(sizes)[me], sizes[me]).copy_(block)
    return out


def _exchange(local, src_sizes, dst_sizes, src_dim, dst_dim, mesh, m, me):
    """One all-to-all that moves blocks between ranks of ``mesh_dim``.

    Block ``(i -> j)`` is the part of rank i's shard (along ``src_dim``) that
    rank j owns in the target (along ``dst_dim``). For ``src_dim == dst_dim``
    (rebalancing) it is the overlap of the two intervals.
    """
    group = mesh.size(m)
    src_off, dst_off = offsets_from_sizes(src_sizes), offsets_from_sizes(dst_sizes)

    def block(i, j):
        """(start within i's shard along dst_dim or src_dim, extent) of block i -> j."""
        if src_dim == dst_dim:
            lo = max(src_off[i], dst_off[j])
            hi = min(src_off[i] + src_sizes[i], dst_off[j] + dst_sizes[j])
            return (lo - src_off[i], hi - lo) if hi > lo else (0, 0)
        return dst_off[j], dst_sizes[j]

    def block_shape(i, j):
        shape = list(local.shape)
        start, extent = block(i, j)
        if src_dim == dst_dim:
            shape[src_dim] = extent
        else:
            shape[src_dim] = src_sizes[i]
            shape[dst_dim] = extent
        return shape

    # Tensors only for the non-empty blocks: at large P most blocks are empty, and a
    # narrow/reshape per rank would make every call O(P) in tensor ops.
    row = _numel(local.shape) // local.shape[dst_dim] if local.shape[dst_dim] else 0
    blocks = [block(me, j) for j in range(group)]
    in_splits = [row * extent for _, extent in blocks]
    sends = [local.narrow(dst_dim, start, extent).reshape(-1) for start, extent in blocks if extent]
    send = torch.cat(sends) if sends else local.new_empty(0)
    out_shapes = [block_shape(i, me) for i in range(group)]
    out_splits = [_numel(s) for s in out_shapes]
    received = collectives.all_to_all_v(send, in_splits, out_splits, mesh, m)
    pieces, start = [], 0
    for shape, n in zip(out_shapes, out_splits):
        if n:
            pieces.append(received.narrow(0, start, n).reshape(shape))
        start += n
    if not pieces:
        shape = list(out_shapes[0])
        shape[src_dim] = sum(s[src_dim] for s in out_shapes)
        return received.new_empty(shape)
    return torch.cat(pieces, dim=src_dim)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _run_step(local: torch.Tensor, step: Step, mesh: DeviceMesh, coord) -> torch.Tensor:
    m, d = step.mesh_dim, step.tensor_dim
    me = coord[m]
    if step.kind == "gather":
        return collectives.all_gather_v(local, _sizes(step.before, mesh, coord, m, d), d, mesh, m)
    if step.kind == "pad":
        return _pad(local, step, mesh, coord)
    if step.kind in ("all_to_all", "rebalance"):
        a = step.src_dim
        return _exchange(
            local,
            _sizes(step.before, mesh, coord, m, a),
            _sizes(step.after, mesh, coord, m, d),
            a,
            d,
            mesh,
            m,
            me,
        )
    if step.kind == "all_reduce":
        return collectives.all_reduce(local, step.before.placements[m].reduce_op, mesh, m)
    if step.kind == "reduce_scatter":
        return collectives.reduce_scatter_v(
            local,
            _sizes(step.after, mesh, coord, m, d),
            d,
            step.before.placements[m].reduce_op,
            mesh,
            m,
        )
    if step.kind == "slice":
        sizes = _sizes(step.after, mesh, coord, m, d)
        return local.narrow(d, offsets_from_sizes(sizes)[me], sizes[me]).contiguous()
    if step.kind == "partition":
        op = step.after.placements[m].reduce_op
        return local if op != "sum" or me == 0 else torch.zeros_like(local)
    raise AssertionError(f"unknown step {step.kind}")


def run_plan(local: torch.Tensor, steps: Sequence[Step], mesh: DeviceMesh) -> torch.Tensor:
    """Apply ``steps`` to this rank's local tensor."""
    coord = tuple(mesh.get_coordinate())
    for step in steps:
        local = _run_step(local, step, mesh, coord)
    return local


def layout_of(spec) -> Layout:
    return Layout(tuple(spec.placements), tuple(spec.dim_sizes))


def target_layout(spec, placements, dim_sizes=None) -> Layout:
    """Target layout: explicit ``dim_sizes`` or the defaults of :func:`default_dst_sizes`."""
    placements = _layout.normalize_placements(placements, spec.mesh.ndim, len(spec.global_shape))
    if dim_sizes is None:
        dim_sizes = default_dst_sizes(layout_of(spec), placements, spec.global_shape, spec.mesh_shape)
    return Layout(placements, tuple(dim_sizes))


def redistribute_local(local: torch.Tensor, src_spec, dst_spec, *, implicit: bool = True) -> torch.Tensor:
    """Move ``local`` (laid out as ``src_spec``) to the layout of ``dst_spec``.

    A move that gathers a sharded dim whole (or pads a shard to a pending sum
    of the global size) is an implicit gather (:mod:`physicsnemo_dp._gathers`),
    recorded and subject to the policy before anything moves, unless
    ``implicit=False``: the result itself must be whole (a gradient brought to
    the layout of a replicated tensor, a Python value out of a tensor).
    """
    if src_spec.mesh is not dst_spec.mesh and src_spec.mesh != dst_spec.mesh:
        raise ValueError(
            "cannot redistribute across device meshes "
            f"({tuple(src_spec.mesh.shape)} -> {tuple(dst_spec.mesh.shape)}); "
            "redistribute on the source mesh, then move data explicitly"
        )
    if checks_enabled():  # opt-in collective check that every rank moves the same layouts
        _agreement.verify("redistribute", src_spec.mesh, local, src_spec, None, target=dst_spec)
    steps, growth = _spec_steps(src_spec, dst_spec)
    if growth and implicit:
        _note_growth(src_spec, dst_spec, growth)
    return run_plan(local, steps, src_spec.mesh)


def _note_growth(src_spec, dst_spec, growth) -> None:
    """Record the plan's gather (from layouts alone: the same decision and numbers on every rank)."""
    shape, dtype = src_spec.global_shape, src_spec.tensor_meta.dtype
    nbytes = max(_gathers.box_bytes(s.after.placements, s.after.dim_sizes, shape, dtype.itemsize) for s in growth)
    kind = "all-gather" if any(s.kind == "gather" for s in growth) else "pending sum of the global size"
    dims = sorted({s.tensor_dim for s in growth})
    what = (
        f"of dim {', '.join(map(str, dims))}: {_gathers.describe_layout(src_spec.placements)} -> "
        f"{_gathers.describe_layout(dst_spec.placements)} {'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')}"
    )
    _gathers.note(kind, what, nbytes, src_spec.mesh)


def _spec_steps(src_spec, dst_spec) -> tuple:
    """:func:`_steps` of two specs, memoised on the spec objects themselves.

    Specs are immutable and memoised where they are built (a layer's gradient
    and its weight's Replicate spec are the same objects every step), so the
    identity lookup skips building and hashing two layouts per move (a
    one-rank mesh's per-parameter gradient moves are mostly this lookup). The
    entry keeps both specs alive, so their ids cannot be reused while it stands.
    """
    key = (id(src_spec), id(dst_spec))
    hit = _SPEC_STEPS.get(key)
    if hit is not None and hit[0] is src_spec and hit[1] is dst_spec:
        return hit[2]
    found = _steps(layout_of(src_spec), layout_of(dst_spec), src_spec.mesh_shape)
    if len(_SPEC_STEPS) >= 1024:
        _SPEC_STEPS.clear()
    _SPEC_STEPS[key] = (src_spec, dst_spec, found)
    return found


_SPEC_STEPS: dict = {}


@lru_cache(maxsize=1024)
def _steps(src: Layout, dst: Layout, mesh_shape: tuple) -> tuple:
    """:func:`plan`, memoised (planning is pure on layouts, and training repeats the same few redistributions),
    with its growth steps (gathers, pads to Partial) when the target holds more per rank than the source: an
    implicit gather unless the caller says the result must be whole."""
    steps = tuple(plan(src, dst, mesh_shape))
    # A gather whose result is split as finely as its input (S(0)S(0) -> S(0)S(1): gather, then slice
    # another dim) only relays data; growth is a layout split over fewer ranks than the input.
    if _split_factor(dst, mesh_shape) >= _split_factor(src, mesh_shape):
        return steps, ()
    return steps, tuple(s for s in steps if s.kind in ("gather", "pad"))


def _split_factor(layout: Layout, mesh_shape: tuple) -> int:
    """Over how many ranks a layout splits the data (the product of the mesh dims that shard it)."""
    n = 1
    for m, p in enumerate(layout.placements):
        if issubclass(type(p), Shard):
            n *= mesh_shape[m]
    return n


def grad_of_contribution(local: torch.Tensor, spec) -> torch.Tensor:
    """Turn the gradient of a value into the gradient of this rank's contribution to it.

    For ``Partial("sum")`` they are equal. For ``Partial("avg")`` each
    contribution enters with weight ``1/n``. Max/min contributions have a
    gradient only where they win, which a layout cannot express: refused.
    """
    for m, p in enumerate(spec.placements):
        if issubclass(type(p), Partial) and p.reduce_op == "avg":
            local = local / spec.mesh.size(m)
        elif issubclass(type(p), Partial) and p.reduce_op in ("max", "min"):
            raise NotImplementedError(
                f"no gradient through a Partial({p.reduce_op!r}) tensor; redistribute it to "
                "Replicate() before the differentiable computation"
            )
    return local


def grad_layout(spec):
    """Layout a gradient takes for a tensor of layout ``spec``.

    Placements stay, except Partial becomes Replicate: the gradient of a pending
    sum is the same for every contribution, so it is fully reduced data. Without
    a Partial that is ``spec`` itself (specs are immutable; building one costs
    more than a small op on the backward path).
    """
    if not spec.has_partial:
        return spec
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements)
    return spec.with_layout(placements, spec.dim_sizes)
