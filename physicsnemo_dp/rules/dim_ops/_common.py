"""Helpers shared by the ops along one dim: argument binding, shard order, whole-dim fallback."""

from __future__ import annotations

from itertools import product

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ... import _layout, collectives
from ..._redistribute import grad_layout, redistribute_local
from ...rule_kit import replicated_to_box, resolve_partial, shard_tensor_cls, to_layout, unshard_dims, wrap




def mesh_dims_of(spec, d: int) -> tuple[int, ...]:
    """Mesh dims that shard tensor dim ``d`` (outer split first)."""
    return _layout.sharding_mesh_dims(spec.placements, d)


def shard_index(spec, d: int) -> int:
    """This rank's position among the shards of dim ``d``."""
    return _layout.table_index(spec.mesh_shape, mesh_dims_of(spec, d), spec.coordinate)


def resolve_nonlinear_partial(x):
    """Local tensor and spec of ``x`` with pending max/min reduced (sums may stay pending)."""
    mesh_dims = [m for m, p in enumerate(x._spec.placements) if issubclass(type(p), Partial) and p.reduce_op not in ("sum", "avg")]
    return resolve_partial(x, mesh_dims) if mesh_dims else (x._local_tensor, x._spec)


def local_as(t, spec) -> torch.Tensor:
    """Local piece of ``t`` (ShardTensor or plain replicated tensor) in the layout of ``spec``."""
    if isinstance(t, shard_tensor_cls()):
        return to_layout(t, spec)
    return replicated_to_box(t, spec)


def all_reduce_over(t: torch.Tensor, reduce_op: str, spec, mesh_dims) -> torch.Tensor:
    for m in mesh_dims:
        t = collectives.all_reduce(t, reduce_op, spec.mesh, m)
    return t


def last_slice(t: torch.Tensor, d: int, empty_value) -> torch.Tensor:
    """The last slice along ``d`` (kept as extent 1), or ``empty_value`` for an empty shard."""
    if t.shape[d] > 0:
        return t.narrow(d, t.shape[d] - 1, 1)
    shape = list(t.shape)
    shape[d] = 1
    return t.new_full(shape, empty_value)


def gather_shards(t: torch.Tensor, d: int, spec, extent=lambda n: 1) -> torch.Tensor:
    """Every shard's ``t`` along ``d`` concatenated in shard order (all-gather-v per mesh dim).

    ``extent(n)`` is the extent of the piece contributed by a shard holding
    ``n`` elements of ``d``. Gathering the innermost mesh dim first yields the
    shards in the order of the size table (outer split first).
    """
    mesh_dims = mesh_dims_of(spec, d)
    table, shape, coord = spec.dim_sizes[d], spec.mesh_shape, spec.coordinate
    done: list[int] = []
    for m in reversed(mesh_dims):
        sizes = []
        for i in range(shape[m]):
            total = 0
            for inner in product(*(range(shape[q]) for q in done)):
                c = list(coord)
                c[m] = i
                for q, v in zip(done, inner):
                    c[q] = v
                total += extent(table[_layout.table_index(shape, mesh_dims, c)])
            sizes.append(total)
        t = collectives.all_gather_v(t, sizes, d, spec.mesh, m)
        done.insert(0, m)
    return t


def resized(spec, d: int, extent: int, *, unshard: bool):
    """``spec`` with dim ``d`` of size ``extent`` (mesh dims sharding it become Replicate if ``unshard``)."""
    placements = tuple(
        Replicate() if unshard and issubclass(type(p), Shard) and p.dim == d else p for p in spec.placements
    )
    shape = list(spec.global_shape)
    shape[d] = extent
    sizes = list(spec.dim_sizes)
    if unshard:
        sizes[d] = None
    return type(spec).from_sizes(spec.mesh, placements, shape, spec.tensor_meta.dtype, sizes)


def on_whole_dims(x, dims, fn, *, keep_partial: bool = False):
    """Run ``fn`` on a local tensor that holds ``dims`` whole; outputs in ``x``'s layout.

    The fallback for ops along a sharded dim without a cheaper sharded form:
    one all-to-all moves the shard to another dim (see ``unshard_dims``),
    ``fn`` runs locally, and one all-to-all per output brings it back. Outputs
    must have ``x``'s shape; pending max/min (and sums unless ``keep_partial``)
    are reduced first.
    """
    u_local, u_spec = unshard_dims(x, dims, keep_partial=keep_partial)
    out_spec = x._spec if keep_partial else grad_layout(x._spec)
    outs = fn(u_local)
    single = isinstance(outs, torch.Tensor)
    results = tuple(wrap(move(o, u_spec, out_spec), out_spec) for o in ((outs,) if single else outs))
    return results[0] if single else results


def with_dtype(spec, dtype):
    """``spec`` for a tensor of ``dtype`` (bytes moved follow the dtype)."""
    if spec.tensor_meta.dtype == dtype:
        return spec
    return type(spec).from_sizes(spec.mesh, spec.placements, spec.global_shape, dtype, spec.dim_sizes)


def move(local, src, dst) -> torch.Tensor:
    """``local`` (laid out as ``src``) in the layout of ``dst``; no-op when the layouts agree."""
    if src.placements == dst.placements and src.dim_sizes == dst.dim_sizes:
        return local
    return redistribute_local(local, src, dst)
