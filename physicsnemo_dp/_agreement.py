"""Metadata agreement across ranks: gather every rank's facts, then validate the same table everywhere.

A check that reads only this rank's arguments raises on this rank alone: the
others go on to their next collective and wait there (a hang), or, worse, build
a tensor whose metadata differs between ranks (a silent wrong answer). Here
each rank first packs what it was given (placements as passed, its local
tensor's ndim, dtype and shape, the global shape it asked for, whether its own
arguments were valid) into one fixed-size row of ints. One all-gather gives
every rank the same table, and every decision after that reads only the table,
so every rank reaches the same verdict and raises the same error.

Used always by the paths that communicate anyway (``from_local`` "infer",
``scatter_tensor``), and by the opt-in checking mode
(:func:`physicsnemo_dp.debug.checks`) for the communication-free constructions
and for redistributions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from . import _layout, collectives
from ._torch_compat import traced
from .errors import PlacementError
from .spec import _Identity

#: dtypes by code, to compare dtypes across ranks with an int collective.
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool,
)  # fmt: skip
MAX_NDIM = 16

#: what a rank is doing when it contributes a row; rows of different operations
#: in one gather mean the ranks' programs diverged.
OPERATIONS = (
    'from_local(sharding_shapes="infer")',
    'from_local(sharding_shapes="chunk")',
    "from_local(sharding_shapes={...})",
    "scatter_tensor",
    "from_dtensor",
    "from_spec",
    "redistribute",
)

_REDUCE_OPS = ("sum", "avg", "max", "min")
_REPLICATE, _SHARD, _PARTIAL, _OTHER = range(4)
_ERRORS = (PlacementError, TypeError, ValueError)
_MESSAGE_INTS = 64  # 512 bytes of error message per rank, gathered only on the error path


_DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, -1)


# --------------------------------------------------------------------------- #
# Encoding
# --------------------------------------------------------------------------- #
def _encode_placements(placements, mesh_ndim: int) -> list[int]:
    """``[count, (kind, arg) * mesh_ndim]`` of the placements *as passed* (count -1: not a sequence).

    The raw form (not normalized) lets every rank validate every rank's
    placements against that rank's tensor after the exchange.
    """
    try:
        placements = tuple(placements)
    except TypeError:
        return [-1] + [_OTHER, 0] * mesh_ndim
    if not placements:
        return [0] * (1 + 2 * mesh_ndim)
    out = [len(placements)]
    for i in range(mesh_ndim):
        p = placements[i] if i < len(placements) else None
        if type(p) is Shard and isinstance(p.dim, int):
            out += [_SHARD, p.dim]
        elif issubclass(type(p), Replicate):
            out += [_REPLICATE, 0]
        elif type(p) is Partial:
            out += [_PARTIAL, _REDUCE_OPS.index(p.reduce_op) if p.reduce_op in _REDUCE_OPS else -1]
        else:
            out += [_OTHER, 0]
    return out


class _Unsupported(Placement):
    """Stand-in for a placement type that cannot travel as ints; validation refuses it."""

    def __repr__(self) -> str:
        return "<an unsupported placement type>"


@lru_cache(maxsize=256)
def _decode_placements(ints: tuple[int, ...]) -> tuple | None:
    """Placements from their ints (memoised: every row of a table usually holds the same few)."""
    count = ints[0]
    if count < 0:
        return None
    out = []
    for i in range(count):
        kind, arg = ints[1 + 2 * i : 3 + 2 * i] if 1 + 2 * i < len(ints) else (_REPLICATE, 0)
        if kind == _SHARD:
            out.append(Shard(arg))
        elif kind == _REPLICATE:
            out.append(Replicate())
        elif kind == _PARTIAL:
            out.append(Partial(_REDUCE_OPS[arg] if arg >= 0 else "<unsupported>"))
        else:
            out.append(_Unsupported())
    return tuple(out)


def _encode_shape(shape) -> list[int]:
    """``[ndim, *extents]`` padded to MAX_NDIM (ndim -1: absent, -2: not a sequence of at most MAX_NDIM ints)."""
    if shape is None:
        return _NO_SHAPE
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        return [-2] + [0] * MAX_NDIM
    if len(shape) > MAX_NDIM:
        return [-2] + [0] * MAX_NDIM
    return [len(shape), *shape, *([0] * (MAX_NDIM - len(shape)))]


_NO_SHAPE = [-1] + [0] * MAX_NDIM


def _decode_shape(ints: Sequence[int]):
    return tuple(ints[1 : 1 + ints[0]]) if ints[0] >= 0 else None


@dataclass(slots=True)
class Facts:
    """One rank's row, decoded (read-only by convention; slots keep decoding cheap)."""

    rank: int
    operation: str
    failed: int  # 0, or 1 + index in _ERRORS of the error its own arguments raised
    ndim: int  # of the local tensor (scatter: of the source tensor); -1 unknown
    dtype: int
    placements: tuple | None  # as passed (not normalized)
    target: tuple | None  # redistribute: the target placements
    global_shape: tuple | None  # as passed (-2 in the row: not a shape)
    bad_global_shape: bool
    shape: tuple  # local tensor (scatter: the source tensor's)
    keys: tuple[int, int]  # op-specific ints every rank must agree on (spec digests, scatter args)


def row(
    operation: str,
    error: BaseException | None,
    mesh: DeviceMesh,
    *,
    local=None,
    placements=(),
    target=(),
    global_shape=None,
    keys: tuple[int, int] = (0, 0),
) -> list[int]:
    """This rank's row (fixed length for a given mesh, whatever the arguments)."""
    is_tensor = isinstance(local, torch.Tensor) and local.ndim <= MAX_NDIM
    failed = 0 if error is None else 1 + next(i for i, e in enumerate(_ERRORS) if isinstance(error, e))
    mesh_ndim = mesh.ndim
    return [
        OPERATIONS.index(operation),
        failed,
        local.ndim if is_tensor else -1,
        dtype_code(local.dtype) if is_tensor else -1,
        *_encode_placements(placements, mesh_ndim),
        *_encode_placements(target, mesh_ndim),
        *_encode_shape(global_shape),
        *(_encode_shape(local.shape) if is_tensor else _NO_SHAPE)[1:],
        *keys,
    ]


def _decode(r: Sequence[int], rank: int, mesh_ndim: int) -> Facts:
    p = 4
    placements = _decode_placements(tuple(r[p : p + 1 + 2 * mesh_ndim]))
    p += 1 + 2 * mesh_ndim
    target = _decode_placements(tuple(r[p : p + 1 + 2 * mesh_ndim]))
    p += 1 + 2 * mesh_ndim
    global_shape = _decode_shape(r[p : p + 1 + MAX_NDIM])
    bad = r[p] == -2
    p += 1 + MAX_NDIM
    shape = tuple(r[p : p + max(r[2], 0)])
    p += MAX_NDIM
    return Facts(rank, OPERATIONS[r[0]], r[1], r[2], r[3], placements, target, global_shape, bad, shape, (r[p], r[p + 1]))


def exchange(my_row: list[int], error: BaseException | None, mesh: DeviceMesh, what: str) -> list[Facts]:
    """Every rank's facts (one all-gather of ints); raises the same error everywhere if any rank's arguments failed.

    ``error`` is what this rank's own argument checks raised (not raised yet).
    When any row reports one, the messages are gathered too (a second
    collective, on the error path only) so every rank can name each failing
    rank and what it passed.
    """
    ranks = _global_ranks(_Identity(mesh))
    table = [_decode(r, rank, mesh.ndim) for r, rank in zip(collectives.gather_ints(my_row, mesh), ranks)]
    operations = {f.operation for f in table}
    if len(operations) > 1:
        raise PlacementError(
            f"the ranks are not in the same call: {_by_value(table, lambda f: f.operation)}; every rank "
            "must construct and redistribute the same ShardTensors in the same order"
        )
    failing = [f for f in table if f.failed]
    if failing:
        texts = _gather_messages("" if error is None else str(error), mesh)
        messages = {f.rank: texts[i] for i, f in enumerate(table) if f.failed}
        cls = _ERRORS[failing[0].failed - 1]
        if len(failing) == len(table) and len(set(messages.values())) == 1:
            raise cls(next(iter(messages.values())))
        detail = "; ".join(f"{_ranks(rs)}: {m}" for m, rs in _group(messages).items())
        raise cls(f"{what}: invalid arguments on {_ranks([f.rank for f in failing])} ({detail})")
    return table


@lru_cache(maxsize=64)
def _global_ranks(mesh: _Identity) -> tuple[int, ...]:
    """Global ranks in the order of a gathered table (memoised: ``DeviceMesh.mesh`` is rebuilt on every read)."""
    return tuple(mesh.obj.mesh.flatten().tolist())


def _gather_messages(text: str, mesh: DeviceMesh) -> list[str]:
    data = text.encode("utf-8")[: 8 * _MESSAGE_INTS].ljust(8 * _MESSAGE_INTS, b"\0")
    ints = [int.from_bytes(data[8 * i : 8 * i + 8], "little", signed=True) for i in range(_MESSAGE_INTS)]
    rows = collectives.gather_ints(ints, mesh)
    return [
        b"".join(v.to_bytes(8, "little", signed=True) for v in r).rstrip(b"\0").decode("utf-8", "replace")
        for r in rows
    ]


# --------------------------------------------------------------------------- #
# Validation of a gathered table (identical on every rank, so identical verdicts)
# --------------------------------------------------------------------------- #
def _group(values_by_rank: dict) -> dict:
    groups: dict = {}
    for rank, value in values_by_rank.items():
        groups.setdefault(value, []).append(rank)
    return groups


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _by_value(table: Sequence[Facts], key) -> str:
    return "; ".join(f"{_ranks(rs)}: {v}" for v, rs in _group({f.rank: key(f) for f in table}).items())


def same_tensor_kind(table: Sequence[Facts]) -> None:
    """Every rank's local tensor has the same ndim and dtype."""
    if len({f.ndim for f in table}) > 1:
        raise PlacementError(
            "ranks passed local tensors with different numbers of dims "
            f"({_by_value(table, lambda f: f.ndim)}); every rank must pass a tensor of the same rank"
        )
    if len({f.dtype for f in table}) > 1:
        raise PlacementError(
            "ranks passed local tensors of different dtypes "
            f"({_by_value(table, lambda f: str(DTYPES[f.dtype]) if f.dtype >= 0 else 'other')}); "
            "cast them to one dtype"
        )


def same_placements(table: Sequence[Facts], mesh_ndim: int, tensor_ndim: int) -> tuple:
    """Every rank's placements, normalized for a ``tensor_ndim``-d tensor; the same on every rank.

    Each rank validates every rank's placements (the same data everywhere), so
    an out-of-range dim passed on one rank raises the same error on all.
    """
    verdicts: dict = {}  # per distinct placements (usually one): normalized, or the error text
    for placements in {f.placements for f in table}:
        try:
            verdicts[placements] = _layout.normalize_placements(placements, mesh_ndim, tensor_ndim)
        except PlacementError as err:
            verdicts[placements] = str(err)
        except TypeError:
            verdicts[placements] = "placements must be a sequence of Placement objects"
    normalized = {f.rank: verdicts[f.placements] for f in table}
    errors = {r: v for r, v in normalized.items() if isinstance(v, str)}
    if errors:
        if len(errors) == len(table) and len({f.placements for f in table}) == 1:
            raise PlacementError(next(iter(errors.values())))
        passed = _group({f.rank: (f.placements, errors.get(f.rank)) for f in table})
        detail = "; ".join(f"{_ranks(rs)} passed {p}" + (f": {m}" if m else "") for (p, m), rs in passed.items())
        raise PlacementError(f"invalid placements on {_ranks(sorted(errors))} ({detail})")
    if len(set(normalized.values())) > 1:
        raise PlacementError(
            f"ranks passed different placements ({_by_value(table, lambda f: normalized[f.rank])}); "
            "every rank must pass the same placements"
        )
    return next(iter(normalized.values()))


def global_shape_matches(table: Sequence[Facts], expected: tuple[int, ...], what: str, of: str) -> None:
    """Every rank's ``global_shape=`` argument (where given) equals ``expected`` (described by ``of``)."""
    wrong = [f for f in table if f.bad_global_shape or (f.global_shape is not None and f.global_shape != expected)]
    if wrong:
        passed = _by_value(wrong, lambda f: "not a shape" if f.bad_global_shape else f.global_shape)
        raise PlacementError(
            f"{what}: global_shape= does not match {of} ({passed}); "
            "pass the global shape of the whole tensor, or leave global_shape out"
        )


# --------------------------------------------------------------------------- #
# The checking mode's verification of a constructed or redistributed tensor
# --------------------------------------------------------------------------- #
def verify(operation: str, mesh: DeviceMesh, local, spec, error: BaseException | None, target=None) -> None:
    """Collectively check that every rank built (or moves) the same layout and holds its own box.

    ``spec`` is what this rank built (None when its arguments failed:
    ``error``); ``target`` the layout a redistribution moves to. One all-gather
    of a fixed-size row: placements, global shape, a digest of the whole spec
    (shard-size tables, dtype), and this rank's local shape, which every rank
    compares with that rank's box in the agreed spec. Skipped (a no-op) while
    torch.compile traces: the row's values are data a graph cannot branch on.
    """
    if isinstance(local, torch.Tensor) and (traced(local) or torch.compiler.is_compiling()):
        if error is not None:
            raise error
        return
    my_row = row(
        operation,
        error,
        mesh,
        local=local,
        placements=spec.placements if spec is not None else (),
        target=target.placements if target is not None else (),
        global_shape=spec.global_shape if spec is not None else None,
        keys=(spec.digest if spec is not None else 0, target.digest if target is not None else 0),
    )
    table = exchange(my_row, error, mesh, operation)
    if len({(f.placements, f.target, f.global_shape, f.keys) for f in table}) > 1:
        layouts = _by_value(
            table,
            lambda f: f"placements {f.placements}, global shape {f.global_shape}"
            + (f" -> placements {f.target}" if target is not None else "")
            + f", digest {f.keys[0] & 0xFFFF:04x}{'/%04x' % (f.keys[1] & 0xFFFF) if target is not None else ''}",
        )
        raise PlacementError(
            f"{operation}: ranks disagree on the layout ({layouts}; equal placements and shapes with "
            "different digests mean different shard sizes or dtypes); pass the same placements, "
            "sharding_shapes and global_shape on every rank"
        )
    same_tensor_kind(table)
    coords = list(_layout.all_coords(spec.mesh_shape))
    wrong = [(f, spec.local_shape_at(c)) for f, c in zip(table, coords) if f.shape != spec.local_shape_at(c)]
    if wrong:
        detail = "; ".join(f"rank {f.rank} holds {f.shape}, its box is {box}" for f, box in wrong)
        raise PlacementError(
            f"{operation}: local tensors do not match their boxes in the layout ({detail}); "
            "each rank must pass exactly its own shard"
        )


def with_checked_arguments(check) -> tuple:
    """``(check(), None)``, or ``(None, error)`` when this rank's arguments fail ``check``.

    The error is held, not raised, until after the exchange so that every rank
    raises it.
    """
    try:
        return check(), None
    except _ERRORS as err:
        return None, err
