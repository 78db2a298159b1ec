"""Hypothesis strategies that draw one *case*: an op, its inputs' layouts and memory layouts.

Hypothesis runs in the pytest process only; ranks never draw. A :class:`Case` is a
small picklable description that the test process sends to every rank as one harness
job (see ``_runner.py``), so every rank builds exactly the same example and
Hypothesis can shrink a failing case like any other value.

What a case varies:

- the mesh: world sizes 1-4 (1-D ``("domain",)``) and the 2x2 ``("ddp", "domain")`` mesh,
  with its ranks in increasing order or (:func:`permuted`) in any order;
- per sharded input, its placements (any dim, Replicate, nested sharding of one dim
  over both mesh dims) and the explicit size of every shard, empty ones included;
- per rank, the *memory* layout of its local tensor (:data:`MEMORY_LAYOUTS`): the
  values never change, only strides and storage offset, which is what rules that
  read ``.stride()`` or call ``.view`` on local tensors get wrong;
- dtype (float32/float64/bfloat16/complex64/complex128 where the op allows) and requires_grad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

#: (world size, mesh shape) of every pool the harness offers.
MESHES = ((1, (1,)), (2, (2,)), (3, (3,)), (4, (4,)), (4, (2, 2)))

#: How a rank stores its local piece (same values, different strides / offset):
#: ``contiguous``; ``transposed``: stored with its last two dims swapped, viewed back;
#: ``permuted``: stored in a channels-last-like order (dim 1 last), viewed back;
#: ``expanded``: a size-1 slice expanded along ``InputCase.constant_dim`` (stride 0;
#: the input's global values are constant along that dim, so this is exact);
#: ``offset``: the interior of a larger buffer (storage offset > 0, padded strides).
MEMORY_LAYOUTS = ("contiguous", "transposed", "permuted", "expanded", "offset")

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
REAL = ("float32", "float64", "bfloat16")
COMPLEX = ("complex64", "complex128")
EXACT = ("float32", "float64")  # ops whose sharded algorithm legitimately reorders many roundings
ANY = REAL + COMPLEX  # ops torch defines for complex inputs too
ANY_EXACT = EXACT + COMPLEX


@dataclass(frozen=True)
class InputCase:
    """One tensor input of an op.

    ``placements`` is ``None`` for a plain tensor (promoted when it meets a
    ShardTensor). ``dim_sizes[d]`` lists the shard sizes along dim ``d`` (lexicographic
    over the mesh dims that shard it), ``None`` where ``d`` is not sharded.
    ``memory[r]`` is rank ``r``'s memory layout. ``kind`` is ``"float"`` (drawn in the
    case's dtype) or ``("index", high)`` (int64 in ``[0, high)``, never differentiable).
    """

    shape: tuple[int, ...]
    placements: tuple | None
    dim_sizes: tuple | None = None
    memory: tuple[str, ...] = ()
    constant_dim: int | None = None
    kind: Any = "float"


@dataclass(frozen=True)
class Case:
    """Everything every rank needs to build and check one example."""

    op: str
    world_size: int
    mesh_shape: tuple[int, ...]
    inputs: tuple[InputCase, ...]
    dtype: str
    requires_grad: bool
    seed: int
    args: dict = field(default_factory=dict)
    #: The mesh's global ranks in coordinate order (row-major), the same on every rank; None:
    #: the harness's mesh (ranks in increasing order).
    rank_order: tuple[int, ...] | None = None


def dims(max_ndim=3, min_ndim=0, max_extent=5, min_extent=0):
    """A shape strategy: small extents, empty dims allowed when ``min_extent == 0``."""
    return st.integers(min_ndim, max_ndim).flatmap(
        lambda n: st.tuples(*[st.integers(min_extent, max_extent)] * n)
    )


def _composition(draw, total: int, parts: int) -> tuple[int, ...]:
    """``parts`` non-negative sizes summing to ``total`` (empty shards allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _memory_layouts(shape, constant_dim) -> list[str]:
    options = ["contiguous", "offset"]
    if len(shape) >= 2:
        options += ["transposed", "permuted"]
    if constant_dim is not None:
        options.append("expanded")
    return options


def draw_input(draw, shape, mesh_shape, *, shardable=None, plain=False, kind="float", expand=True) -> InputCase:
    """One input of ``shape``: placements over ``mesh_shape``, shard sizes, memory layouts.

    ``shardable`` limits the dims that may be sharded (default: all); ``plain`` makes a
    plain tensor; ``expand=False`` keeps the values free of repeats (ops with ties).
    """
    shape = tuple(shape)
    if plain:
        return InputCase(shape, None, kind=kind)
    candidates = list(range(len(shape))) if shardable is None else [d % len(shape) for d in shardable if len(shape)]
    options = [Replicate()] + [Shard(d) for d in candidates]
    placements = tuple(draw(st.sampled_from(options)) for _ in mesh_shape)
    tables = []
    for d, extent in enumerate(shape):
        mesh_dims = [m for m, p in enumerate(placements) if p == Shard(d)]
        tables.append(_composition(draw, extent, math.prod(mesh_shape[m] for m in mesh_dims)) if mesh_dims else None)
    constant_dim = None
    if expand and kind == "float" and any(shape) and draw(st.booleans()):
        constant_dim = draw(st.sampled_from([d for d in range(len(shape))])) if shape else None
    world = math.prod(mesh_shape)
    memory = tuple(draw(st.sampled_from(_memory_layouts(shape, constant_dim))) for _ in range(world))
    return InputCase(shape, placements, tuple(tables), memory, constant_dim, kind)


@st.composite
def cases(draw, ops: dict, meshes=MESHES):
    """A :class:`Case` for one op of ``ops`` (a name -> :class:`_ops.Op` table)."""
    name = draw(st.sampled_from(sorted(ops)))
    op = ops[name]
    world_size, mesh_shape = draw(st.sampled_from(meshes))
    inputs, args = op.draw(draw, mesh_shape)
    dtype = draw(st.sampled_from(op.dtypes))
    requires_grad = op.grad and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return Case(name, world_size, mesh_shape, tuple(inputs), dtype, requires_grad, seed, args)


@st.composite
def permuted(draw, ops: dict, meshes=MESHES[1:]):
    """A :class:`Case` on a mesh that lists its ranks in a drawn order (``DeviceMesh("cpu", [3, 2, 1, 0])``).

    A mesh coordinate then differs from the rank in the mesh dim's process group, which
    numbers its members by increasing global rank whatever the mesh's order.
    """
    case = draw(cases(ops, meshes))
    order = tuple(draw(st.permutations(range(case.world_size))))
    return replace(case, rank_order=order)
