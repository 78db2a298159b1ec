"""Implicit gathers: data the size of a whole sharded dim materialised on a rank that the op did not ask for.

A rule that cannot work on shards brings an operand to ``Replicate`` along a
sharded dim (an all-gather), or produces a ``Partial`` output as long as a
sharded index (every rank holds the whole index length), or gathers the
values written into a plain tensor. Each of these grows with the *global*
extent of a sharded dim: at the sizes domain parallelism exists for, it is
the whole domain on every rank. This module is where such events are
recorded and what happens then is decided:

* :func:`note` builds an :class:`ImplicitGather` (op, what was gathered, bytes
  per rank, the user's source line: the first frame outside torch, this
  package, the standard library and installed third-party packages), hands
  it to the active listeners (``physicsnemo_dp.debug.explain``), then applies
  the policy: ``"warn"`` (default) warns once per source line with the fix,
  ``"raise"`` raises :class:`~physicsnemo_dp.errors.ImplicitGatherError`,
  ``"allow"`` does nothing.
* :func:`implicit_gathers` sets the policy for a block (a context manager and
  decorator); ``PDP_IMPLICIT_GATHERS=warn|raise|allow`` sets it process-wide
  (read at every use). The state is a :class:`contextvars.ContextVar`, like
  the checking mode (:mod:`physicsnemo_dp._checking`).
* :func:`explicit` marks a block the user asked for (``full_tensor()``,
  ``redistribute()`` called from user code): nothing in it is recorded.

What is *not* an implicit gather: explicit requests (above); gradients moved
to the layout of the tensor they belong to (a whole tensor's gradient is
whole); the algorithms' own traffic (halos, ring attention's K/V passes,
ghost rows of a graph, all-to-alls that move a shard to another dim), which
never gathers a dim whole; metadata (sizes, counts). The decision reads only
layouts, which every rank shares, so under ``"raise"`` every rank raises the
same error before any data moves.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Partial, Shard

import contextlib
import os
import sys
import sysconfig
import warnings
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from ._torch_compat import OpOverload
from .errors import ImplicitGatherError, ImplicitGatherWarning

__all__ = ["ImplicitGather", "implicit_gathers", "gather_policy", "explicit", "note"]

_ENV = "PDP_IMPLICIT_GATHERS"
POLICIES = ("warn", "raise", "allow")
_POLICY: ContextVar[str | None] = ContextVar("physicsnemo_dp_implicit_gathers", default=None)
_EXPLICIT: ContextVar[bool] = ContextVar("physicsnemo_dp_explicit_gather", default=False)
_ATTRIBUTION: ContextVar[tuple | None] = ContextVar("physicsnemo_dp_gather_attribution", default=None)
_LISTENERS: list = []
_WARNED: set = set()

FIX_GENERIC = (
    "shard a dim the op does not need whole (x.redistribute(placements=...)), or gather on purpose with "
    "x.full_tensor(); wrap the line in physicsnemo_dp.implicit_gathers('allow') if this is intended"
)
FIX_CONTRACTION = (
    "keep both operands of the contraction sharded the same way along the contracted dim (the result is then "
    "a pending sum), or shard a dim that is not contracted"
)
FIX_INDEX = (
    "build the graph with physicsnemo_dp.graph.build_graph and index with its g.src / g.dst (ghost rows, O(local)), "
    "or keep the indexed tensor replicated"
)
FIX_PLAIN_BUFFER = (
    "allocate the destination like the sharded input (x.new_zeros(...), torch.zeros_like(x), "
    "physicsnemo_dp.ShardTensor.from_spec) so that it stays sharded"
)

_CONTRACTIONS = ("mm", "matmul", "linear", "einsum", "bmm", "addmm", "baddbmm", "tensordot", "__matmul__", "dot", "mv")
_INDEXING = ("index", "gather", "scatter", "embedding", "getitem", "setitem", "take", "put")


@dataclass(frozen=True)
class ImplicitGather:
    """One implicit gather on this rank.

    ``op`` is the call that made it (the torch function the user called, or
    the ATen op), ``what`` the movement (``S(0) -> R 100000x64 float32``),
    ``nbytes`` the bytes one rank holds afterwards that grow with the global
    extent (the largest box over ranks, so the same number on every rank),
    ``source`` the user's ``file:line``, ``phase`` ``forward`` or
    ``backward``, ``fix`` what to change.
    """

    op: str
    kind: str
    what: str
    nbytes: int
    source: str
    phase: str
    fix: str

    def message(self) -> str:
        return (
            f"implicit gather in {self.op} ({self.phase}) at {self.source}: {self.kind} {self.what}, "
            f"{format_bytes(self.nbytes)} per rank. Fix: {self.fix}."
        )

    def __str__(self) -> str:
        return (
            f"{self.op} ({self.phase}) {self.kind} {self.what}: {format_bytes(self.nbytes)} per rank at {self.source}"
        )


def format_bytes(n: int) -> str:
    """``n`` bytes in B/KiB/MiB/GiB/TiB with three significant digits (also used by ``debug.explain``)."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- #
# Policy
# --------------------------------------------------------------------------- #
def _check(policy: str, where: str) -> str:
    value = str(policy).strip().lower()
    if value not in POLICIES:
        raise ValueError(f"{where}: implicit-gather policy must be one of {POLICIES}, got {policy!r}")
    return value


def gather_policy() -> str:
    """The policy here: the innermost :func:`implicit_gathers` block, else ``PDP_IMPLICIT_GATHERS``, else ``"warn"``."""
    policy = _POLICY.get()
    if policy is not None:
        return policy
    value = os.environ.get(_ENV)
    if value is None or not value.strip():
        return "warn"
    return _check(value, f"environment variable {_ENV}")


@contextlib.contextmanager
def implicit_gathers(policy: str = "warn") -> Iterator[None]:
    """Set what an implicit gather does inside the block: ``"warn"``, ``"raise"`` or ``"allow"``.

    ``"warn"`` (the default everywhere) warns once per source line with the
    fix; ``"raise"`` raises :class:`~physicsnemo_dp.ImplicitGatherError` on
    every rank alike, before anything moves; ``"allow"`` is silent.
    ``debug.explain`` lists the implicit gathers of a step whatever the
    policy. Re-entrant, usable as a decorator; ``PDP_IMPLICIT_GATHERS`` sets
    the policy outside any block (also for autograd's device threads, which
    do not inherit the block).
    """
    token = _POLICY.set(_check(policy, "implicit_gathers"))
    try:
        yield
    finally:
        _POLICY.reset(token)


@contextlib.contextmanager
def explicit() -> Iterator[None]:
    """Nothing inside is an implicit gather (``full_tensor()``/``redistribute()`` called by the user)."""
    token = _EXPLICIT.set(True)
    try:
        yield
    finally:
        _EXPLICIT.reset(token)


@contextlib.contextmanager
def attributed(kind: str, fix: str) -> Iterator[None]:
    """Gathers inside the block are reported as ``kind`` with ``fix`` (a rule that knows why it gathers)."""
    token = _ATTRIBUTION.set((kind, fix))
    try:
        yield
    finally:
        _ATTRIBUTION.reset(token)


def is_explicit() -> bool:
    return _EXPLICIT.get()


@contextlib.contextmanager
def listening(sink):
    """Send every implicit gather inside the block to ``sink.implicit_gather(record)`` (any policy)."""
    _LISTENERS.append(sink)
    try:
        yield sink
    finally:
        _LISTENERS.remove(sink)


# --------------------------------------------------------------------------- #
# Where: the user's line, the op, the phase (read from the stack, off the hot path)
# --------------------------------------------------------------------------- #
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_ROOTS = tuple(
    {
        os.path.abspath(p) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)
_KIND: dict[str, bool] = {}


def _is_library(filename: str) -> bool:
    """Torch, this package, the standard library, installed packages, frozen/internal code."""
    hit = _KIND.get(filename)
    if hit is None:
        import torch

        torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
        path = os.path.abspath(filename)
        hit = (
            filename.startswith("<")
            or path.startswith(_PACKAGE)
            or path.startswith(torch_dir)
            or path.startswith(_LIBRARY_ROOTS)
            or f"{os.sep}site-packages{os.sep}" in path
            or f"{os.sep}dist-packages{os.sep}" in path
        )
        _KIND[filename] = hit
    return hit


_IN_PACKAGE: dict[str, bool] = {}


def called_by_user(depth: int = 1) -> bool:
    """Whether the caller ``depth`` frames up (1: the caller of the function calling this) is outside this package."""
    filename = sys._getframe(depth + 1).f_code.co_filename
    inside = _IN_PACKAGE.get(filename)
    if inside is None:
        inside = _IN_PACKAGE[filename] = os.path.abspath(filename).startswith(_PACKAGE)
    return not inside


def _op_name(func) -> str:
    if isinstance(func, OpOverload):
        return str(func)
    name = getattr(func, "__name__", None) or str(func)
    return name


def _where() -> tuple[str, str, str]:
    """(the user's ``file:line``, the op, the phase) of the running gather."""
    frame = sys._getframe(2)
    source = None
    function_op = dispatch_op = backward_op = None
    phase = "forward"
    in_backward_entry = False
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith(_PACKAGE):
            if not in_backward_entry:
                if code.co_name == "handle_torch_function":
                    function_op = frame.f_locals.get("func", function_op)
                elif code.co_name == "handle_torch_dispatch" and dispatch_op is None:
                    dispatch_op = frame.f_locals.get("func")
                elif code.co_name == "backward" and backward_op is None:
                    backward_op = getattr(code, "co_qualname", code.co_name)
            if code.co_name in ("_backward", "_grad") and filename.endswith("autograd_entry.py"):
                in_backward_entry = True
                phase = "backward"
        if source is None and not _is_library(filename):
            source = f"{filename}:{frame.f_lineno}"
            break
        frame = frame.f_back
    op = function_op if function_op is not None else dispatch_op
    name = _op_name(op) if op is not None else (backward_op or "?")
    return source or "<unknown>", name, phase


def _fix_for(op: str) -> str:
    low = op.lower()
    bare = (low[5:] if low.startswith("aten.") else low).split(".")[0]
    if any(k in bare for k in _INDEXING):
        return FIX_INDEX
    if bare in _CONTRACTIONS:
        return FIX_CONTRACTION
    return FIX_GENERIC


# --------------------------------------------------------------------------- #
# The record
# --------------------------------------------------------------------------- #
def note(kind: str, what: str, nbytes: int, mesh, fix: str | None = None, once=None) -> None:
    """Record one implicit gather and apply the policy (raises before the caller moves anything).

    ``mesh`` is the op's mesh: the warning is printed by the rank at
    coordinate 0 on every mesh dim (one copy per mesh, not one per rank).
    ``once`` is what the warning is printed once per (default: the user's
    source line; the gather fallback passes its op).
    """
    if _EXPLICIT.get():
        return
    policy = gather_policy()
    if policy == "allow" and not _LISTENERS:
        return
    source, op, phase = _where()
    attribution = _ATTRIBUTION.get()
    if attribution is not None:
        kind, fix = f"{attribution[0]}, {kind}", attribution[1]
    record = ImplicitGather(op, kind, what, int(nbytes), source, phase, fix or _fix_for(op))
    for sink in list(_LISTENERS):
        sink.implicit_gather(record)
    if policy == "raise":
        raise ImplicitGatherError(
            record.message() + " (policy 'raise': physicsnemo_dp.implicit_gathers / PDP_IMPLICIT_GATHERS)"
        )
    key = source if once is None else once
    if policy == "warn" and key not in _WARNED:
        _WARNED.add(key)
        if _first_rank(mesh):
            filename, _, line = source.rpartition(":")
            warnings.warn_explicit(
                record.message()
                + " Silence with physicsnemo_dp.implicit_gathers('allow') or PDP_IMPLICIT_GATHERS=allow.",
                ImplicitGatherWarning,
                filename or source,
                int(line) if line.isdigit() else 0,
            )


def _first_rank(mesh) -> bool:
    try:
        coordinate = mesh.get_coordinate()
    except Exception:  # a mesh this rank is not part of, or a fake process group without coordinates
        return True
    return coordinate is None or all(c == 0 for c in coordinate)


def box_bytes(placements, dim_sizes, global_shape, itemsize: int) -> int:
    """Bytes of the largest local box of a layout (the same number on every rank)."""
    n = itemsize
    for d, extent in enumerate(global_shape):
        table = dim_sizes[d] if d < len(dim_sizes) else None
        n *= max(table) if table else extent
    return n


def describe_layout(placements) -> str:
    return "".join(f"S({p.dim})" if issubclass(type(p), Shard) else ("P" if issubclass(type(p), Partial) else "R") for p in placements)
