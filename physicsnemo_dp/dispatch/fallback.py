"""The opt-in gather fallback for ATen ops that have no ShardTensor rule.

Without it, an op no rule serves raises ``NotImplementedError`` (the clear
error of :mod:`.torch_dispatch`). Inside ``with physicsnemo_dp.fallback("gather"):``
(or with ``PDP_FALLBACK=gather`` in the environment, read at every use) the op
runs instead as one process would run it:

1. every ShardTensor operand is redistributed to ``Replicate`` on every mesh
   dim (an all-gather of each sharded operand, pending sums resolved): each
   rank then holds every operand whole;
2. the ATen op runs on those whole (plain) tensors;
3. each tensor output with the global shape of a ShardTensor operand (the
   first such operand: the first ShardTensor argument, the "primary", when
   it matches) is laid out like that operand: this rank slices its own box
   out of the whole result, no communication; any other tensor output is
   returned ``Replicate``. Non-tensor outputs pass through.

The gather is an implicit gather (:mod:`physicsnemo_dp._gathers`): recorded
with the op and the bytes per rank (the whole operands), listed by
``debug.explain``, and subject to the policy: under ``"warn"`` (default) it
warns once per op, under ``"raise"`` every rank raises the same
:class:`~physicsnemo_dp.ImplicitGatherError` before anything moves, under
``"allow"`` it is silent. Operands that are already replicated (or only
pending) cost no gather and are not recorded.

The fallback runs at the dispatch level, below autograd: the forward op is
recorded by autograd as usual and its backward ops, if they have no rule
either, go through the fallback too (so keep the backward inside the block,
or use the environment variable). Ops that write into an argument (in-place,
``out=``) or return a view of one are refused with a clear error: the whole
copy the op would write into is not the argument. So are random ops
(``nondeterministic_seeded``: ``multinomial``, ``poisson``, ``nn.LSTM``...):
each rank would draw from its own generator.

The state is a :class:`contextvars.ContextVar`, like the checking mode
(:mod:`physicsnemo_dp._checking`): blocks nest, restore on exit, and a thread
started inside a block does not inherit it.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from typing import Iterator

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import _gathers
from .._redistribute import redistribute_local
from .._torch_compat import pytree
from ..errors import PlacementError
from ..rule_kit import replicated_to_box, shard_tensor_cls, wrap
from ..spec import ShardTensorSpec

__all__ = ["fallback", "fallback_mode", "run_gathered"]

_ENV = "PDP_FALLBACK"
MODES = ("gather", "off")
_MODE: ContextVar[str | None] = ContextVar("physicsnemo_dp_fallback", default=None)

FIX = (
    "register a rule for the op (ShardTensor.register_dispatch_handler(op, handler)) that works on shards, "
    "or gather on purpose around it with x.full_tensor()"
)
NO_RULE_HINT = (
    "or run it inside `with physicsnemo_dp.fallback('gather'):` (or PDP_FALLBACK=gather), which all-gathers "
    "every sharded operand to every rank, runs the op on the whole tensors and shards the result like its input: "
    "the whole operands' memory on every rank, an implicit gather"
)


def _check(mode, where: str) -> str:
    value = "off" if mode is None else str(mode).strip().lower()
    if value in ("", "none", "0", "false", "no"):
        value = "off"
    if value not in MODES:
        raise ValueError(f"{where}: fallback mode must be one of {MODES} (or None), got {mode!r}")
    return value


def fallback_mode() -> str:
    """The fallback here: the innermost :func:`fallback` block, else ``PDP_FALLBACK``, else ``"off"``."""
    mode = _MODE.get()
    if mode is not None:
        return mode
    value = os.environ.get(_ENV)
    if value is None:
        return "off"
    return _check(value, f"environment variable {_ENV}")


@contextlib.contextmanager
def fallback(mode: str | None = "gather") -> Iterator[None]:
    """Run ATen ops that have no ShardTensor rule on whole tensors inside the block (``"gather"``), or not (``"off"``/None).

    ``"gather"``: every sharded operand is all-gathered to every rank, the op
    runs on the whole tensors, and each output shaped like a ShardTensor
    operand is sharded like it (this rank's box sliced out, no
    communication); other outputs are ``Replicate``. Each such call is an
    implicit gather (``physicsnemo_dp.implicit_gathers``: warned once per op
    with the bytes per rank, refused on every rank under ``"raise"``). In-place
    and ``out=`` ops, ops returning a view and random ops are refused. Off by default;
    re-entrant, usable as a decorator; ``PDP_FALLBACK=gather`` turns it on
    outside any block (also for autograd's device threads). Keep the backward
    inside the block: backward ops without a rule take the fallback too.
    """
    token = _MODE.set(_check(mode, "fallback"))
    try:
        yield
    finally:
        _MODE.reset(token)


def _refuse(func) -> None:
    """Ops the fallback cannot run faithfully: writes into an argument, views of one, random draws."""
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        raise NotImplementedError(
            f"ShardTensor has no rule for {func}, and physicsnemo_dp.fallback('gather') does not run it: the op "
            "draws random numbers, and each rank would draw its own from its generator, so the 'replicated' "
            "result could differ between ranks. Draw on the full tensor (every rank alike) and shard it, or "
            "build the draw from rand_like/randn_like (decomposition-invariant, docs/random.md)."
        )
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    views = any(r.alias_info is not None for r in schema.returns)
    if writes or views:
        what = f"writes into its argument(s) {', '.join(writes)} (in-place or out=)" if writes else "returns a view"
        raise NotImplementedError(
            f"ShardTensor has no rule for {func}, and physicsnemo_dp.fallback('gather') does not run it: the op "
            f"{what}, and on gathered copies the write would not reach the ShardTensor. Call the out-of-place form "
            "(e.g. x = x.op(...) instead of x.op_(...)), or gather explicitly with x.full_tensor() and build the "
            "result yourself."
        )


def run_gathered(func, args, kwargs):
    """Run ``func`` on whole operands (see the module docstring); called by the dispatch hook when no rule exists."""
    _refuse(func)
    cls = shard_tensor_cls()
    flat, tree = pytree.tree_flatten((args, kwargs))
    operands = [a for a in flat if isinstance(a, cls)]
    mesh = operands[0]._spec.mesh
    if any(o._spec.mesh != mesh for o in operands[1:]):
        raise PlacementError(
            f"{func}: ShardTensor arguments live on different device meshes; redistribute them onto one mesh first"
        )
    whole_specs = {}
    gathered, nbytes = [], 0
    for o in operands:
        spec = o._spec
        if id(o) in whole_specs:
            continue
        whole_specs[id(o)] = spec.with_layout((Replicate(),) * mesh.ndim, (None,) * len(spec.global_shape))
        if any(issubclass(type(p), Shard) for p in spec.placements):
            n = spec.tensor_meta.dtype.itemsize
            for s in spec.global_shape:
                n *= s
            nbytes += n
            shape = "x".join(map(str, spec.global_shape))
            dtype = str(spec.tensor_meta.dtype).replace("torch.", "")
            gathered.append(f"{_gathers.describe_layout(spec.placements)} -> R {shape} {dtype}")
    if gathered:  # decided on layouts alone: the same on every rank, before anything moves
        _gathers.note(
            f"all-gather of every sharded operand (no rule for {func}: physicsnemo_dp.fallback)",
            ", ".join(gathered),
            nbytes,
            mesh,
            fix=FIX,
            once=("fallback", str(func)),
        )
    whole = {}
    for o in operands:
        if id(o) not in whole:
            # recorded above as one gather of the op: the moves themselves are not recorded again
            whole[id(o)] = redistribute_local(o._local_tensor, o._spec, whole_specs[id(o)], implicit=False)
    plain_args, plain_kwargs = pytree.tree_unflatten([whole[id(a)] if isinstance(a, cls) else a for a in flat], tree)
    out = func(*plain_args, **plain_kwargs)

    by_shape = {}
    for o in operands:
        by_shape.setdefault(tuple(o._spec.global_shape), o._spec)

    def shard(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, cls):
            return t
        like = by_shape.get(tuple(t.shape))
        if like is None:
            spec = ShardTensorSpec.from_sizes(
                mesh, (Replicate(),) * mesh.ndim, tuple(t.shape), t.dtype, (None,) * t.ndim
            )
            return wrap(t, spec)
        placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in like.placements)
        spec = like.with_layout(placements, like.dim_sizes)
        local = replicated_to_box(t, spec)
        if local.numel() != t.numel():  # do not keep the whole result alive behind this rank's box
            local = local.clone()
        return wrap(local, spec)

    return pytree.tree_map(shard, out)
