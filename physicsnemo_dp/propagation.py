"""What an op *will* do, from layouts alone: output specs and the communication plan.

Propagation is kept apart from execution (as DTensor keeps its sharding
propagation apart from its dispatch): for the families on the hot path a pure
function maps ``(op, argument specs, non-tensor arguments)`` to an
:class:`OpPlan`, without tensors and memoised on its inputs, and the family's
rule only runs that plan on the local tensors. Asking the same function
without running the op answers "what will this op hold and send?":

>>> plan = propagation.plan(torch.nn.functional.linear, x.spec, replicated(mesh, (64, 32), torch.float32))
>>> plan.output_specs[0], plan.bytes_sent, [(s.kind, s.mesh_dim, s.bytes_received) for s in plan.steps]

Families served by :func:`plan` (they register a propagator in their
``PROPAGATORS`` table, which the catalog installs here through
``dispatch/table.py``): pointwise ops (any ATen op tagged pointwise), the
view ops (``view``/``reshape``/``permute``/``transpose``/``squeeze``/
``unsqueeze``/``expand``), the joins (``slice``/``split``/``narrow_copy``/
``select``/``unbind``/``cat``/``stack`` and the backward ops
``slice_backward``/``select_backward``), the reductions (``sum``/``mean``/
``amax``/``max``/``argmax``/``prod``/``logsumexp``/norms/``any``/``all``/
``var``/``std`` and their ``_mean`` forms), among the dim ops softmax/
``log_softmax`` (with their backward) and ``sort``, and the contractions
(``mm``/``bmm``/``addmm``/``baddbmm``/``mv``/``dot`` and ``torch.matmul``,
``F.linear``, ``torch.einsum``), and attention (``F.scaled_dot_product_attention``
and the fused SDPA kernels' forward and backward ops: the canonical layout, the
tile schedule and the ring's ``send_recv`` hops, uneven and causal shards
included; the function's plan covers its forward, a fused backward op's plan
its own steps). The spatial window ops plan their halos
with the same kind of memoised pure planner (``spatial/_halo_plan.py``). The
other families (indexing, the other dim ops, fft, ...) still plan inline while they
run; indexing by masks or ``nonzero`` must, because its output layout depends
on the data. A reduction's plan covers its forward; the backward's ops are
planned one by one as they run.

Bytes follow the counting convention of :mod:`physicsnemo_dp.collectives`
(per rank, self-copies excluded, ``all_reduce`` at the ring's
``2 (P - 1) / P`` bound), so the plan's bytes equal what
``count_collectives()`` records when the op runs. They are *this* rank's
bytes (uneven shards send and receive different amounts); a simulator asks
at another rank by building the specs on a mesh seen from that rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch
from torch.distributed.tensor.placement_types import Replicate

from . import _layout
from ._plan import Layout, plan as _plan_steps
from .spec import ShardTensorSpec

__all__ = [
    "CommStep", "OpPlan", "cached", "collective_step", "freeze", "is_elementwise", "plan", "redistribution_steps",
    "replicated", "register",
]


@dataclass(frozen=True)
class CommStep:
    """One collective a plan issues on this rank.

    Attributes:
        kind: the collective as :func:`~physicsnemo_dp.collectives.count_collectives` names it
            (``all_gather``, ``all_to_all``, ``reduce_scatter``, ``all_reduce``).
        mesh_dim: the mesh dim whose ranks take part.
        bytes_sent: bytes this rank sends to other ranks.
        bytes_received: bytes this rank receives from other ranks.
        operand: index of the tensor argument the step moves (among the op's tensor arguments,
            in call order), or None for a step on the output.
    """

    kind: str
    mesh_dim: int
    bytes_sent: int
    bytes_received: int
    operand: int | None = None


@dataclass(frozen=True)
class OpPlan:
    """What one op does on this rank: its output layouts and the collectives it issues.

    Attributes:
        output_specs: the spec of every tensor output, in order.
        steps: the collectives, in the order they run (:class:`CommStep`).
        operand_specs: per tensor argument, the layout its local tensor is brought to
            before the local kernel runs (None: used as it is; a plain tensor is sliced to
            the output's box without communication).
    """

    output_specs: tuple
    steps: tuple = ()
    operand_specs: tuple = ()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends over all steps."""
        return sum(s.bytes_sent for s in self.steps)

    @property
    def bytes_received(self) -> int:
        """Bytes this rank receives over all steps."""
        return sum(s.bytes_received for s in self.steps)

    def summary(self) -> dict:
        """Calls and bytes per collective kind, in the form of ``CommCounter.summary()``."""
        out: dict = {}
        for s in self.steps:
            row = out.setdefault(s.kind, {"calls": 0, "sent": 0, "received": 0})
            row["calls"] += 1
            row["sent"] += s.bytes_sent
            row["received"] += s.bytes_received
        return dict(sorted(out.items()))


def replicated(mesh, shape, dtype: torch.dtype) -> ShardTensorSpec:
    """The spec a plain tensor of ``shape``/``dtype`` gets when promoted onto ``mesh`` (Replicate)."""
    return ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, tuple(shape), dtype)


# --------------------------------------------------------------------------- #
# Redistribution: the steps of _plan.plan with their bytes
# --------------------------------------------------------------------------- #
@lru_cache(maxsize=2048)
def redistribution_steps(src: ShardTensorSpec, dst: ShardTensorSpec, operand: int | None = None) -> tuple:
    """The collectives moving a tensor from layout ``src`` to ``dst``, with this rank's bytes (memoised).

    The steps are those of the redistribution planner (:func:`physicsnemo_dp._plan.plan`,
    which ``_redistribute.redistribute_local`` executes); local steps (pad, slice,
    partition) move nothing and are left out.
    """
    mesh_shape, coord = src.mesh_shape, src.coordinate
    itemsize = src.tensor_meta.dtype.itemsize
    out: list = []
    for step in _plan_steps(
        Layout(tuple(src.placements), tuple(src.dim_sizes)), Layout(tuple(dst.placements), tuple(dst.dim_sizes)), mesh_shape
    ):
        moved = _step_bytes(step, src.global_shape, mesh_shape, coord, itemsize)
        if moved is not None:
            out.append(CommStep(*moved[:1], step.mesh_dim, *moved[1:], operand))
    return tuple(out)


def _step_bytes(step, global_shape, mesh_shape, coord, itemsize: int):
    """``(kind, bytes sent, bytes received)`` of one planner step on the rank at ``coord``, or None."""
    m, d = step.mesh_dim, step.tensor_dim
    me, group = coord[m], mesh_shape[m]
    before = step.before
    local = _layout.local_shape_of(global_shape, mesh_shape, before.placements, before.dim_sizes, coord)
    numel = prod(local)

    def sizes(layout, tensor_dim):
        return _layout.group_sizes(mesh_shape, layout.placements, layout.dim_sizes, coord, m, tensor_dim)

    if step.kind == "gather":
        s = sizes(before, d)
        row = numel // local[d] if local[d] else prod(n for k, n in enumerate(local) if k != d)
        return "all_gather", s[me] * row * itemsize * (group - 1), (sum(s) - s[me]) * row * itemsize
    if step.kind in ("all_to_all", "rebalance"):
        a = step.src_dim
        src_sizes, dst_sizes = sizes(before, a), sizes(step.after, d)
        rest = prod(n for k, n in enumerate(local) if k not in (a, d))
        if a == d:
            src_off, dst_off = _offsets(src_sizes), _offsets(dst_sizes)

            def overlap(i, j):
                return max(0, min(src_off[i] + src_sizes[i], dst_off[j] + dst_sizes[j]) - max(src_off[i], dst_off[j]))

            sent = sum(overlap(me, j) for j in range(group) if j != me) * rest
            received = sum(overlap(i, me) for i in range(group) if i != me) * rest
        else:
            sent = sum(dst_sizes[j] for j in range(group) if j != me) * src_sizes[me] * rest
            received = sum(src_sizes[i] for i in range(group) if i != me) * dst_sizes[me] * rest
        return "all_to_all", sent * itemsize, received * itemsize
    if step.kind == "all_reduce":
        ring = numel * itemsize * 2 * (group - 1) // max(group, 1)
        return "all_reduce", ring, ring
    if step.kind == "reduce_scatter":
        if group == 1:
            return "reduce_scatter", 0, 0
        s = sizes(step.after, d)
        row = prod(n for k, n in enumerate(local) if k != d)
        return "reduce_scatter", (sum(s) - s[me]) * row * itemsize, (group - 1) * s[me] * row * itemsize
    return None  # pad, slice, partition: local


def _offsets(sizes):
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def moves(specs, targets) -> tuple:
    """The steps bringing each operand spec to its target (None: stays), operands numbered in order."""
    steps: list = []
    for k, (src, dst) in enumerate(zip(specs, targets)):
        if dst is not None and src is not None:
            steps.extend(redistribution_steps(src, dst, k))
    return tuple(steps)


def freeze(value):
    """A hashable stand-in for an op argument: a ShardTensor by its spec, lists and tuples as tuples.

    What the families' memoised propagators are keyed on, so a rule and
    :func:`plan` (which receives specs) reach the same cache entry.

    Args:
        value: an op argument (a ShardTensor, a spec, a scalar, a list or tuple of them).

    Returns:
        The argument with ShardTensors replaced by their specs and sequences by tuples.
    """
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, torch.Tensor) and hasattr(value, "_spec"):
        return value._spec
    return value


def cached(propagate, *key):
    """``propagate(*key)`` through its ``lru_cache``, or uncached when the key does not hash (symbolic sizes).

    Args:
        propagate: a family's propagator wrapped in :func:`functools.lru_cache`.
        *key: its arguments, frozen with :func:`freeze`.

    Returns:
        What ``propagate`` returns.
    """
    try:
        return propagate(*key)
    except TypeError as unhashable:
        if "unhashable" not in str(unhashable):
            raise
        return propagate.__wrapped__(*key)


def collective_step(kind: str, mesh_dim: int, numel: int, itemsize: int, group: int, *, sender: bool = True, operand=None):
    """The :class:`CommStep` of one ``kind`` collective of a ``numel``-element piece per rank (bytes as counted).

    ``all_gather`` of equal pieces and the ring ``all_reduce`` cost every rank
    the same; a ``broadcast`` costs the ``sender`` ``(group - 1)`` pieces and
    every other rank one received piece.

    Args:
        kind: ``all_gather``, ``all_reduce`` or ``broadcast``.
        mesh_dim: the mesh dim whose ranks take part.
        numel: elements of the piece each rank contributes (the whole tensor for a broadcast).
        itemsize: bytes per element.
        group: ranks along ``mesh_dim``.
        sender: for a broadcast, whether this rank is the source.
        operand: the tensor argument the step moves, or None for a step on the output.

    Returns:
        The :class:`CommStep` with this rank's bytes.

    Raises:
        ValueError: ``kind`` is none of the three.
    """
    n = numel * itemsize
    if kind == "all_gather":
        return CommStep(kind, mesh_dim, n * (group - 1), n * (group - 1), operand)
    if kind == "all_reduce":
        ring = n * 2 * (group - 1) // max(group, 1)
        return CommStep(kind, mesh_dim, ring, ring, operand)
    if kind == "broadcast":
        return CommStep(kind, mesh_dim, n * (group - 1) if sender else 0, 0 if sender else n, operand)
    raise ValueError(f"collective_step: kind must be all_gather, all_reduce or broadcast, not {kind!r}")


# --------------------------------------------------------------------------- #
# The public question: what will this op do?
# --------------------------------------------------------------------------- #
_PROPAGATORS: dict = {}
_POINTWISE: list = []


_ELEMENTWISE: dict = {}


def is_elementwise(op) -> bool:
    """Whether ``op`` belongs to the pointwise family by its tag: ATen's ``pointwise`` tag and only tensor results.

    The tag alone is not enough: ``aten.equal`` is tagged pointwise and returns
    a Python bool, which no elementwise rule can wrap (its own family,
    ``rules/scalars.py``, answers it). Memoised per op.
    """
    try:
        return _ELEMENTWISE[op]
    except (KeyError, TypeError):
        pass
    schema = getattr(op, "_schema", None)
    result = (
        torch.Tag.pointwise in getattr(op, "tags", ())
        and schema is not None
        and bool(schema.returns)
        and all(str(r.type) == "Tensor" for r in schema.returns)
    )
    try:
        _ELEMENTWISE[op] = result
    except TypeError:
        pass
    return result


def register(propagators: dict) -> None:
    """Install the families' propagators (``{op: fn(op, args, kwargs) -> OpPlan}``); replaces the previous set.

    Called by ``dispatch/table.install`` with every family's ``PROPAGATORS``;
    the key ``"pointwise"`` serves every ATen op tagged pointwise that has no
    entry of its own, as in the op table.
    """
    _PROPAGATORS.clear()
    _PROPAGATORS.update(propagators)
    _POINTWISE[:] = [propagators["pointwise"]] if "pointwise" in propagators else []


def plan(op, *args, **kwargs) -> OpPlan:
    """The plan of ``op(*args, **kwargs)`` where tensor arguments are given by their specs.

    ``op`` is an ATen overload (``torch.ops.aten.add.Tensor``) or a function the
    library handles above autograd (``torch.nn.functional.linear``,
    ``torch.matmul``, ``torch.einsum``). Give a plain (promoted) tensor as
    :func:`replicated`. Pure and memoised by each family on its inputs: no
    tensor is created and nothing communicates.

    Args:
        op: the op to plan.
        *args: its positional arguments, tensors as :class:`~physicsnemo_dp.spec.ShardTensorSpec`.
        **kwargs: its keyword arguments, likewise.

    Returns:
        The :class:`OpPlan` on this rank.

    Raises:
        NotImplementedError: the op's family plans inline while it runs (see the module docstring).
    """
    fn = _PROPAGATORS.get(op) or _PROPAGATORS.get(getattr(op, "overloadpacket", None))
    if fn is None and _POINTWISE and is_elementwise(op):
        fn = _POINTWISE[0]
    if fn is None:
        raise NotImplementedError(
            f"propagation.plan: {op} belongs to a family that plans while it runs (indexing, most dim ops, ...); "
            "run it under count_collectives() to see what it moves"
        )
    return fn(op, args, kwargs)
