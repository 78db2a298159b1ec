"""The machinery shared by every window op: layout, output spec, autograd.

A *window op* (convolution, pooling, padding, interpolation) maps each
*window dim* through a per-dim map of :mod:`._geometry`, passes the other dims
through (channels may change extent but are never sharded when the op mixes
them), and computes its local output from a local *window* of the input that
the halo exchange assembles. The pieces:

1. :func:`prepare_input` brings the input to a layout the op can run on:
   pending reductions resolved, window dims sharded by at most one mesh dim,
   dims the op mixes (``whole_dims``, e.g. conv channels) unsharded. A mesh
   dim that must leave its dim moves to the largest free window dim (nested
   ``(Shard(2), Shard(2))`` becomes ``(Shard(2), Shard(3))``), else another
   free dim, else Replicate — one differentiable redistribution, only when
   the input is not already in such a layout.
2. :func:`build` computes, from specs alone, the output layout (each window
   dim's size table from its map) and this rank's halo plans.
3. :class:`WindowFunction` runs the exchange and a :class:`Kernel` on local
   tensors. It keeps the received halo rows so backward rebuilds the window
   locally (no second exchange, no saved copy of the window); backward sends the window's
   gradient back to its owners and returns parameter gradients as
   ``Partial`` over the mesh dims that shard the input (promotion then sums
   them into the plain parameters' ``.grad``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Collection, Mapping, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._torch_compat import Function, non_differentiable
from .._redistribute import grad_layout
from ..propagation import CommStep
from ..rule_kit import shard_tensor_cls, to_layout, wrap
from ..spec import ShardTensorSpec
from . import _geometry, halo


# --------------------------------------------------------------------------- #
# Layout of the input
# --------------------------------------------------------------------------- #
def op_placements(spec, window_dims: Sequence[int], whole_dims: Sequence[int] = ()) -> tuple:
    """Placements close to ``spec``'s under which a window op can run (see module doc)."""
    shape, mesh_shape = spec.global_shape, spec.mesh_shape
    placements = list(spec.placements)
    claimed: set[int] = set()
    displaced = []
    for m, p in enumerate(placements):
        if issubclass(type(p), Partial):
            placements[m] = Replicate()
        elif issubclass(type(p), Shard) and (p.dim in whole_dims or (p.dim in window_dims and p.dim in claimed)):
            displaced.append(m)
        elif issubclass(type(p), Shard):
            claimed.add(p.dim)
    for m in displaced:
        free_windows = [d for d in window_dims if d not in claimed and shape[d] >= mesh_shape[m]]
        others = [
            d for d in range(len(shape))
            if d not in window_dims and d not in whole_dims and shape[d] >= mesh_shape[m]
        ]
        candidates = free_windows or others
        if candidates:
            d = max(candidates, key=lambda e: shape[e])
            placements[m] = Shard(d)
            claimed.add(d)
        else:
            placements[m] = Replicate()
    return tuple(placements)


def prepare_input(x, window_dims: Sequence[int], whole_dims: Sequence[int] = ()):
    """``x`` redistributed (differentiably) into an op-compatible layout, if it is not already."""
    placements = op_placements(x._spec, window_dims, whole_dims)
    return x if placements == x._spec.placements else x.redistribute(placements=placements)


def replicated(t):
    """A parameter as a Replicate ShardTensor (plain ones were promoted already); None stays None."""
    if t is None or all(issubclass(type(p), Replicate) for p in t._spec.placements):
        return t
    return t.redistribute(placements=(Replicate(),) * t._spec.mesh.ndim)


def partial_spec(x_spec, shape, dtype) -> ShardTensorSpec:
    """Layout of a parameter gradient: Partial where ``x`` is sharded, Replicate elsewhere."""
    placements = tuple(Partial() if issubclass(type(p), Shard) else Replicate() for p in x_spec.placements)
    return ShardTensorSpec.from_sizes(x_spec.mesh, placements, shape, dtype, (None,) * len(shape))


# --------------------------------------------------------------------------- #
# Output layout and plans
# --------------------------------------------------------------------------- #
@dataclass(frozen=True, eq=False)
class Geometry:
    """What one rank needs to run a window op, computed from specs only.

    ``ranges[d]`` is this rank's global output range along window dim ``d``.
    """

    in_spec: ShardTensorSpec
    out_spec: ShardTensorSpec
    plans: tuple
    ranges: Mapping[int, tuple[int, int]]
    fill_value: float

    def comm_steps(self) -> tuple:
        """The forward halo exchanges as :class:`~physicsnemo_dp.propagation.CommStep` s, this rank's bytes.

        One ``halo`` all-to-all per exchanging dim, in the order the
        executor runs them; a later dim's rows carry the earlier dims'
        received rows (the corners), as :func:`.halo.exchange` sends them.
        Backward sends the window's gradient back along the same steps with
        sent and received swapped. Pure: read from the plans, nothing runs.
        """
        shape = list(self.in_spec.local_shape)
        itemsize = self.in_spec.tensor_meta.dtype.itemsize
        coord = self.in_spec.coordinate
        steps = []
        for p in self.plans:
            if not p.exchange:
                continue
            row = prod(n for k, n in enumerate(shape) if k != p.dim) * itemsize
            me = coord[p.mesh_dim]
            sent = (sum(p.send_splits) - p.send_splits[me]) * row
            received = (sum(p.recv_splits) - p.recv_splits[me]) * row
            steps.append(CommStep(halo.KIND, p.mesh_dim, sent, received, 0))
            shape[p.dim] += p.received_rows
        return tuple(steps)


def build(x_spec, maps: Mapping[int, object], out_shape: Sequence[int], mode: str, fill_value: float = 0.0,
          native: Collection[int] = ()) -> Geometry:  # fmt: skip
    """Output spec, halo plans and local output ranges for window dims ``maps`` (dim -> map).

    ``native`` lists window dims this rank holds whole (see :func:`whole_extent`)
    whose window the kernel applies itself (torch's own padding): they need no
    halo plan, and this rank computes all of their outputs. Pure and memoised
    on its (hashable) arguments: the input spec with its size tables, the
    frozen dim maps, the output shape and the boundary mode; a network applies
    the same few geometries on every step. :meth:`Geometry.comm_steps` gives the
    bytes the plan will move.
    """
    return _build(x_spec, tuple(sorted(maps.items())), tuple(out_shape), mode, fill_value, tuple(sorted(native)))


@lru_cache(maxsize=1024)
def _build(x_spec, maps: tuple, out_shape: tuple, mode: str, fill_value: float, native: tuple) -> Geometry:
    maps = dict(maps)
    tables = list(x_spec.dim_sizes)
    ranges, windowed = {}, {}
    for d, dim_map in maps.items():
        sizes, me, _ = halo.group_sizes(x_spec, d)
        if d in native:
            ranges[d], out_sizes = (0, out_shape[d]), (out_shape[d],)
        else:
            every = _geometry.out_ranges(dim_map, sizes)  # every shard's, once: O(P) integer arithmetic
            ranges[d], out_sizes = every[me], tuple(o1 - o0 for o0, o1 in every)
            windowed[d] = _windows_of(dim_map, every)
        if tables[d] is not None:
            tables[d] = out_sizes
    out_spec = ShardTensorSpec.from_sizes(
        x_spec.mesh, x_spec.placements, tuple(out_shape), x_spec.tensor_meta.dtype, tuple(tables)
    )
    plans = halo.plan_windows(x_spec, windowed, mode)
    return Geometry(x_spec, out_spec, plans, ranges, fill_value)


def whole_extent(x_spec, dim: int) -> bool:
    """Whether every rank of this rank's group holds ``dim`` whole (unsharded, or sharded over one rank)."""
    return len(halo.group_sizes(x_spec, dim)[0]) == 1


def _windows_of(dim_map, ranges):
    return lambda sizes: _geometry.windows(dim_map, sizes, ranges)


# --------------------------------------------------------------------------- #
# Local computation and autograd
# --------------------------------------------------------------------------- #
class Kernel:
    """The local part of a window op.

    ``run(window, params)`` maps the local window (padding materialised, so
    ops run with zero padding) and the local parameter tensors to the local
    output. ``vjp`` defaults to recomputing ``run`` under ``torch.func.vjp``
    (cheap for pooling, padding and interpolation; convolution overrides it
    with ``convolution_backward`` on the rebuilt window, and skips the
    window's gradient when ``needs_window`` is False). The gradients ``vjp``
    returns must be new tensors, never ``grad`` itself: the halo rows'
    gradients are added into them in place.
    """

    geometry: Geometry

    def run(self, window: torch.Tensor, params: tuple) -> torch.Tensor:
        raise NotImplementedError

    def vjp(self, window, params: tuple, grad, needs_window: bool = True):
        present = [i for i, p in enumerate(params) if p is not None]

        def f(w, *ps):
            full = list(params)
            for i, p in zip(present, ps):
                full[i] = p
            return self.run(w, tuple(full))

        _, pullback = torch.func.vjp(f, window, *(params[i] for i in present))
        grads = pullback(grad)
        out = [None] * len(params)
        for i, g in zip(present, grads[1:]):
            out[i] = g
        return grads[0], tuple(out)


def _local_output(kernel: Kernel, window, params):
    shape = tuple(kernel.geometry.out_spec.local_shape)
    if 0 in shape:
        return window.new_zeros(shape)
    return kernel.run(window, params)


def _local_grads(kernel: Kernel, window, params, grad, needs_window: bool):
    if 0 in grad.shape:
        return torch.zeros_like(window), tuple(None if p is None else torch.zeros_like(p) for p in params)
    return kernel.vjp(window, params, grad, needs_window)


class WindowFunction(Function):
    """``(kernel, x, *params) -> (output ShardTensor, window, *received rows)``; see the module doc.

    Backward needs the window, but keeping it would hold a second copy of the
    local input (with halo and padding) per layer. It keeps ``x`` (which the
    caller's graph usually holds anyway, as torch's own ops do) and the
    received halo rows, and rebuilds the window locally (no communication).
    When ``x`` needs no gradient the mirror exchange is skipped altogether.
    """

    @staticmethod
    def forward(kernel, x, *params):
        g = kernel.geometry
        extended, received = halo.exchange(x._local_tensor, g.plans, g.in_spec.mesh)
        window = halo.assemble(extended, received, g.plans, g.fill_value)
        local_params = tuple(None if p is None else p._local_tensor for p in params)
        return wrap(_local_output(kernel, window, local_params), g.out_spec), window, *received

    @staticmethod
    def setup_context(ctx, inputs, output):
        kernel, x, *params = inputs
        _, window, *received = output
        ctx.kernel = kernel
        ctx.params = tuple(None if p is None else p._local_tensor for p in params)
        ctx.param_meta = tuple(None if p is None else (tuple(p.shape), p.dtype) for p in params)
        non_differentiable(ctx, window, *received)
        ctx.save_for_backward(x, *received)

    @staticmethod
    def backward(ctx, grad, *_unused):
        x, *received = ctx.saved_tensors
        g = ctx.kernel.geometry
        window = halo.assemble(halo.extend(x._local_tensor, received, g.plans), received, g.plans, g.fill_value)
        ShardTensor = shard_tensor_cls()
        local_grad = to_layout(grad, grad_layout(g.out_spec)) if isinstance(grad, ShardTensor) else grad
        needs_x = ctx.needs_input_grad[1]
        grad_window, grad_params = _local_grads(ctx.kernel, window, ctx.params, local_grad.contiguous(), needs_x)
        del window  # rebuilt for the kernel only: free it before the gradient travels
        grad_x = None
        if needs_x:
            in_spec = grad_layout(g.in_spec)
            grad_x = wrap(halo.scatter_add(grad_window, g.plans, in_spec.mesh, owned=True), in_spec)
        wrapped = tuple(
            None if gp is None else wrap(gp, partial_spec(g.in_spec, *meta))
            for gp, meta in zip(grad_params, ctx.param_meta)
        )
        return (None, grad_x, *wrapped)


def apply(kernel: Kernel, x, *params):
    """Run ``kernel`` on ShardTensor ``x`` (and Replicate parameter ShardTensors)."""
    return WindowFunction.apply(kernel, x, *params)[0]


# --------------------------------------------------------------------------- #
# Argument helpers shared by the op modules
# --------------------------------------------------------------------------- #
def ntuple(value, n: int, name: str) -> tuple[int, ...]:
    """``value`` as an ``n``-tuple of ints (an int repeats)."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    if len(value) == 1:
        return value * n
    if len(value) != n:
        raise ValueError(f"{name} must be an int or a tuple of {n} ints, got {value}")
    return value
