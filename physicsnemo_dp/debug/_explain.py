"""``explain(fn, *args)``: what every op of a model step did on this rank.

Built from outside the library, from four streams that already exist:

* a ``TorchFunctionMode`` sees every top-level call (``conv2d``, ``cat``,
  ``__add__``, ...): one forward row each, with its arguments' layouts;
* the autograd nodes those calls created get pre/post hooks, so the backward
  is filed under the node that runs (``ConvolutionBackward0``) and the
  forward op that made it;
* the collectives module sends every collective it issues to the active
  listeners (:func:`physicsnemo_dp.collectives._listening`), the same events
  :func:`~physicsnemo_dp.debug.count_collectives` sums: the per-kind totals
  of an explanation equal a counter's over the same step by construction;
* :class:`~physicsnemo_dp.debug.LiveBytes` reports every growth of the live
  bytes, attributed to the row that is running;
* every implicit gather (:mod:`physicsnemo_dp._gathers`: data the size of a
  whole sharded dim that the op did not ask for) is filed under the row that
  made it, whatever the policy, and listed in its own section.

Why rows are top-level calls and not ATen ops: the layout decisions (and the
collectives) are made per call by the op families; ATen ops inside a rule are
its local computation. Calls that return no tensor and move nothing
(``x.shape``, ``x.dim()``) are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.distributed.tensor.placement_types import Partial, Shard

from .. import _gathers, collectives
from .._gathers import ImplicitGather, format_bytes
from .._torch_compat import pytree
from ..shard_tensor import ShardTensor
from ._memory import LiveBytes

__all__ = ["Explanation", "OpRecord", "CollectiveCall", "explain"]

_AUTOGRAD_CALLS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})


@dataclass(frozen=True)
class CollectiveCall:
    """One collective: its kind (``all_reduce``, ``halo``, ...), mesh dim (by name if named) and bytes on this rank."""

    kind: str
    mesh_dim: str
    sent: int
    received: int


@dataclass
class OpRecord:
    """One row of an :class:`Explanation`.

    ``inputs``/``outputs`` describe each tensor as ``placements local-shape``
    (``S(2) 1x16x22x64``; ``plain`` for ordinary tensors). A backward row's
    inputs are the gradients arriving at its node, its outputs the ones it
    produces; ``source`` is the forward op that created the node.
    """

    index: int
    phase: str
    op: str
    source: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    collectives: list[CollectiveCall] = field(default_factory=list)
    peak_bytes: int = 0
    live_bytes: int = 0
    seconds: float = 0.0
    gathers: list[ImplicitGather] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(c.sent for c in self.collectives)

    @property
    def received(self) -> int:
        return sum(c.received for c in self.collectives)

    def as_dict(self) -> dict:
        """The row as flat, printable values (what :attr:`Explanation.records` holds)."""
        return {
            "index": self.index,
            "phase": self.phase,
            "op": self.op,
            "source": self.source,
            "inputs": "; ".join(self.inputs),
            "outputs": "; ".join(self.outputs),
            "collectives": _collective_names(self.collectives),
            "sent": self.sent,
            "received": self.received,
            "peak_bytes": self.peak_bytes,
            "live_bytes": self.live_bytes,
            "seconds": self.seconds,
            "implicit_gather_bytes": sum(g.nbytes for g in self.gathers),
        }


def _collective_names(calls: list[CollectiveCall]) -> str:
    counts: dict[str, int] = {}
    for c in calls:
        name = f"{c.kind}@{c.mesh_dim}"
        counts[name] = counts.get(name, 0) + 1
    return " ".join(name if n == 1 else f"{name}x{n}" for name, n in counts.items())


@dataclass
class Explanation:
    """Per-op table of one run of ``fn``: ``print(e)``, ``e.records`` (list of dicts), ``e.to_pandas()``.

    ``peak_bytes`` is the peak of live bytes over the whole run (as
    :class:`~physicsnemo_dp.debug.LiveBytes` counts them), ``result`` what
    ``fn`` returned.
    """

    rows: list[OpRecord]
    peak_bytes: int
    result: Any = None

    @property
    def records(self) -> list[dict]:
        """One flat dict per row: the DataFrame-like view."""
        return [r.as_dict() for r in self.rows]

    def to_pandas(self):
        """The records as a ``pandas.DataFrame`` (needs pandas).

        Raises:
            ImportError: pandas is not installed; use :attr:`records` instead.
        """
        try:
            import pandas
        except ImportError as error:
            raise ImportError("Explanation.to_pandas needs pandas; without it use .records (a list of dicts)") from error
        return pandas.DataFrame(self.records)

    def collectives(self) -> dict:
        """Totals per kind, ``{kind: {"calls", "sent", "received"}}``: the shape of ``CommCounter.summary()``."""
        out: dict[str, dict] = {}
        for row in self.rows:
            for c in row.collectives:
                entry = out.setdefault(c.kind, {"calls": 0, "sent": 0, "received": 0})
                entry["calls"] += 1
                entry["sent"] += c.sent
                entry["received"] += c.received
        return {k: out[k] for k in sorted(out)}

    def collectives_by_mesh_dim(self) -> dict:
        """Totals per ``(kind, mesh dim)``, same fields as :meth:`collectives`."""
        out: dict[tuple, dict] = {}
        for row in self.rows:
            for c in row.collectives:
                entry = out.setdefault((c.kind, c.mesh_dim), {"calls": 0, "sent": 0, "received": 0})
                entry["calls"] += 1
                entry["sent"] += c.sent
                entry["received"] += c.received
        return {k: out[k] for k in sorted(out)}

    def implicit_gathers(self) -> list[tuple[int, ImplicitGather]]:
        """Every implicit gather of the run as ``(row index, record)``: op, what moved, bytes per rank, source line, fix.

        Data the size of a whole sharded dim that an op materialised without the
        result needing it (an all-gather to Replicate, a pending sum of the
        global index length, values written into a plain tensor); listed
        whatever the policy (:func:`physicsnemo_dp.implicit_gathers`).
        """
        return [(r.index, g) for r in self.rows for g in r.gathers]

    def gathers_section(self) -> str:
        """The "implicit gathers" section of :meth:`table`."""
        found = self.implicit_gathers()
        if not found:
            return "implicit gathers: none"
        total = sum(g.nbytes for _, g in found)
        lines = [f"implicit gathers: {len(found)}, {format_bytes(total)} per rank"]
        fixes: dict[str, None] = {}
        for index, g in found:
            lines.append(f"  #{index} {g}")
            fixes.setdefault(g.fix)
        lines.extend(f"  fix: {fix}" for fix in fixes)
        return "\n".join(lines)

    def table(self, max_rows: int | None = None, width: int = 36) -> str:
        """The rows as aligned text; each cell cut to ``width`` characters, at most ``max_rows`` rows."""
        head = ("#", "phase", "op", "inputs", "outputs", "collectives", "sent", "recv", "peak", "ms")
        rows = self.rows if max_rows is None else self.rows[:max_rows]
        body = [
            (str(r.index), r.phase[:3], r.op + (f" <{r.source}>" if r.source else ""), "; ".join(r.inputs),
             "; ".join(r.outputs), _collective_names(r.collectives), format_bytes(r.sent), format_bytes(r.received),
             format_bytes(r.peak_bytes), f"{r.seconds * 1e3:.2f}")
            for r in rows
        ]  # fmt: skip
        body = [tuple(_cut(cell, width) for cell in row) for row in body]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *body]]
        if max_rows is not None and len(self.rows) > max_rows:
            lines.append(f"... {len(self.rows) - max_rows} more rows")
        totals = ", ".join(f"{k} {v['calls']} calls {format_bytes(v['sent'])} sent" for k, v in self.collectives().items())
        lines.append(f"peak live bytes {format_bytes(self.peak_bytes)}; collectives: {totals or 'none'}")
        lines.append(self.gathers_section())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def describe(t) -> str:
    """``placements local-shape`` of a tensor argument (``S(1)R 4x8``), ``plain 4x8`` for ordinary tensors."""
    if isinstance(t, ShardTensor):
        placements = "".join(_placement(p) for p in t._spec.placements)
        return f"{placements} {_shape(t._local_tensor.shape)}"
    return f"plain {_shape(t.shape)}"


def _placement(p) -> str:
    if issubclass(type(p), Shard):
        return f"S({p.dim})"
    if issubclass(type(p), Partial):
        return "P"
    return "R"


def _shape(shape) -> str:
    return "x".join(str(s) for s in shape) or "()"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return name


class Recorder(TorchFunctionMode):
    """The machinery behind :func:`explain` and :func:`~physicsnemo_dp.debug.simulate`.

    Args:
        meta: Count meta tensors' bytes (simulation).
    """

    def __init__(self, meta: bool = False) -> None:
        super().__init__()
        self.rows: list[OpRecord] = []
        self.memory = LiveBytes(meta=meta, on_grow=self._grew)
        self._depth = 0
        self._current: OpRecord | None = None
        self._engine: OpRecord | None = None
        self._nodes: dict[int, tuple[Any, str]] = {}
        self._handles: list = []
        self._started: dict[int, float] = {}

    # ------------------------------------------------------------ rows
    def _open(self, phase: str, op: str, source: str, inputs) -> OpRecord:
        row = OpRecord(len(self.rows), phase, op, source, [describe(t) for t in _tensors(inputs)])
        row.peak_bytes = row.live_bytes = self.memory.live
        self.rows.append(row)
        return row

    def _grew(self, live: int) -> None:
        row = self._current if self._current is not None else self._outside()
        row.peak_bytes = max(row.peak_bytes, live)
        row.live_bytes = live

    def _outside(self) -> OpRecord:
        """The row for work no op or node claims (the autograd engine summing gradients, say)."""
        if self._engine is None or self._engine is not self.rows[-1]:
            self._engine = self._open("backward", "(autograd engine)", "", ())
        return self._engine

    def record(self, kind: str, sent: int, received: int, mesh, mesh_dim: int) -> None:
        """Collectives' listener protocol: file one collective under the running row."""
        names = mesh.mesh_dim_names
        where = names[mesh_dim] if names else str(mesh_dim)
        row = self._current if self._current is not None else self._outside()
        row.collectives.append(CollectiveCall(kind, where, int(sent), int(received)))

    def implicit_gather(self, record: ImplicitGather) -> None:
        """Implicit gathers' listener protocol: file one under the running row."""
        row = self._current if self._current is not None else self._outside()
        row.gathers.append(record)

    # ------------------------------------------------------------ forward
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth or (self._current is not None and self._current.phase == "backward"):
            return func(*args, **kwargs)
        if func in _AUTOGRAD_CALLS:
            self._depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self._depth -= 1
        row = self._current = self._open("forward", _name(func), "", (args, kwargs))
        self._depth += 1
        start = time.perf_counter()
        try:
            out = func(*args, **kwargs)
        finally:
            row.seconds = time.perf_counter() - start
            self._depth -= 1
            self._current = None
        row.live_bytes = self.memory.live
        outputs = _tensors(out)
        row.outputs = [describe(t) for t in outputs]
        if not outputs and not row.collectives and row.peak_bytes == row.live_bytes and self.rows[-1] is row:
            self.rows.pop()  # x.shape, x.dim(), ...: nothing to report
        self._hook_nodes(outputs, row.op)
        return out

    # ------------------------------------------------------------ backward
    def _hook_nodes(self, outputs, source: str) -> None:
        """Hook every autograd node reachable from ``outputs`` that is not hooked yet, labelled with ``source``."""
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or id(node) in self._nodes:
                continue
            self._nodes[id(node)] = (node, source)  # holds the node: ids stay unique while hooked
            self._handles.append(node.register_prehook(self._node_starts(node, source)))
            self._handles.append(node.register_hook(self._node_ends(node)))
            stack.extend(n for n, _ in node.next_functions)

    def _node_starts(self, node, source: str):
        def prehook(grad_outputs):
            self._current = self._open("backward", node.name(), source, grad_outputs)
            self._started[id(node)] = time.perf_counter()

        return prehook

    def _node_ends(self, node):
        def hook(grad_inputs, grad_outputs):
            row = self._current
            if row is not None:
                row.seconds = time.perf_counter() - self._started.pop(id(node), time.perf_counter())
                row.outputs = [describe(t) for t in _tensors(grad_inputs)]
                row.live_bytes = self.memory.live
            self._current = None

        return hook

    # ------------------------------------------------------------ context
    def __enter__(self):
        self._listening = collectives._listening(self)
        self._listening.__enter__()
        self._gathers = _gathers.listening(self)
        self._gathers.__enter__()
        self.memory.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.memory.__exit__(*exc)
            self._gathers.__exit__(*exc)
            self._listening.__exit__(*exc)
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._nodes.clear()

    def explanation(self, result=None) -> Explanation:
        rows = [
            r for r in self.rows
            if r.outputs or r.collectives or r.gathers or r.phase == "forward" or r.peak_bytes > r.live_bytes
        ]
        for i, r in enumerate(rows):
            r.index = i
        return Explanation(rows, self.memory.peak, result)


def explain(fn: Callable, *args, **kwargs) -> Explanation:
    """Run ``fn(*args, **kwargs)`` (a model step: forward and backward) and return what every op did on this rank.

    One row per top-level torch call in the forward and per autograd node in
    the backward (named like ``ConvolutionBackward0 <conv2d>``), with the
    placements and local shapes of its tensors, the collectives it issued
    (kind, mesh dim, bytes this rank sent and received, counted as
    :func:`~physicsnemo_dp.debug.count_collectives` counts them), the peak of
    live bytes while it ran and its wall time. A last section lists the
    implicit gathers (:meth:`Explanation.implicit_gathers`): op, bytes per
    rank, the user's source line and the fix, whatever the policy. Every rank runs ``fn`` as
    usual (call ``explain`` on all ranks, like any collective code); each gets
    its own rank's table.

    Args:
        fn: The step to run.
        *args: Positional arguments for ``fn``.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        An :class:`Explanation`: ``print()`` it, or read ``.records``.
    """
    recorder = Recorder()
    with recorder:
        result = fn(*args, **kwargs)
    return recorder.explanation(result)
