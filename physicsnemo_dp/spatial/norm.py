"""Normalization (batch, instance, group, layer) with statistics over every rank's data.

All four are ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the
statistics taken over a set of *reduced* dims:

=============  ===========================================  ==================
op             one statistic per                            reduced dims
=============  ===========================================  ==================
batch_norm     channel                                      batch and spatial
instance_norm  (sample, channel)                            spatial
group_norm     (sample, group)                              group's channels, spatial
layer_norm     leading index                                the normalized dims
=============  ===========================================  ==================

Each rank sums over its local part of the reduced dims; an ``all_reduce`` over
exactly the mesh dims that shard a reduced dim completes the sum (a mesh dim
sharding only the batch dim of an instance norm, say, needs none). The
variance is a second pass over the centred data (two small all-reduces of
one value per statistic), which stays accurate for fields with a large mean,
where ``E[x^2] - E[x]^2`` does not. Backward needs the sums of the gradient and
of ``gradient * x_hat`` over the same dims: one more all-reduce of two values
per statistic.

Running statistics (``batch_norm`` in training, ``instance_norm`` with running
stats) are updated in place from the all-reduced values, so every rank
updates them identically (batch variance unbiased over the *global* count).
In evaluation the stored statistics are used and nothing is communicated.

``weight``/``bias`` gradients sum over the non-parameter dims: ``Partial`` over
mesh dims sharding those, and for ``layer_norm`` over sharded normalized dims
the gradient stays sharded like the input (``Shard``), each rank holding its
box. Channels are unsharded first where statistics or groups span them.

``torch.native_batch_norm`` / ``torch.native_group_norm`` (the ATen-named
functions, three outputs) run the same ``batch_norm`` / ``group_norm`` and
return the saved mean and inverse standard deviation as differentiable
sharded reductions (two more all-reduces). The ATen ops reached below
torch-function (``torch.ops.aten.native_batch_norm``) raise an error naming
these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._torch_compat import Function, non_differentiable, torch_function_disabled, tracing
from .. import _layout, collectives
from .._redistribute import grad_layout
from ..rule_kit import meta_output, replicated_to_box, shard_tensor_cls, to_layout, wrap
from ..spec import ShardTensorSpec
from ._window_op import prepare_input, replicated


@dataclass(frozen=True, eq=False)
class _Stats:
    """How one normalization reduces, from global metadata only."""

    spec: ShardTensorSpec  # layout of x and y
    groups: int | None  # group_norm: view channels as (groups, channels per group)
    reduce_dims: tuple  # dims of the (grouped) local view one statistic covers
    mesh_dims: tuple  # mesh dims whose shards share statistics
    count: int  # elements per statistic, globally
    eps: float
    param_shape: tuple | None  # weight/bias broadcast shape against x
    trailing_params: bool  # layer_norm: parameters are x's trailing dims (may be sharded)
    dtype: torch.dtype | None = None  # of y, as torch gives it (bfloat16 x with float32 weight: bfloat16)

    def view(self, t):
        if self.groups is None:
            return t
        return t.reshape(t.shape[0], self.groups, t.shape[1] // self.groups, *t.shape[2:])

    def sum(self, t, stacked: bool = False):
        """Global sum per statistic (``stacked``: over dim 0 lie several tensors to sum alike)."""
        t = t.sum([d + stacked for d in self.reduce_dims], keepdim=True)
        for m in self.mesh_dims:
            t = collectives.all_reduce(t, "sum", self.spec.mesh, m)
        return t


def _local(t):
    return None if t is None else t._local_tensor if isinstance(t, shard_tensor_cls()) else t


class _Normalize(Function):
    """``(x, weight, bias, mean, var, stats) -> (y, x_hat, rstd, mean, var)``.

    ``mean``/``var`` given (shaped to broadcast) means fixed statistics.
    Outputs after ``y`` are local, non-differentiable, for backward and the
    running-statistics update.
    """

    @staticmethod
    def forward(x, weight, bias, mean, var, stats):
        # Statistics in at least float32, as torch's kernels accumulate (a bfloat16 mean of a large
        # field would lose the digits the centring needs); y in the dtype torch's op returns.
        xl = stats.view(x._local_tensor)
        xl = xl.to(torch.promote_types(xl.dtype, torch.float32))
        if mean is None:
            mean = stats.sum(xl) / stats.count
            var = stats.sum((xl - mean).square()) / stats.count
        rstd = (var + stats.eps).rsqrt()
        x_hat = ((xl - mean) * rstd).reshape(x._local_tensor.shape)
        y = x_hat
        if weight is not None:
            y = y * _param_box(weight, stats)
        if bias is not None:
            y = y + _param_box(bias, stats)
        return wrap(y.to(stats.dtype or y.dtype), stats.spec), x_hat, rstd, mean, var

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, mean, _, stats = inputs
        _, x_hat, rstd, *_ = output
        non_differentiable(ctx, *output[1:])
        ctx.save_for_backward(x_hat, rstd)
        ctx.stats, ctx.fixed = stats, mean is not None
        ctx.weight = None if weight is None else _param_box(weight, stats)
        ctx.param_meta = [None if p is None else (tuple(p.shape), p.dtype) for p in (weight, bias)]

    @staticmethod
    def backward(ctx, grad, *_):
        x_hat, rstd = ctx.saved_tensors
        stats = ctx.stats
        g = to_layout(grad, grad_layout(stats.spec)) if isinstance(grad, shard_tensor_cls()) else grad
        g = g.to(x_hat.dtype)
        g_hat = g if ctx.weight is None else g * ctx.weight
        gv, xv = stats.view(g_hat), stats.view(x_hat)
        if ctx.fixed:
            gx = gv * rstd
        else:
            sums = stats.sum(torch.stack([gv, gv * xv]), stacked=True) / stats.count
            gx = rstd * (gv - sums[0] - xv * sums[1])
        grad_x = wrap(gx.reshape(g.shape).to(stats.spec.tensor_meta.dtype), grad_layout(stats.spec))
        grads = [_param_grad(g * x_hat, ctx.param_meta[0], stats), _param_grad(g, ctx.param_meta[1], stats)]
        return grad_x, *grads, None, None, None


def _param_box(p, stats: _Stats):
    return replicated_to_box(_local(p).reshape(stats.param_shape), stats.spec)


def _param_grad(t, meta, stats: _Stats):
    """Sum ``t`` over the dims a parameter broadcasts along; wrap in the gradient layout."""
    if meta is None:
        return None
    shape, dtype = meta
    offset = t.ndim - len(stats.param_shape)
    # layer_norm's parameters are x's trailing dims themselves (a size-1 one included, which
    # may be sharded with empty shards): only the others' size-1 dims are broadcast dims.
    dims = [d for d in range(t.ndim)
            if d < offset or (not stats.trailing_params and stats.param_shape[d - offset] == 1)]
    local = t.sum(dims, keepdim=True) if dims else t  # sum over [] would reduce every dim
    local = local.reshape(local.shape[offset:] if stats.trailing_params else (-1,)).to(dtype)
    placements, tables = [], [None] * len(shape)
    for m, p in enumerate(stats.spec.placements):
        if issubclass(type(p), Shard) and stats.trailing_params and p.dim >= offset:
            placements.append(Shard(p.dim - offset))
            tables[p.dim - offset] = stats.spec.dim_sizes[p.dim]
        else:
            placements.append(Partial() if issubclass(type(p), Shard) else Replicate())
    return wrap(local, ShardTensorSpec.from_sizes(stats.spec.mesh, placements, shape, dtype, tuple(tables)))


def _stats(x, reduce_dims, view_dims=None, groups=None, eps=1e-5, param_shape=None, trailing=False, dtype=None) -> _Stats:
    """Statistics over ``reduce_dims`` of ``x`` (``view_dims``: the same dims in the grouped view)."""
    spec = x._spec
    shape = spec.global_shape
    mesh_dims = tuple(sorted({m for d in reduce_dims for m in _layout.sharding_mesh_dims(spec.placements, d) if spec.mesh.size(m) > 1}))
    count = prod(shape[d] for d in reduce_dims) // (groups or 1)
    return _Stats(spec, groups, tuple(view_dims or reduce_dims), mesh_dims, count, eps, param_shape, trailing, dtype)


def _normalize(x, weight, bias, stats, mean=None, var=None):
    y, _, _, mean, var = _Normalize.apply(x, replicated(weight), replicated(bias), mean, var, stats)
    return y, mean, var


def _update(running, value, momentum):
    """In-place running-statistics update (the local tensor shares the module buffer's storage)."""
    local = _local(running)
    local.mul_(1 - momentum).add_(value.reshape(local.shape).to(local.dtype), alpha=momentum)


def _channel_shape(x):
    return (x.shape[1], *([1] * (x.ndim - 2)))


# --------------------------------------------------------------------------- #
# Handlers
# --------------------------------------------------------------------------- #
def _batch_norm(func, types, args, kwargs):
    dtype = meta_output(func, args, kwargs).dtype
    x, running_mean, running_var, weight, bias, training, momentum, eps = _bn_args(*args, **kwargs)
    x = prepare_input(x, (), whole_dims=(1,))
    reduce = tuple(d for d in range(x.ndim) if d != 1)
    stats = _stats(x, reduce, eps=eps, param_shape=_channel_shape(x), dtype=dtype)
    if not training:
        shape = (1, *_channel_shape(x))
        y, _, _ = _normalize(x, weight, bias, stats, _local(running_mean).reshape(shape), _local(running_var).reshape(shape))
        return y
    y, mean, var = _normalize(x, weight, bias, stats)
    if running_mean is not None:
        _update(running_mean, mean, momentum)
        _update(running_var, var * stats.count / max(stats.count - 1, 1), momentum)
    return y


def _bn_args(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    return input, running_mean, running_var, weight, bias, training, momentum, eps


def _instance_norm(func, types, args, kwargs):
    dtype = meta_output(func, args, kwargs).dtype
    x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps = _in_args(*args, **kwargs)
    x = prepare_input(x, (), whole_dims=(1,))
    stats = _stats(x, tuple(range(2, x.ndim)), eps=eps, param_shape=_channel_shape(x), dtype=dtype)
    if not use_input_stats:
        shape = (1, *_channel_shape(x))
        y, _, _ = _normalize(x, weight, bias, stats, _local(running_mean).reshape(shape), _local(running_var).reshape(shape))
        return y
    y, mean, var = _normalize(x, weight, bias, stats)
    if running_mean is not None:
        pair = torch.stack([mean, var * stats.count / max(stats.count - 1, 1)])
        per_channel = _stats(x, (0,)).sum(pair, stacked=True) / x.shape[0]
        _update(running_mean, per_channel[0], momentum)
        _update(running_var, per_channel[1], momentum)
    return y


def _in_args(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1, eps=1e-5):
    return input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps


def _group_norm(func, types, args, kwargs):
    dtype = meta_output(func, args, kwargs).dtype
    x, groups, weight, bias, eps = _gn_args(*args, **kwargs)
    x = prepare_input(x, (), whole_dims=(1,))
    reduce = tuple(range(1, x.ndim))
    stats = _stats(x, reduce, tuple(range(2, x.ndim + 1)), groups, eps, _channel_shape(x), dtype=dtype)
    if _native_group_norm_fits(x, weight, bias, dtype):
        return _LocalGroupNorm.apply(x, replicated(weight), replicated(bias), stats)[0]
    return _normalize(x, weight, bias, stats)[0]


def _native_group_norm_fits(x, weight, bias, dtype) -> bool:
    """On a mesh of one rank the local tensor is the whole tensor: torch's fused kernels apply as they are.

    The decomposed statistics of :class:`_Normalize` (about ten elementwise passes) cost 1.40x torch's
    ``native_group_norm`` in an Inductor-compiled CNN step at 128x128 (issue 30); on one rank nothing
    needs them. Same dtypes only (what the native kernel takes without promotion).
    """
    if x._spec.mesh.size() != 1 or not x.dtype.is_floating_point or dtype != x.dtype or x.ndim < 2:
        return False
    return all(p is None or p.dtype == x.dtype for p in (weight, bias))


class _LocalGroupNorm(Function):
    """``torch.native_group_norm`` and its backward on the local tensors of a one-rank mesh."""

    @staticmethod
    def forward(x, weight, bias, stats):
        xl = x._local_tensor
        n, c = xl.shape[:2]
        y, mean, rstd = torch.native_group_norm(xl, _local(weight), _local(bias), n, c, prod(xl.shape[2:]), stats.groups, stats.eps)
        return wrap(y, stats.spec), mean, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, stats = inputs
        _, mean, rstd = output
        non_differentiable(ctx, mean, rstd)
        ctx.save_for_backward(x._local_tensor, mean, rstd)
        ctx.stats, ctx.weight = stats, _local(weight)
        ctx.param_meta = [None if p is None else (tuple(p.shape), p.dtype) for p in (weight, bias)]

    @staticmethod
    def backward(ctx, grad, *_):
        xl, mean, rstd = ctx.saved_tensors
        stats = ctx.stats
        g = to_layout(grad, grad_layout(stats.spec)) if isinstance(grad, shard_tensor_cls()) else grad
        g = _local(g).to(xl.dtype)
        n, c = xl.shape[:2]
        mask = [True] + [m is not None for m in ctx.param_meta]
        gx, gw, gb = torch.ops.aten.native_group_norm_backward(g, xl, mean, rstd, ctx.weight, n, c, prod(xl.shape[2:]), stats.groups, mask)
        as_param = lambda t: None if t is None else t.reshape(1, -1, *([1] * (xl.ndim - 2)))  # noqa: E731
        grads = [_param_grad(as_param(gw), ctx.param_meta[0], stats), _param_grad(as_param(gb), ctx.param_meta[1], stats)]
        return wrap(gx, grad_layout(stats.spec)), *grads, None


def _gn_args(input, num_groups, weight=None, bias=None, eps=1e-5):
    return input, num_groups, weight, bias, eps


def _layer_norm(func, types, args, kwargs):
    if args and type(args[0]) is shard_tensor_cls():
        fast = _rowwise_layer_norm(*args, **kwargs)
        if fast is not None:
            return fast
    dtype = meta_output(func, args, kwargs).dtype
    x, normalized_shape, weight, bias, eps = _ln_args(*args, **kwargs)
    x = prepare_input(x, ())
    k = len(normalized_shape)
    stats = _stats(x, tuple(range(x.ndim - k, x.ndim)), eps=eps, param_shape=tuple(normalized_shape), trailing=True, dtype=dtype)
    if not stats.mesh_dims and (x._spec.mesh.size() == 1 or not tracing(x._local_tensor)):
        # Every row is whole on its rank (the transformer case: tokens sharded, features not): torch's
        # fused kernels through the native_layer_norm rule (rules/dim_ops/norms.py), the arithmetic of
        # one process. The decomposed path below makes ~12 elementwise passes per call (a transformer
        # block's step: 195 local ATen ops against 133 this way; plain torch 122). Traced on a mesh of
        # more than one rank, compiled code keeps the decomposed path: under Inductor on uneven shards
        # the rule's weight-gradient reductions came out in different orders on different ranks (a
        # collective mismatch, tests/compile/test_transformer.py::test_regional_compile_inductor). On a
        # one-rank mesh there is no collective, and the traced graph holds torch's native_layer_norm
        # and its backward, as plain torch's does (tests/compile/test_one_rank.py).
        with torch_function_disabled():
            return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return _normalize(x, weight, bias, stats)[0]


def _rowwise_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """The common eager call, decided from the specs alone: every normalized row whole on its rank.

    That is ``x`` without a pending sum, no mesh dim sharding a normalized
    dim, the shape matching, and parameters (promoted already) whole: the
    call goes straight to torch's fused kernel through the
    ``native_layer_norm`` rule, as the general path below would, without
    building its metadata (a meta call, the statistics plan). None otherwise.
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not _rows_whole(x._spec, shape) or tracing(x._local_tensor):
        return None
    for p in (weight, bias):
        if p is not None and (type(p) is not type(x) or not _whole(p._spec)):
            return None
    with torch_function_disabled():
        return torch.layer_norm(x, shape, weight, bias, eps, False)


_ROWS_WHOLE: dict = {}


def _rows_whole(spec, shape: tuple) -> bool:
    """Whether ``spec`` has no pending sum and no mesh dim sharding its trailing ``shape`` (memoised)."""
    key = (spec, shape)
    hit = _ROWS_WHOLE.get(key)
    if hit is None:
        ndim, k = len(spec.global_shape), len(shape)
        hit = _ROWS_WHOLE[key] = (
            0 < k <= ndim
            and tuple(spec.global_shape[ndim - k :]) == shape
            and not spec.has_partial
            and not any(issubclass(type(p), Shard) and p.dim >= ndim - k for p in spec.placements)
        )
        if len(_ROWS_WHOLE) > 4096:  # layouts seen by a long-running process: keep the memo bounded
            _ROWS_WHOLE.clear()
    return hit


def _whole(spec) -> bool:
    return all(issubclass(type(p), Replicate) for p in spec.placements)


def _ln_args(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return input, shape, weight, bias, eps


# --------------------------------------------------------------------------- #
# The ATen-named entry points (torch.native_batch_norm, torch.native_group_norm)
# --------------------------------------------------------------------------- #
def _saved_stats(x, dims, eps):
    """The mean and 1/std over ``dims`` (biased), as differentiable sharded reductions (two all-reduces)."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # torch's kernels keep their statistics in at least float32
    return x.mean(dims), (x.var(dims, correction=0) + eps).rsqrt()


def _native_batch_norm(func, types, args, kwargs):
    """``torch.native_batch_norm``: ``F.batch_norm``'s output, then the saved mean and invstd torch returns."""
    x, weight, bias, running_mean, running_var, training, momentum, eps = _nbn_args(*args, **kwargs)
    if not isinstance(x, shard_tensor_cls()):
        with torch_function_disabled():
            return func(*args, **kwargs)
    y = _batch_norm(F.batch_norm, types, (x, running_mean, running_var, weight, bias, training, momentum, eps), {})
    if not training:  # torch returns empty statistics in evaluation
        return y, x.new_empty((0,)), x.new_empty((0,))
    return (y, *_saved_stats(x, [d for d in range(x.ndim) if d != 1], eps))


def _nbn_args(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return input, weight, bias, running_mean, running_var, training, momentum, eps


def _native_group_norm(func, types, args, kwargs):
    """``torch.native_group_norm``: ``F.group_norm``'s output, then the per-(sample, group) mean and rstd."""
    x, weight, bias, n, c, hxw, groups, eps = _ngn_args(*args, **kwargs)
    if not isinstance(x, shard_tensor_cls()):
        with torch_function_disabled():
            return func(*args, **kwargs)
    if x.ndim < 2 or x.shape[0] != n or x.shape[1] != c or x.numel() != n * c * hxw:
        raise RuntimeError(
            f"native_group_norm: N={n}, C={c}, HxW={hxw} do not describe the input of shape {tuple(x.shape)} "
            "(expected (N, C, *) with HxW the product of the trailing dims)"
        )
    y = _group_norm(F.group_norm, types, (x, groups, weight, bias, eps), {})
    mean, rstd = _saved_stats(x.reshape(n, groups, -1), [2], eps)
    return y, mean, rstd


def _ngn_args(input, weight, bias, N, C, HxW, group, eps):
    return input, weight, bias, N, C, HxW, group, eps


def _refused(use: str, native: str):
    def rule(func, args, kwargs):
        raise NotImplementedError(
            f"ShardTensor has no rule for {func} reached below torch-function (torch.ops.aten called directly, "
            f"or a decomposition): call {use} or {native} instead, which compute the statistics over every "
            "rank's data, forward and backward."
        )

    return rule


FUNCTIONS = {
    torch.native_batch_norm: _native_batch_norm,
    torch.native_group_norm: _native_group_norm,
    F.batch_norm: _batch_norm,
    F.instance_norm: _instance_norm,
    F.group_norm: _group_norm,
    F.layer_norm: _layer_norm,
}

_aten = torch.ops.aten
#: The ATen ops reached without ``__torch_function__`` (``torch.ops.aten.*`` called directly): a clear error.
RULES = {
    _aten.native_batch_norm.default: _refused("F.batch_norm", "torch.native_batch_norm"),
    _aten._native_batch_norm_legit.default: _refused("F.batch_norm", "torch.native_batch_norm"),
    _aten._native_batch_norm_legit.no_stats: _refused("F.batch_norm", "torch.native_batch_norm"),
    _aten.native_group_norm.default: _refused("F.group_norm", "torch.native_group_norm"),
}
