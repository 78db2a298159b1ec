"""Aggregation at destinations with a graph's ``dst`` index: local, no communication.

Every edge lives at the owner of its destination, so ``index_add``,
``scatter_add``, ``scatter_reduce`` (``sum``, ``prod``, ``mean``, ``amax``, ``amin``,
with or without ``include_self``) and ``scatter`` see, on each rank, exactly the
edges that land in its rows: the local op on local tensors *is* the global op.
The index's values are never read; the graph's local destination rows are
used in the index's (broadcast) shape.

Layouts accepted (anything else goes to the generic indexing rules):

* the written tensor ``out``: node layout of the graph (``Shard(0)`` with its
  node sizes), or replicated / pending of ``N`` rows, e.g. ``msg.new_zeros(N, F)``
  as torch_geometric writes it, which is narrowed to this rank's rows (no
  communication) and, for in-place ops, relabelled to the node layout;
* the messages ``src`` / ``source``: the graph's edge layout, or replicated ``E`` rows
  (narrowed to this rank's edges);
* mesh dims other than the graph's: replicated (or pending, resolved first).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._torch_compat import SubclassFunction, once_differentiable, plain_eager
from ..rule_kit import normalize_dim, plain_gradient, resolve_partial, shard_tensor_cls, wrap
from ._graph import GraphIndex, graph_of
from ._requests import table
from ._rows import rows_local

__all__ = ["aggregate", "index_add_local"]


def _other_dims_replicated(spec, graph) -> bool:
    return all(issubclass(type(p), Replicate) or issubclass(type(p), Partial) for m, p in enumerate(spec.placements) if m != graph.mesh_dim)


def _rows_of(local: torch.Tensor, spec, graph, node_rows: bool, name: str):
    """This rank's rows of ``local`` (non-pending layout ``spec``) in the graph's node or edge layout.

    A layout sharded over the graph's mesh dim must be the graph's own (else
    ``PlacementError``); a replicated one is narrowed to this rank's box.
    """
    check = graph.check_nodes if node_rows else graph.check_edges
    check(spec, name, allow_replicated=True)
    if issubclass(type(spec.placements[graph.mesh_dim]), Shard):
        return local
    if node_rows:
        return local.narrow(0, graph.node_offset, graph.num_local_nodes)
    return local.narrow(0, graph.edge_offset, graph.num_local_edges)


def _node_local(x, graph, name: str):
    local, spec = resolve_partial(x)
    return _rows_of(local, spec, graph, True, name)


def _edge_local(t, graph, name: str):
    if not isinstance(t, shard_tensor_cls()):
        return t if t.ndim == 0 else t.narrow(0, graph.edge_offset, graph.num_local_edges)
    local, spec = resolve_partial(t)
    return _rows_of(local, spec, graph, False, name)


def eligible(x, dim: int, index, *others) -> GraphIndex | None:
    """The graph of a ``dst`` index for an aggregation along dim 0 that the local path can serve, else None."""
    gi = graph_of(index)
    if gi is None or gi.role != "dst" or not isinstance(x, shard_tensor_cls()):
        return None
    if normalize_dim(dim, x.ndim) != 0:
        return None
    graph = gi.graph
    for t in (x, *others):
        if isinstance(t, shard_tensor_cls()) and not _other_dims_replicated(t._spec, graph):
            return None
    return gi


def aggregate(gi: GraphIndex, kind: str, x, index, src, *, in_place: bool, **options):
    """``x.<kind>(0, index, src, ...)`` with a ``dst`` index, on local tensors.

    ``kind`` is ``index_add``, ``scatter_add``, ``scatter_reduce`` or ``scatter``
    (``src`` a tensor or a number); ``options`` are the op's remaining arguments.
    """
    graph = gi.graph
    out = _node_local(x, graph, "the aggregation target (self)")
    msg = _edge_local(src, graph, "the messages (src)") if isinstance(src, torch.Tensor) else src
    idx = table(graph.dst_local, out) if kind == "index_add" else gi.local_dst(index._local_tensor)
    # Into the target's own local tensor in place; otherwise torch's out-of-place op, which writes a new
    # tensor as plain torch's does (not a clone and an in-place op: two ops in a traced graph).
    if in_place and out is x._local_tensor:
        op, args = getattr(out, f"{kind}_"), (0, idx, msg)
    else:
        op, args = getattr(torch, kind), (out, 0, idx, msg)
    out = op(*args, **(options if kind in ("index_add", "scatter_reduce") else {}))
    spec = graph.node_spec(tuple(x.shape), out.dtype)
    if in_place:
        x._local_tensor, x._spec = out, spec
        return x
    return wrap(out, spec)


def index_add_local(x, dim, index, source):
    """``torch.index_add(x, dim, index, source)`` (``alpha`` 1) with a graph's ``dst`` as one autograd node, else None.

    Taken when ``x`` is in the graph's node layout and ``source`` in its edge
    layout (same dtype), along dim 0, outside torch.compile tracing, dispatch
    modes and functorch transforms: the forward is :func:`aggregate`'s local
    op, the backward is ATen's formula on the local gradient (``grad`` for
    ``x``; its rows at the local destinations for ``source``), with no
    dispatch of the backward's ``index_select``. Every other call (None) takes
    the dispatch-level rule.
    """
    ShardTensor = shard_tensor_cls()
    if type(x) is not ShardTensor or type(source) is not ShardTensor or not isinstance(dim, int):
        return None
    gi = graph_of(index)
    if gi is None or gi.role != "dst" or len(index._spec.global_shape) != 1:  # (not index.ndim: a torch-function trip)
        return None
    xs, ss = x._spec, source._spec
    shape = xs.global_shape
    if not shape or dim not in (0, -len(shape)) or len(ss.global_shape) != len(shape):
        return None
    graph = gi.graph
    dtype = xs.tensor_meta.dtype
    if ss.tensor_meta.dtype is not dtype or shape[1:] != ss.global_shape[1:]:
        return None
    if xs is not graph.node_spec(shape, dtype) or ss is not graph.edge_spec(ss.global_shape, dtype):
        return None
    if not plain_eager():
        return None
    if not torch.is_grad_enabled() or not (x.requires_grad or source.requires_grad):
        return _local_index_add(gi, x, source)
    return _IndexAdd.apply(gi, index, x, source)


def _local_index_add(gi, x, source):
    """:func:`aggregate`'s ``index_add`` for operands already in the node and edge layouts (checked by the caller)."""
    out = x._local_tensor
    return wrap(torch.index_add(out, 0, table(gi.graph.dst_local, out), source._local_tensor), x._spec)


class _IndexAdd(SubclassFunction):
    """:func:`index_add_local`'s autograd node."""

    @staticmethod
    def forward(ctx, gi, index, x, source):
        ctx.gi, ctx.index, ctx.x_spec, ctx.source_spec = gi, index, x._spec, source._spec
        ctx.set_materialize_grads(False)
        return _local_index_add(gi, x, source)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        if type(grad) is not shard_tensor_cls():  # a plain gradient of the global shape
            grad = plain_gradient(grad, ctx.x_spec)
        needs = ctx.needs_input_grad
        g_source = None
        if needs[3]:
            if grad._spec is ctx.x_spec:
                g_source = wrap(rows_local(ctx.gi, grad._local_tensor), ctx.source_spec)
            else:  # another layout: ATen's formula through the dispatch-level rules, as the general path
                g_source = grad.index_select(0, ctx.index)
        return None, None, (grad if needs[2] else None), g_source
