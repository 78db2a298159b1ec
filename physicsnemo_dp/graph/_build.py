"""``build_graph``: move each edge to its destination's owner and plan the ghost exchange.

Communication (on the node mesh dim's group; the metadata rows over the whole mesh):

1. one all-gather of a short row of ints per rank: a status (so a bad
   ``edge_index`` on one rank raises the same error on every rank), the
   signature of ``edge_attr``, and how many edges go to each peer;
2. **all-to-all 1**: the edges, ``(src, dst)`` and their ``edge_attr`` packed as
   bytes in one buffer, to the owner of ``dst``. Received in sending-rank order,
   each sender's edges in their original order (a stable sort by owner);
3. the ghost plan of :func:`._requests.plan_rows`: one all-gather of the ghost
   counts (how many rows each rank needs from each peer), then **all-to-all 2**:
   the sorted ghost ids, to their owners, which keep them as the rows they send
   on every gather.

Nothing else is ever exchanged for the plan; gathering features then costs one
all-to-all of exactly the ghost rows (:mod:`._rows`).
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from .. import _mesh_order, collectives
from ..errors import PlacementError
from ..rule_kit import shard_tensor_cls
from ._graph import ShardedGraph
from ._requests import group_rows, plan_rows

__all__ = ["build_graph"]

_OK, _SHAPE, _DTYPE, _RANGE, _ATTR_ROWS = 0, 1, 2, 3, 4
_HEAD = 5  # status, two detail ints, edge_attr signature, number of edges; then one count per peer


def node_mesh_dim(spec, name: str = "nodes") -> int:
    """The mesh dim that shards dim 0 of ``spec`` (exactly one must; metadata only, so all ranks agree)."""
    dims = [m for m, p in enumerate(spec.placements) if issubclass(type(p), Shard) and p.dim == 0]
    others = [m for m, p in enumerate(spec.placements) if not issubclass(type(p), Replicate) and m not in dims]
    if len(dims) != 1 or others:
        raise PlacementError(
            f"{name} must be node-sharded: dim 0 sharded over one mesh dim, every other mesh dim Replicate; "
            f"got placements {spec.placements}. Shard the nodes with ShardTensor.from_local(..., "
            f"placements=[Shard(0)]) (on a 2-D mesh, over the 'domain' dim)"
        )
    return dims[0]


def _attr_signature(edge_attr) -> int:
    """A 62-bit digest of ``edge_attr``'s dtype and trailing shape (0: no attributes), equal on all ranks."""
    if edge_attr is None:
        return 0
    text = repr((str(edge_attr.dtype), tuple(edge_attr.shape[1:])))
    return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2) + 1


def _local_status(edge_index, edge_attr, num_nodes: int, check: bool):
    """``(status, detail_a, detail_b)`` of this rank's arguments; nothing raised before the exchange."""
    if not isinstance(edge_index, torch.Tensor) or isinstance(edge_index, shard_tensor_cls()):
        return _SHAPE, -1, -1
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        return _SHAPE, edge_index.ndim, edge_index.shape[0] if edge_index.ndim else -1
    if edge_index.is_floating_point() or edge_index.is_complex() or edge_index.dtype == torch.bool:
        return _DTYPE, 0, 0
    if edge_attr is not None and (not isinstance(edge_attr, torch.Tensor) or edge_attr.ndim == 0
                                  or edge_attr.shape[0] != edge_index.shape[1]):
        rows = edge_attr.shape[0] if isinstance(edge_attr, torch.Tensor) and edge_attr.ndim else -1
        return _ATTR_ROWS, rows, edge_index.shape[1]
    if check and edge_index.numel():
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= num_nodes:
            return _RANGE, lo if lo < 0 else hi, num_nodes
    return _OK, 0, 0


def _raise_first_error(rows) -> None:
    for rank, row in enumerate(rows):
        status, a, b = row[0], row[1], row[2]
        if status == _SHAPE:
            got = "not a plain tensor" if a < 0 else f"a {a}-d tensor" + (f" with {b} rows" if a else "")
            raise PlacementError(
                f"build_graph: edge_index on rank {rank} must be a plain tensor of shape (2, E_r) "
                f"(row 0 sources, row 1 destinations, global node ids); got {got}"
            )
        if status == _DTYPE:
            raise PlacementError(
                f"build_graph: edge_index on rank {rank} must be an integer tensor (global node ids); "
                f"convert it with edge_index.long()"
            )
        if status == _ATTR_ROWS:
            raise PlacementError(
                f"build_graph: edge_attr on rank {rank} has {a} rows but edge_index has {b} edges there; "
                f"edge_attr must be a tensor (E_r, ...) aligned with edge_index's columns"
            )
        if status == _RANGE:
            raise PlacementError(
                f"build_graph: edge_index on rank {rank} references node {a}, but nodes has {b} rows "
                f"(valid ids: [0, {b - 1}]); edges must reference existing nodes by global id"
            )
    signatures = {row[3] for row in rows}
    if len(signatures) > 1:
        raise PlacementError(
            "build_graph: edge_attr differs between ranks (given on some and not others, or another dtype or "
            "trailing shape); pass the same kind of edge_attr on every rank (an empty (0, ...) tensor where a "
            "rank has no edges)"
        )


def _pack(pairs: torch.Tensor, attr) -> torch.Tensor:
    """Edges ``(E, 2)`` int64 and their attributes as one ``(E, bytes)`` uint8 buffer (one all-to-all)."""
    parts = [pairs.contiguous().view(torch.uint8)]
    if attr is not None:
        width = 1
        for k in attr.shape[1:]:
            width *= k
        parts.append(attr.contiguous().reshape(attr.shape[0], width).view(torch.uint8))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _unpack(buf: torch.Tensor, attr_like):
    pairs = buf[:, :16].contiguous().view(torch.int64)
    if attr_like is None:
        return pairs, None
    attr = buf[:, 16:].contiguous().view(attr_like.dtype).reshape(buf.shape[0], *attr_like.shape[1:])
    return pairs, attr


def build_graph(edge_index: torch.Tensor, nodes, *, edge_attr: torch.Tensor | None = None,
                check: bool = True) -> ShardedGraph:
    """Place every edge at the rank owning its destination and plan the ghost exchange (collective).

    Build it once per node partition and reuse it for every step and every
    feature tensor of that partition (datapipes cache one per sample file).

    Args:
        edge_index: Plain integer tensor ``(2, E_r)`` on every rank, global node
            ids, row 0 sources ``j``, row 1 destinations ``i`` (PyG's
            ``source_to_target``). Each edge given by exactly one rank, any
            distribution (ranks may give none).
        nodes: Node-sharded ShardTensor (dim 0 sharded over one mesh dim, uneven
            sizes allowed, every other mesh dim Replicate): the layout the graph
            is for (only its spec is used).
        edge_attr: Optional plain tensor ``(E_r, ...)`` aligned with
            ``edge_index``'s columns; it travels with its edge (same dtype and
            trailing shape on every rank).
        check: Check that every id lies in ``[0, num_nodes)`` (one min/max per rank).
            Pass False only for edge lists validated before.

    Returns:
        The :class:`ShardedGraph`. At the owner, edges are ordered by sending
        rank, then by their order at the sender.

    Raises:
        PlacementError: on every rank alike, if ``nodes`` is not node-sharded, or
            any rank's ``edge_index`` is not ``(2, E_r)`` integers, references a
            node outside ``[0, num_nodes)``, or its ``edge_attr`` does not match.
    """
    if not isinstance(nodes, shard_tensor_cls()):
        raise PlacementError(
            f"build_graph: nodes must be a node-sharded ShardTensor, got {type(nodes).__name__}"
        )
    spec = nodes._spec
    mesh_dim = node_mesh_dim(spec)
    mesh = spec.mesh
    group = mesh.size(mesh_dim)
    me = _mesh_order.coordinate(mesh, mesh_dim)
    num_nodes = spec.global_shape[0]
    ends = torch.tensor(spec.dim_sizes[0], dtype=torch.int64).cumsum(0)
    device = collectives.mesh_device(mesh)

    status = _local_status(edge_index, edge_attr, num_nodes, check)
    counts = [0] * group
    if status[0] == _OK:
        edge_index = edge_index.to(device=device, dtype=torch.int64)
        owner = torch.searchsorted(ends.to(device), edge_index[1], right=True)
        counts = torch.bincount(owner, minlength=group).tolist()
    row = [*status, _attr_signature(edge_attr), sum(counts), *counts]
    rows = collectives.gather_ints(row, mesh)
    members = group_rows(mesh, mesh_dim)
    _raise_first_error(rows)
    incoming = [rows[r][_HEAD + me] for r in members]
    edge_sizes = [sum(rows[r][_HEAD + p] for r in members) for p in range(group)]

    order = torch.sort(owner, stable=True).indices
    attr = None if edge_attr is None else edge_attr.to(device)[order]
    payload = _pack(edge_index.t()[order], attr)
    received = collectives.all_to_all_v(payload, counts, incoming, mesh, mesh_dim)
    pairs, attr = _unpack(received, attr)
    src, dst = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()

    n_local = spec.dim_sizes[0][me]
    offset = int(ends[me]) - n_local
    plan = plan_rows(src, spec.dim_sizes[0], mesh, mesh_dim)  # ghost counts, then the ghost ids to owners

    n_edges = src.shape[0]
    buffer = torch.empty(2 * n_edges + 1, dtype=torch.int64, device=device)
    buffer[:n_edges] = src
    buffer[n_edges] = -1
    buffer[n_edges + 1:] = dst
    return ShardedGraph(
        nodes_spec=spec, mesh_dim=mesh_dim, edge_sizes=edge_sizes, buffer=buffer, edge_attr=attr,
        plan=plan, dst_local=dst - offset,
    )
