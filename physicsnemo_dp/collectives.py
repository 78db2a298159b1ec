"""All communication of physicsnemo_dp goes through this module.

Two reasons to funnel it:

1. **Uneven shards.** gloo's ``all_gather`` refuses unequal sizes and padding to
   the largest shard wastes ``P * max - sum`` elements per rank. The "-v"
   collectives here move exactly the bytes each rank needs, using
   ``all_to_all_single`` with per-rank split sizes where sizes differ.
2. **Accounting.** Every call records what it moves in the active
   :class:`CommCounter` (see :func:`count_collectives`), so tests and
   benchmarks can compare traffic with the minimum an operation needs.

Counting convention (per rank, logical point-to-point volume, self-copies
excluded): ``bytes_received`` is what must arrive at this rank from other
ranks; ``bytes_sent`` what this rank contributes to others. For gathers and
all-to-alls these are exact. For ``all_reduce`` the figure is the volume of a
bandwidth-optimal ring (``2 (P-1)/P * n``), the lower bound for that
collective, because the backend's algorithm is not observable from Python.
Bytes are logical: elements times the caller's dtype size. Dtypes a backend
cannot carry travel as a same-size view (the same bytes) or, for reductions of
int16-like dtypes, widened (more bytes on the wire than counted); see the
collective wrappers in :mod:`physicsnemo_dp._torch_compat`.

Positions are mesh coordinates. Every split list, peer, source rank and
gathered order here is indexed by this rank's coordinate along the mesh dim
(``mesh.get_coordinate()[mesh_dim]``, the index of the size tables), not by its
rank in the dim's process group, which can differ (a mesh listing its ranks
out of increasing order, a mesh built by ``DeviceMesh.from_group``): the
functions translate to group ranks with :mod:`physicsnemo_dp._mesh_order`
(nothing to do, and nothing done, when the two coincide), so callers never
see group ranks.

Collectives are functional (``torch.distributed._functional_collectives``
addressed by ``(mesh, mesh_dim)``) so they stay traceable by ``torch.compile``.
The exceptions are point to point: :func:`send_recv` (ring schedules, eager
only) and :func:`neighbour_exchange` (halos), which runs eagerly as point to
point with its few peers and falls back to :func:`all_to_all_v` while traced.

**One-rank groups.** Over a mesh dim that holds one rank (every dim of a
world of one, the ``"ddp"`` dim of a ``1 x N`` mesh) every collective here is
an identity, a local copy at most, and none calls torch.distributed (nor the
stall check's wait, which has nothing to wait for): :func:`_alone` decides,
for every kind. The call is still recorded, with the bytes it records over
one rank (zero, except :func:`send_recv`'s payload), so counters and
``debug.explain`` see the same records at every world size.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import _mesh_order, _stall
from . import _torch_compat as tc

__all__ = ["CommCounter", "WaitClock", "count_collectives", "overlap", "wait_clock"]


@dataclass
class CommCounter:
    """What this rank's collectives moved while the counter was active."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes_sent: dict = field(default_factory=lambda: defaultdict(int))
    bytes_received: dict = field(default_factory=lambda: defaultdict(int))

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.bytes_received.values())

    def record(self, kind: str, sent: int, received: int, mesh: DeviceMesh | None = None, mesh_dim: int | None = None) -> None:
        """Add one collective; ``mesh``/``mesh_dim`` say where it ran (a counter only totals per kind)."""
        self.calls[kind] += 1
        self.bytes_sent[kind] += int(sent)
        self.bytes_received[kind] += int(received)

    def summary(self) -> dict:
        return {
            k: {"calls": self.calls[k], "sent": self.bytes_sent[k], "received": self.bytes_received[k]}
            for k in sorted(self.calls)
        }


#: Everything listening to the collectives: counters, and ``debug.explain``'s
#: recorder, which files the same events under the op that issued them (so a
#: counter's totals are a view of explain's records: the same stream, summed).
_ACTIVE: list = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounter]:
    """Count every collective issued by physicsnemo_dp on this rank inside the block.

    Counters nest: an inner block's traffic is also seen by outer ones.
    """
    with _listening(CommCounter()) as counter:
        yield counter


@contextlib.contextmanager
def _listening(sink):
    """Send every collective inside the block to ``sink.record(kind, sent, received, mesh, mesh_dim)``."""
    _ACTIVE.append(sink)
    try:
        yield sink
    finally:
        _ACTIVE.remove(sink)


@dataclass
class WaitClock:
    """Seconds spent waiting for collectives to complete while the clock ran, per kind.

    Only the wait is timed (from the call that blocks until the transfer is
    done to its return), not posting the collective or packing its buffers:
    the time the main thread could have computed had the data been there.
    Kinds: the stall check's names for collectives (``all_to_all``,
    ``all_gather``, ``all_reduce``, ``broadcast``), ``send_recv`` for ring
    hops and the neighbour-exchange kind (``halo``) for halos.
    """

    seconds: dict = field(default_factory=lambda: defaultdict(float))
    waits: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.waits[kind] += 1

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@contextlib.contextmanager
def wait_clock() -> Iterator[WaitClock]:
    """Time every wait for an eager collective of physicsnemo_dp in this process while the block runs.

    Cheap (two ``perf_counter`` calls per wait while a clock runs, one list
    test otherwise), so benchmarks time whole training steps with it. The
    clocks are the process's, so waits in autograd's device threads (backward
    of CUDA tensors) count too. Waits inside compiled graphs are the graph's
    own and are not seen. Clocks nest.
    """
    clock = WaitClock()
    _stall.CLOCKS.append(clock)
    try:
        yield clock
    finally:
        _stall.CLOCKS.remove(clock)


_OVERLAP: ContextVar[str] = ContextVar("physicsnemo_dp_overlap", default="auto")
_OVERLAP_MODES = ("auto", "on", "off")


@contextlib.contextmanager
def overlap(mode: str) -> Iterator[None]:
    """Whether communication overlaps computation in the block (a measuring and debugging switch).

    * halos of stride-1 "same" convolutions (``spatial/_seam_conv.py``): the
      exchange is posted, the interior convolved, and the exchange waited for
      only for the seam rows (backward: the seams' gradients sent back while
      the interior's backward runs). ``"auto"`` (the default) where the local
      input holds at least 64 KiB, ``"on"`` always;
    * ring attention: the next hop's K/V (and the travelling dK/dV) in flight
      while the current block computes (``"auto"`` and ``"on"``).

    ``"off"`` waits for every transfer as soon as it is posted (exchange, then
    compute). Results are the same bits in every mode: only the order of a
    rank's work changes, so ranks need not agree on the mode. The mode is a
    context variable: backward reads the one of the thread it runs on (on CPU,
    the caller of ``backward``; autograd's device threads see ``"auto"``).
    """
    if mode not in _OVERLAP_MODES:
        raise ValueError(f"overlap mode must be one of {_OVERLAP_MODES}, got {mode!r}")
    token = _OVERLAP.set(mode)
    try:
        yield
    finally:
        _OVERLAP.reset(token)


def overlap_mode() -> str:
    """The mode of the innermost :func:`overlap` block (``"auto"`` outside any)."""
    return _OVERLAP.get()


def _wait_works(works, kind: str) -> None:
    """Wait for point-to-point works (posted by :func:`_post`), timed by any running :func:`wait_clock`."""
    if not works:
        return
    start = time.perf_counter() if _stall.CLOCKS else None
    for work in works:
        work.wait()
    if start is not None:
        _stall.waited(kind, start)


def _record(kind: str, sent: int, received: int, mesh: DeviceMesh, mesh_dim: int) -> None:
    for sink in _ACTIVE:
        sink.record(kind, sent, received, mesh, mesh_dim)


def _alone(mesh: DeviceMesh, mesh_dim: int) -> bool:
    """Whether ``mesh_dim`` holds this rank only: its collectives are identities and skip torch.distributed."""
    return mesh.size(mesh_dim) == 1


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize


# --------------------------------------------------------------------------- #
# The collectives
# --------------------------------------------------------------------------- #
def all_to_all_v(
    chunks_in: torch.Tensor,
    in_splits: Sequence[int],
    out_splits: Sequence[int],
    mesh: DeviceMesh,
    mesh_dim: int,
    kind: str = "all_to_all",
) -> torch.Tensor:
    """Exchange rows (dim 0) with every rank of ``mesh_dim``; split sizes may differ per rank.

    ``chunks_in`` holds, concatenated along dim 0, the rows for coordinate 0,
    1, ... of ``mesh_dim``; ``in_splits[j]`` rows go to coordinate ``j`` and
    ``out_splits[j]`` rows arrive from it, back to back in coordinate order.
    """
    if _alone(mesh, mesh_dim):  # the rows for this rank are all there is, both ways
        _record(kind, 0, 0, mesh, mesh_dim)
        return chunks_in
    line = _mesh_order.line(mesh, mesh_dim)
    me = line.me
    row = _nbytes(_row_numel(chunks_in), chunks_in.dtype)
    _record(kind, (sum(in_splits) - in_splits[me]) * row, (sum(out_splits) - out_splits[me]) * row, mesh, mesh_dim)
    if line.to_group is None:
        return tc.all_to_all_single(chunks_in.contiguous(), out_splits, in_splits, mesh, mesh_dim, _stall.wait)
    # The backend takes and returns pieces in group-rank order: reorder both ways (one copy each).
    in_group = [in_splits[c] for c in line.to_coord]
    out_group = [out_splits[c] for c in line.to_coord]
    received = tc.all_to_all_single(
        _reordered(chunks_in, in_splits, line.to_coord), out_group, in_group, mesh, mesh_dim, _stall.wait
    )
    return _reordered(received, out_group, line.to_group)


def _reordered(rows: torch.Tensor, splits: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """The pieces ``rows.split(splits)`` back to back as ``order`` picks them (piece ``order[k]`` k-th)."""
    pieces = rows.split([int(s) for s in splits])
    return torch.cat([pieces[i] for i in order])


def neighbour_exchange(
    chunks_in: torch.Tensor,
    send_peers: Sequence[tuple[int, int]],
    recv_peers: Sequence[tuple[int, int]],
    mesh: DeviceMesh,
    mesh_dim: int,
    kind: str = "neighbour_exchange",
) -> torch.Tensor:
    """:func:`all_to_all_v` with only the ranks that exchange rows: O(peers) per call, not O(group size).

    ``send_peers`` and ``recv_peers`` list ``(coordinate, rows)`` in increasing
    coordinate along ``mesh_dim``, ``rows > 0``; ranks left out exchange
    nothing with this one.
    ``chunks_in`` holds the rows for the send peers back to back in that
    order; the result holds the rows from the receive peers back to back in
    theirs (the order :func:`all_to_all_v` uses, which it equals). Every pair
    of ranks must agree: ``(b, n)`` in ``a``'s send peers exactly when ``(a, n)``
    is in ``b``'s receive peers. Rows to this rank itself are a local copy.

    Bytes are recorded as :func:`all_to_all_v` records them (self excluded),
    so counts do not depend on how the rows travel. That is:

    * real tensors, eagerly: one ``batch_isend_irecv`` with the peers only
      (a halo touching two neighbours costs two sends and two receives, and
      no ``P``-long split list is built or checked);
    * meta tensors (``debug.simulate``): the result's shape only;
    * while torch.compile traces: :func:`all_to_all_v` with the dense split
      lists, since point to point has no graph representation. A rank
      running the compiled graph therefore pairs only with ranks running it
      too, never with one running the same exchange eagerly.
    """
    return post_neighbour_exchange(chunks_in, send_peers, recv_peers, mesh, mesh_dim, kind).wait()


def post_neighbour_exchange(
    chunks_in: torch.Tensor,
    send_peers: Sequence[tuple[int, int]],
    recv_peers: Sequence[tuple[int, int]],
    mesh: DeviceMesh,
    mesh_dim: int,
    kind: str = "neighbour_exchange",
) -> "Posted":
    """:func:`neighbour_exchange` posted, not waited for: ``.wait()`` on the result returns what it returns.

    Lets a caller compute what needs no foreign rows (a convolution's
    interior) while the rows travel. Arguments are checked as
    :func:`neighbour_exchange` checks them (it is this, then ``wait``). While
    torch.compile traces, the exchange is the functional :func:`all_to_all_v`
    (already issued; the graph waits where the rows are first read). One
    posted exchange per mesh dim at a time: every rank must wait for it before
    it posts the next one on the same group (point-to-point messages between
    two ranks match in posting order).
    """
    group = mesh.size(mesh_dim)
    me = _mesh_order.coordinate(mesh, mesh_dim)
    _check_peers("send_peers", send_peers, group)
    _check_peers("recv_peers", recv_peers, group)
    sending = sum(n for _, n in send_peers)
    if chunks_in.ndim == 0 or chunks_in.shape[0] != sending:
        raise ValueError(
            f"chunks_in must hold the {sending} rows of send_peers along dim 0, got shape {tuple(chunks_in.shape)}"
        )
    to_me, from_me = dict(send_peers).get(me), dict(recv_peers).get(me)
    if to_me != from_me:
        raise ValueError(f"rank {me} sends itself {to_me} rows (send_peers) but receives {from_me} (recv_peers)")
    if tc.tracing(chunks_in):
        dense = _dense(send_peers, group), _dense(recv_peers, group)
        return Posted(all_to_all_v(chunks_in, *dense, mesh, mesh_dim, kind))
    row = _nbytes(_row_numel(chunks_in), chunks_in.dtype)
    receiving = sum(n for _, n in recv_peers)
    _record(kind, (sending - (to_me or 0)) * row, (receiving - (from_me or 0)) * row, mesh, mesh_dim)
    if _alone(mesh, mesh_dim):  # rows to this rank itself, if any: a local copy
        return Posted(chunks_in.clone(memory_format=torch.contiguous_format) if to_me else chunks_in.new_empty(chunks_in.shape))
    received = chunks_in.new_empty((receiving, *chunks_in.shape[1:]))
    if chunks_in.device.type == "meta":  # debug.simulate: shapes without data; the bytes are counted above
        return Posted(received)
    sends = dict(zip((r for r, _ in send_peers), chunks_in.contiguous().split([n for _, n in send_peers])))
    recvs = dict(zip((r for r, _ in recv_peers), received.split([n for _, n in recv_peers])))
    if to_me:
        recvs.pop(me).copy_(sends.pop(me))
    works, wires, landing = _post(sends.items(), recvs.items(), mesh, mesh_dim, tag=0)
    return Posted(received, works, wires, landing, kind)


@dataclass
class Posted:
    """A posted :func:`post_neighbour_exchange`: :meth:`wait` returns the received rows (once the works are done).

    Holds the send buffers until the wait (the backend reads them while the
    works run).
    """

    received: torch.Tensor
    works: list = field(default_factory=list)
    sent: list = field(default_factory=list)
    landing: list = field(default_factory=list)
    kind: str = "neighbour_exchange"

    def wait(self) -> torch.Tensor:
        _wait_works(self.works, self.kind)
        _land(self.landing)
        self.works, self.sent, self.landing = [], [], []
        return self.received


def _check_peers(name: str, peers: Sequence[tuple[int, int]], group: int) -> None:
    """Peers must be ``(coordinate, rows)`` with increasing coordinates inside the mesh dim and ``rows > 0``."""
    previous = -1
    for peer in peers:
        if len(peer) != 2 or not previous < peer[0] < group or peer[1] <= 0:
            raise ValueError(
                f"{name} must be (coordinate, rows) pairs with increasing coordinates in [0, {group}) and rows > 0, "
                f"got {tuple(peers)}"
            )
        previous = peer[0]


def _dense(peers: Sequence[tuple[int, int]], group: int) -> list[int]:
    """The ``group``-long split list of :func:`all_to_all_v` for a peer list."""
    splits = [0] * group
    for r, n in peers:
        splits[r] = n
    return splits


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def all_gather_v(
    local: torch.Tensor, sizes: Sequence[int], dim: int, mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """Concatenate every rank's ``local`` along ``dim``; ``sizes[j]`` is rank j's extent.

    Equal sizes use the backend's all-gather; unequal ones an all-to-all in
    which each rank sends its shard once to every other rank (no padding).
    Over more than one rank the result is contiguous, whatever the strides of
    ``local`` (see :func:`_concat`).
    """
    if _alone(mesh, mesh_dim):
        _record("all_gather", 0, 0, mesh, mesh_dim)
        return local
    group = mesh.size(mesh_dim)
    line = _mesh_order.line(mesh, mesh_dim)
    me = line.me
    sizes = [int(s) for s in sizes]
    row = _row_numel(local.movedim(dim, 0)) if local.ndim else 1
    _record(
        "all_gather",
        _nbytes(sizes[me] * row, local.dtype) * (group - 1),
        _nbytes((sum(sizes) - sizes[me]) * row, local.dtype),
        mesh,
        mesh_dim,
    )
    dim = dim % max(local.ndim, 1)
    flat = local.contiguous().reshape(-1)  # no copy for a contiguous shard
    arriving = sizes if line.to_coord is None else [sizes[c] for c in line.to_coord]  # in group-rank order
    if len(set(sizes)) == 1:
        received = tc.all_gather_tensor(flat, 0, mesh, mesh_dim, _stall.wait)
    else:
        block = _block_numel(local.shape, dim)
        send = flat.repeat(group)  # the shard once per destination, contiguous as the backend reads it
        received = tc.all_to_all_single(send, [s * block for s in arriving], [flat.numel()] * group, mesh, mesh_dim, _stall.wait)
    return _concat(received, local.shape, arriving, dim, line.to_group)


def _block_numel(shape, dim: int) -> int:
    """Elements per unit of extent along ``dim`` (the product of the other dims)."""
    n = 1
    for d, s in enumerate(shape):
        n *= 1 if d == dim else s
    return n


def _concat(received: torch.Tensor, shape, sizes: Sequence[int], dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank's shard, received back to back, as one contiguous concatenation along ``dim``.

    ``sizes`` are the extents as received; ``order`` (None: as received)
    lists which received shard comes k-th in the result: the shards arrive in
    group-rank order and the result is in coordinate order.

    Shards travel in their own (contiguous) memory order, so the gather needs
    no send-side transpose. When every dim before ``dim`` has extent 1 the
    received buffer already *is* the contiguous result (no copy); otherwise
    one ``cat`` writes it. Gathering along dim 0 of a moved copy instead costs
    a send-side copy and leaves the strides of the concatenation, which
    ``.view`` cannot use.
    """
    shape = list(shape)
    outer = 1
    for s in shape[:dim]:
        outer *= s
    if outer == 1 and order is None:
        return received.view(*shape[:dim], sum(sizes), *shape[dim + 1 :])
    block = _block_numel(shape, dim)
    pieces = [p.view(*shape[:dim], s, *shape[dim + 1 :]) for p, s in zip(received.split([s * block for s in sizes]), sizes)]
    return torch.cat(pieces if order is None else [pieces[i] for i in order], dim=dim)


def reduce_scatter_v(
    local: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    reduce_op: str,
    mesh: DeviceMesh,
    mesh_dim: int,
) -> torch.Tensor:
    """Reduce every rank's ``local`` and keep piece ``me`` of ``sizes`` along ``dim``.

    Each rank sends piece ``j`` to rank ``j`` once and reduces what arrives:
    ``(P-1) * piece`` bytes in, the minimum for a reduce-scatter.
    """
    tc.check_reducible(local.dtype, reduce_op)
    if _alone(mesh, mesh_dim):
        _record("reduce_scatter", 0, 0, mesh, mesh_dim)
        return _finish_reduce(local, reduce_op, 1)
    group = mesh.size(mesh_dim)
    me = _mesh_order.coordinate(mesh, mesh_dim)
    sizes = [int(s) for s in sizes]
    dim = dim % local.ndim
    moved = local.movedim(dim, 0).contiguous()
    received = all_to_all_v(moved, sizes, [sizes[me]] * group, mesh, mesh_dim, kind="reduce_scatter")
    stacked = received.reshape(group, sizes[me], *moved.shape[1:])
    # Reducing over the stack of a view with the piece's dim back at ``dim``
    # writes a contiguous result directly (reductions allocate their output
    # contiguous), instead of returning the strides of the moved copy.
    return _reduce_stack(stacked.movedim(1, dim + 1), reduce_op, group)


def _reduce_stack(stacked: torch.Tensor, reduce_op: str, group: int) -> torch.Tensor:
    if reduce_op == "sum" and not (stacked.is_floating_point() or stacked.is_complex()):
        # The sum of Partial integer (or bool) tensors keeps their dtype, as
        # ``a + b`` does (wrapping; a logical or for bool) and all_reduce does;
        # ``sum(0)`` alone would promote to int64.
        return stacked.sum(0, dtype=stacked.dtype)
    if reduce_op == "sum":
        return stacked.sum(0)
    if reduce_op == "avg":
        return stacked.sum(0) / group
    if reduce_op == "max":
        return stacked.amax(0)
    if reduce_op == "min":
        return stacked.amin(0)
    raise ValueError(f"unsupported reduce op {reduce_op!r}")


def _finish_reduce(t: torch.Tensor, reduce_op: str, group: int) -> torch.Tensor:
    return t / group if reduce_op == "avg" else t


def all_reduce(tensor: torch.Tensor, reduce_op: str, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Reduce over ``mesh_dim``; ``reduce_op`` is one of sum, avg, max, min."""
    tc.check_reducible(tensor.dtype, reduce_op)  # on one rank too: what is refused must not depend on the mesh
    if _alone(mesh, mesh_dim):
        _record("all_reduce", 0, 0, mesh, mesh_dim)
        return tensor
    group = mesh.size(mesh_dim)
    ring = _nbytes(tensor.numel(), tensor.dtype) * 2 * (group - 1) // group
    _record("all_reduce", ring, ring, mesh, mesh_dim)
    op = "sum" if reduce_op == "avg" else reduce_op
    out = tc.all_reduce(tensor.contiguous(), op, mesh, mesh_dim, _stall.wait)
    return _finish_reduce(out, reduce_op, group)


def broadcast(tensor: torch.Tensor, src: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Copy ``tensor`` from coordinate ``src`` of ``mesh_dim`` to all its ranks."""
    if _alone(mesh, mesh_dim):
        _record("broadcast", 0, 0, mesh, mesh_dim)
        return tensor
    group = mesh.size(mesh_dim)
    line = _mesh_order.line(mesh, mesh_dim)
    me = line.me
    n = _nbytes(tensor.numel(), tensor.dtype)
    _record("broadcast", n * (group - 1) if me == src else 0, 0 if me == src else n, mesh, mesh_dim)
    return tc.broadcast(tensor.contiguous(), src if line.to_group is None else line.to_group[src], mesh, mesh_dim, _stall.wait)


def gather_ints(values: Sequence[int], mesh: DeviceMesh) -> list[list[int]]:
    """Every rank's list of ints (all the same length), ordered like ``mesh.mesh.flatten()``.

    Used for metadata (shapes, dtypes). Gathers mesh dim by mesh dim, so it
    needs no process group spanning the whole mesh.
    """
    if all(_alone(mesh, m) for m in range(mesh.ndim)):  # this rank's row is the table: no tensor round trip
        for m in reversed(range(mesh.ndim)):
            _record("all_gather", 0, 0, mesh, m)
        return [[int(v) for v in values]]
    block = torch.tensor(list(values), dtype=torch.int64, device=mesh_device(mesh)).reshape(
        (1,) * mesh.ndim + (len(values),)
    )
    for m in reversed(range(mesh.ndim)):
        block = all_gather_v(block, [1] * mesh.size(m), m, mesh, m)
    return block.reshape(-1, len(values)).tolist()


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """Device that collectives on this mesh use (``cpu`` for gloo, the current accelerator otherwise)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


# --------------------------------------------------------------------------- #
# Point-to-point (ring schedules)
# --------------------------------------------------------------------------- #
@dataclass
class Exchange:
    """A posted :func:`send_recv`: call :meth:`wait` before reading what arrives.

    Holding the handle lets a ring schedule post the next block's transfer,
    compute on the current block, and only then wait.
    """

    received: list
    works: list
    sent: list = field(default_factory=list)  # keeps send buffers alive until wait()
    landing: list = field(default_factory=list)  # (device buffer, host buffer) received through host memory

    def wait(self) -> list:
        _wait_works(self.works, "send_recv")
        _land(self.landing)
        self.works, self.sent, self.landing = [], [], []
        return self.received


def send_recv(
    send: Sequence[torch.Tensor],
    to_rank: int,
    recv_like: Sequence[tuple],
    from_rank: int,
    mesh: DeviceMesh,
    mesh_dim: int,
    tag: int = 0,
) -> Exchange:
    """Post sends of ``send`` to coordinate ``to_rank`` of ``mesh_dim`` and receives from ``from_rank``.

    ``recv_like`` lists ``(shape, dtype)`` of the tensors that arrive (the
    receiver always knows them from the layout, so nothing but payload moves).
    Both are coordinates along ``mesh_dim``, other than this rank's, except
    in a ring of one (a mesh dim of one rank), where the rank receives what it
    sends: local copies, no torch.distributed call. Empty tensors are not
    transmitted, on either side, so uneven layouts with empty shards need no
    special casing. Uses ``batch_isend_irecv`` (gloo and NCCL alike); ``tag``
    keeps two outstanding exchanges between the same ranks apart on backends
    that match by tag. Eager only: this has no graph representation.
    """
    device = send[0].device if len(send) else mesh_device(mesh)
    received = [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in recv_like]
    sent = [t.contiguous() for t in send if t.numel()]
    _record(
        "send_recv",
        sum(_nbytes(t.numel(), t.dtype) for t in sent),
        sum(_nbytes(t.numel(), t.dtype) for t in received),
        mesh,
        mesh_dim,
    )
    if device.type == "meta":  # debug.simulate: shapes without data; the bytes are counted above
        return Exchange(received, [], sent)
    if _alone(mesh, mesh_dim):  # a ring of one: what this rank sends is what it receives, in order
        for r, t in zip([r for r in received if r.numel()], sent):
            r.copy_(t.reshape(r.shape))
        return Exchange(received, [], sent)
    works, wires, landing = _post([(to_rank, t) for t in sent], [(from_rank, t) for t in received], mesh, mesh_dim, tag)
    return Exchange(received, works, wires, landing)


def _through_host(group, device: torch.device) -> bool:
    """Whether point-to-point transfers of ``device`` tensors on ``group`` must go through host memory.

    gloo sends and receives CPU tensors only (torch.distributed's backend table:
    send/recv on GPU ✘, while its collectives take CUDA tensors), so ranks
    sharing a GPU over gloo stage their halo and ring transfers through the host.
    """
    if device.type in ("cpu", "meta"):
        return False
    backend = str(torch.distributed.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl": the backend that serves this device type
        backend = dict(part.split(":", 1) for part in backend.split(",")).get(device.type, "")
    return backend == "gloo"


def _land(landing) -> None:
    """Copy what arrived in host buffers into the device buffers the caller reads (after the works' wait)."""
    for device_buffer, host_buffer in landing:
        device_buffer.copy_(host_buffer)


def _post(sends, recvs, mesh: DeviceMesh, mesh_dim: int, tag: int) -> tuple[list, list, list]:
    """Post ``(coordinate, tensor)`` sends and receives as one ``batch_isend_irecv`` (to the coordinates' group ranks).

    Returns the work handles, the send buffers as they travel, which must
    stay alive until the works are waited for, and the ``(device buffer, host
    buffer)`` pairs to copy with :func:`_land` after the wait when the
    backend moves only host tensors point to point (:func:`_through_host`).

    Empty tensors are skipped on both sides (each side knows the shapes).
    gloo moves any dtype point to point (it sends bytes), other backends need
    a dtype they know (NCCL has no int16): every payload travels as a
    same-size view, a receive buffer's view filling the buffer itself.
    """
    group = mesh.get_group(mesh_dim)
    to_group = _mesh_order.line(mesh, mesh_dim).to_group
    peer = (lambda c: c) if to_group is None else to_group.__getitem__
    p2p = torch.distributed.P2POp
    sends = [(r, t) for r, t in sends if t.numel()]
    recvs = [(r, t) for r, t in recvs if t.numel()]
    landing = []
    first = sends[0][1] if sends else (recvs[0][1] if recvs else None)
    if first is not None and _through_host(group, first.device):
        sends = [(r, t.cpu()) for r, t in sends]  # a synchronous copy: the host buffer is ready when isend starts
        landing = [(t, torch.empty(t.shape, dtype=t.dtype, device="cpu")) for _, t in recvs]
        recvs = [(r, host) for (r, _), (_, host) in zip(recvs, landing)]
    wires = [(r, tc.wire_view(t)) for r, t in sends]
    ops = [p2p(torch.distributed.isend, t, group=group, group_peer=peer(r), tag=tag) for r, t in wires]
    ops += [p2p(torch.distributed.irecv, tc.wire_view(t), group=group, group_peer=peer(r), tag=tag) for r, t in recvs]
    return (torch.distributed.batch_isend_irecv(ops) if ops else []), [t for _, t in wires], landing
