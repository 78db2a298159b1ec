"""The graph op family: graph-aware reads and writes that run before the generic indexing rules.

Installed by :mod:`physicsnemo_dp.catalog` after :mod:`physicsnemo_dp.rules.indexing`,
so for the ops below these handlers win; each serves calls whose index is a
graph's ``src``/``dst`` (:func:`._graph.graph_of`) and hands every other call to
the generic indexing rule or function, unchanged.

* Reads ``x[idx]``, ``index_select(x, 0, idx)``, ``gather(x, 0, idx)`` with
  ``x`` in the graph's node layout: at the function level (above autograd)
  through :class:`._rows.GraphRows`, whose backward stays O(local); at the
  dispatch level (reads inside backward formulas, e.g. ``index_add``'s) without
  autograd. ``x`` sharded over the graph's mesh dim in another layout raises
  ``PlacementError``; a replicated ``x`` takes the generic path (already local).
* Reads ``x[idx]``, ``index_select(x, 0, idx)``, ``F.embedding(idx, x)``,
  ``gather(x, 0, idx)``, ``take_along_dim(x, idx, 0)`` with any other sharded
  integer index ShardTensor and ``x`` row-sharded over one mesh dim: by
  request (:mod:`._requests`), output laid out like ``idx``.
* PyG's self loops (:mod:`._loops`): ``edge_index[:, mask]`` with a boolean mask in
  the graph's edge layout returns a derived graph's edge list (``t[mask]`` is
  marked as its edge rows); ``torch.cat`` / ``concat`` / ``concatenate`` of a
  graph's ``edge_index`` with ``arange`` loops returns the looped graph's, and of
  edge rows with ``N`` loop rows joins them in the looped graph's order. Every
  other ``cat`` and mask read goes to the generic rules.
* Writes ``index_add``, ``scatter_add``, ``scatter_reduce``, ``scatter`` (in place
  or not) with a ``dst`` index: local (:mod:`._aggregate`). ATen's backward
  formulas of these ops are reads and writes with the same index, so their
  gradients are local too.
* The same writes and ``index_put(accumulate=True)`` with any other integer
  index ShardTensor sharded over the mesh dim of the target's rows: by
  request (:mod:`._scatter`, one all-to-all of the contributions to their
  owners); into a plain destination (``torch.zeros(N, F).scatter_add_(...)``)
  through a ``before_promotion`` hook, so nothing is gathered.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..errors import PlacementError
from ..rule_kit import bind_args, normalize_dim, shard_tensor_cls, wrap
from ..rules import indexing
from ..rules.indexing.functions import _default
from ..rules.joins import cat_same_layout
from ._aggregate import aggregate, eligible, index_add_local
from ._graph import GraphIndex, graph_of
from ._loops import edge_index_graph, edge_mask_of, join, mark_comparison, mark_mask, masked_graph, tag_masked
from ._requests import RequestRead, gatherable, request_read, requestable
from ._rows import GraphRows, graph_rows
from ._scatter import plain_write, request_scatter, scatterable

__all__ = ["RULES", "FUNCTIONS"]

aten = torch.ops.aten


def _readable(x, index) -> GraphIndex | None:
    """The graph of ``index`` if ``x`` is in its node layout; None for the generic path.

    Raises ``PlacementError`` for an ``x`` on another mesh, or sharded over the
    graph's mesh dim along dim 0 in another layout (a graph of another partition).
    """
    gi = graph_of(index)
    if gi is None or not isinstance(x, shard_tensor_cls()) or not x._spec.global_shape:  # x.ndim: a torch-function trip
        return None
    graph, spec = gi.graph, x._spec
    p = spec.placements[graph.mesh_dim] if spec.mesh == graph.mesh else None
    if p is None or p == Shard(0):
        graph.check_nodes(spec, "x (the indexed tensor)")
    elif not issubclass(type(p), Shard) or p.dim != 0:
        return None
    if any(not issubclass(type(q), Replicate) for m, q in enumerate(spec.placements) if m != graph.mesh_dim):
        return None
    return gi


def _narrowed(rows, index_shape):
    """``rows`` cut to ``index_shape`` along dims >= 1: ``gather``'s result when its index broadcasts rows."""
    if tuple(index_shape[1:]) == tuple(rows.shape[1:]):
        return rows
    return rows[(slice(None),) + tuple(slice(0, k) for k in index_shape[1:])]


def _gather_ok(x, dim, index) -> bool:
    return isinstance(dim, int) and index.ndim == x.ndim and normalize_dim(dim, x.ndim) == 0


def _single_index(index):
    """The tensor of ``x[index]`` when it is one tensor (optionally followed by full slices), else None.

    Raises ``PlacementError`` when the index mixes two graphs' index tensors.
    """
    items = index if isinstance(index, tuple) else (index,)
    graphs = {id(g.graph) for g in map(graph_of, items) if g is not None}
    if len(graphs) > 1:
        raise PlacementError(
            "x[...] mixes index tensors of two different graphs; index with one graph's src or dst"
        )
    if not items or not isinstance(items[0], torch.Tensor):
        return None
    if any(not (i is Ellipsis or (isinstance(i, slice) and i == slice(None))) for i in items[1:]):
        return None
    return items[0]


# --------------------------------------------------------------------------- #
# function level (above autograd)
# --------------------------------------------------------------------------- #
def _masked(func, types, args, kwargs, generic):
    """``edge_index[:, mask]`` as a derived graph's edge list, ``t[mask]`` tagged as edge rows; else None.

    ``mask``: a 1-D boolean ShardTensor in a graph's edge layout (PyG's ``remove_self_loops``).
    """
    x, index = args
    items = index if isinstance(index, tuple) else (index,)
    if len(items) == 2 and isinstance(items[0], slice) and items[0] == slice(None):
        graph = edge_index_graph(x)
        if graph is None or edge_mask_of(items[1], graph) is None:
            return None
        out = generic(func, types, args, kwargs)
        derived = masked_graph(graph, items[1]._local_tensor, out._spec.dim_sizes[1])
        ref = derived.edge_index._spec
        if ref.placements != out._spec.placements or ref.dim_sizes != out._spec.dim_sizes:
            return out  # not laid out as a graph's edge list: the generic result stands
        mark_mask(items[1], derived)
        return derived.edge_index
    if len(items) == 1 and isinstance(items[0], shard_tensor_cls()) and items[0]._local_tensor.dtype == torch.bool:
        out = generic(func, types, args, kwargs)
        tag_masked(out, items[0])
        return out
    return None


def _bound(func, args, kwargs, names):
    values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    return values if len(values) == len(names) else None


def _functions():
    generic = indexing.FUNCTIONS

    def getitem(func, types, args, kwargs):
        x, index = args
        ShardTensor = shard_tensor_cls()
        if type(index) is ShardTensor and type(x) is ShardTensor:
            # x[g.src] with x in the graph's node layout (its spec is the graph's own): what the checks below
            # conclude for it (not a mask, one index tensor, x readable), decided by two identities
            gi = graph_of(index)
            if gi is not None and x._spec.global_shape and gi.graph.is_node_spec(x._spec):
                return GraphRows.apply(x, gi)
        out = _masked(func, types, args, kwargs, generic[func])
        if out is not None:
            return out
        t = _single_index(index)
        gi = _readable(x, t) if t is not None else None
        if gi is None:
            if t is not None and requestable(x, t) is not None:
                return RequestRead.apply(x, t, True, "indexing", None)
            return generic[func](func, types, args, kwargs)
        return GraphRows.apply(x, gi)

    def index_select(func, types, args, kwargs):
        bound = _bound(func, args, kwargs, ("input", "dim", "index"))
        gi = None
        dim0 = bound is not None and isinstance(bound[1], int) and normalize_dim(bound[1], max(bound[0].ndim, 1)) == 0
        if dim0:
            gi = _readable(bound[0], bound[2])
        if gi is None or bound[2].ndim != 1:
            if dim0 and bound[2].ndim == 1 and requestable(bound[0], bound[2]) is not None:
                return RequestRead.apply(bound[0], bound[2], False, "index_select", None)
            return generic[func](func, types, args, kwargs)
        return GraphRows.apply(bound[0], gi)

    def gather(func, types, args, kwargs):
        bound = _bound(func, args, {k: v for k, v in kwargs.items() if k != "sparse_grad"}, ("input", "dim", "index"))
        gi = None
        if bound is not None and _gather_ok(*bound) and not kwargs.get("sparse_grad", False):
            gi = _readable(bound[0], bound[2])
        if gi is None:
            if bound is not None and not kwargs.get("sparse_grad", False) and gatherable(*bound):
                return RequestRead.apply(bound[0], bound[2], False, "gather", None)
            return generic[func](func, types, args, kwargs)
        return _narrowed(GraphRows.apply(bound[0], gi), tuple(bound[2].shape))

    def take_along_dim(func, types, args, kwargs):
        a = dict(zip(("input", "indices", "dim"), args), **kwargs)
        x, index, dim = a.get("input"), a.get("indices"), a.get("dim")
        if (set(a) == {"input", "indices", "dim"} and isinstance(dim, int) and isinstance(index, torch.Tensor)
                and index.ndim == x.ndim and tuple(index.shape[1:]) == tuple(x.shape[1:]) and gatherable(x, dim, index)):
            return RequestRead.apply(x, index, False, "gather", None)
        return _default(func, args, kwargs)

    def embedding(func, types, args, kwargs):
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        a = dict(zip(names, args), **kwargs)
        plain = (a.get("max_norm") is None and not a.get("scale_grad_by_freq", False) and not a.get("sparse", False)
                 and set(a) <= set(names) and "input" in a and "weight" in a)
        if plain and requestable(a["weight"], a["input"]) is not None:
            return RequestRead.apply(a["weight"], a["input"], False, "embedding", a.get("padding_idx"))
        return _default(func, args, kwargs)

    def plain_target(kind):
        def handler(func, types, args, kwargs):
            return _default(func, args, kwargs)

        handler.before_promotion = lambda func, types, args, kwargs: plain_write(kind, func, args, kwargs)
        return handler

    def cat(func, types, args, kwargs):
        a = dict(zip(("tensors", "dim"), args), **kwargs)
        if set(a) <= {"tensors", "dim"} and "tensors" in a and isinstance(a["tensors"], (list, tuple)):
            out = cat_same_layout(a["tensors"], a.get("dim", 0))  # same-layout operands, unsharded dim
            if out is not None:
                return out
            out = join(list(a["tensors"]), a.get("dim", 0))
            if out is not None:
                return out
        return _default(func, args, kwargs)

    def index_add(func, types, args, kwargs):
        a = dict(zip(("input", "dim", "index", "source"), args), **kwargs)
        if len(a) == 4 + ("alpha" in a) and "source" in a and a.get("alpha", 1) == 1:
            out = index_add_local(a.get("input"), a.get("dim"), a.get("index"), a.get("source"))
            if out is not None:
                return out
        return _default(func, args, kwargs)

    def comparison(func, types, args, kwargs):
        out = _default(func, args, kwargs)
        for t in args[:2]:
            gi = graph_of(t)
            if gi is not None:
                mark_comparison(out, gi.graph)
                break
        return out

    table = {
        torch.Tensor.index_add_: plain_target("index_add"),
        torch.Tensor.scatter_add_: plain_target("scatter_add"),
        torch.Tensor.scatter_reduce_: plain_target("scatter_reduce"),
        torch.Tensor.index_put_: plain_target("index_put"),
    }
    for funcs, handler in (
        ((torch.cat, torch.concat, torch.concatenate), cat),
        ((torch.index_add, torch.Tensor.index_add), index_add),
        ((torch.ne, torch.eq, torch.Tensor.ne, torch.Tensor.eq, torch.Tensor.__ne__, torch.Tensor.__eq__), comparison),
        ((torch.nn.functional.embedding,), embedding),
        ((torch.Tensor.__getitem__,), getitem),
        ((torch.index_select, torch.Tensor.index_select), index_select),
        ((torch.gather, torch.Tensor.gather), gather),
        ((torch.take_along_dim, torch.Tensor.take_along_dim), take_along_dim),
    ):
        for f in funcs:
            table[f] = handler
    return table


# --------------------------------------------------------------------------- #
# dispatch level (below autograd)
# --------------------------------------------------------------------------- #
def _read_rule(op):
    generic = indexing.RULES[op]

    def rule(func, args, kwargs):
        a = bind_args(func, args, kwargs)
        x = a["self"] if op != aten.embedding.default else a["weight"]
        if op == aten.embedding.default:
            gi = None
        elif op == aten.index.Tensor:
            idx = a["indices"]
            gi = _readable(x, idx[0]) if len(idx) == 1 and idx[0] is not None else None
        elif op == aten.index_select.default:
            gi = _readable(x, a["index"]) if a["index"].ndim == 1 and normalize_dim(a["dim"], max(x.ndim, 1)) == 0 else None
        else:
            gi = _readable(x, a["index"]) if _gather_ok(x, a["dim"], a["index"]) and not a["sparse_grad"] else None
        if gi is None:
            if op == aten.embedding.default and requestable(x, a["indices"]) is not None:
                return request_read(x, a["indices"], False, "embedding")[0]
            if op == aten.index.Tensor and len(idx) == 1 and requestable(x, idx[0]) is not None:
                return request_read(x, idx[0], True, "indexing")[0]
            if (op == aten.index_select.default and a["index"].ndim == 1 and normalize_dim(a["dim"], max(x.ndim, 1)) == 0
                    and requestable(x, a["index"]) is not None):
                return request_read(x, a["index"], False, "index_select")[0]
            if op == aten.gather.default and not a["sparse_grad"] and gatherable(x, a["dim"], a["index"]):
                return request_read(x, a["index"], False, "gather")[0]
            return generic(func, args, kwargs)
        rows = graph_rows(gi, x)
        if op != aten.gather.default:
            return rows
        shape = tuple(a["index"].shape)
        local = _narrowed(rows._local_tensor, (0, *a["index"]._local_tensor.shape[1:])).contiguous()
        return wrap(local, gi.graph.edge_spec(shape, local.dtype))

    return rule


_WRITES = {
    aten.index_add_.default: ("index_add", True),
    aten.index_add.default: ("index_add", False),
    aten.scatter_add_.default: ("scatter_add", True),
    aten.scatter_add.default: ("scatter_add", False),
    aten.scatter_reduce_.two: ("scatter_reduce", True),
    aten.scatter_reduce.two: ("scatter_reduce", False),
    aten.scatter_.src: ("scatter", True),
    aten.scatter_.value: ("scatter", True),
    aten.scatter.src: ("scatter", False),
    aten.scatter.value: ("scatter", False),
}


def _write_rule(op):
    generic = indexing.RULES[op]
    kind, in_place = _WRITES[op]

    def rule(func, args, kwargs):
        a = bind_args(func, args, kwargs)
        src = a.get("source", a.get("src", a.get("value")))
        gi = eligible(a["self"], a["dim"], a["index"], src)
        if gi is None or (kind == "index_add" and a["index"].ndim != 1):
            if scatterable(kind, a["self"], a["dim"], a["index"], src) is not None:
                options = {"alpha": a["alpha"]} if kind == "index_add" else {}
                if kind == "scatter_reduce":
                    options = {"reduce": a["reduce"], "include_self": a["include_self"]}
                return request_scatter(kind, a["self"], a["index"], src, in_place=in_place, **options)
            return generic(func, args, kwargs)
        options = {}
        if kind == "index_add":
            options["alpha"] = a["alpha"]
        elif kind == "scatter_reduce":
            options = {"reduce": a["reduce"], "include_self": a["include_self"]}
        return aggregate(gi, kind, a["self"], a["index"], src, in_place=in_place, **options)

    return rule


def _index_put_rule(op, in_place: bool):
    generic = indexing.RULES[op]

    def rule(func, args, kwargs):
        a = bind_args(func, args, kwargs)
        indices = list(a["indices"])
        if a["accumulate"] and len(indices) == 1 and indices[0] is not None and indices[0].dtype != torch.bool:
            if scatterable("index_put", a["self"], 0, indices[0], a["values"]) is not None:
                return request_scatter("index_put", a["self"], indices[0], a["values"], in_place=in_place,
                                       allow_negative=True)
        return generic(func, args, kwargs)

    return rule


RULES: dict = {op: _read_rule(op) for op in (aten.index.Tensor, aten.index_select.default, aten.gather.default,
                                              aten.embedding.default)}
RULES.update({op: _write_rule(op) for op in _WRITES})
RULES[aten.index_put_.default] = _index_put_rule(aten.index_put_.default, True)
RULES[aten.index_put.default] = _index_put_rule(aten.index_put.default, False)
FUNCTIONS: dict = _functions()
