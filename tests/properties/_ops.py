"""The op table of the property tests: one representative set of ops per rule family.

An :class:`Op` is ``fn(*tensors, **args)`` and ``draw(draw, mesh_shape) -> (inputs, args)``,
which draws shapes, layouts and non-tensor arguments consistent with each other.
Ranks import this module to look an op up by name; only the test process draws.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor, scatter_tensor

from ._strategies import ANY, ANY_EXACT, COMPLEX as COMPLEX_DTYPES, EXACT, REAL, dims, draw_input


@dataclass(frozen=True)
class Op:
    fn: Callable
    draw: Callable
    dtypes: tuple = REAL  # ANY / ANY_EXACT where torch accepts complex inputs too
    grad: bool = True
    contiguous_output: bool = False  # the op promises contiguous memory (``.contiguous()``)


def _unary(shapes=None, args=None, **input_kw):
    """``draw`` for a one-input op; ``args(draw, shape)`` draws its non-tensor arguments."""
    shapes = dims() if shapes is None else shapes

    def draw_case(draw, mesh_shape):
        shape = draw(shapes)
        return [draw_input(draw, shape, mesh_shape, **input_kw)], (args(draw, shape) if args else {})

    return draw_case


def _dim(draw, shape, allow_none=False):
    if not shape:
        return None
    options = [*range(len(shape)), *range(-len(shape), 0)]
    return draw(st.sampled_from(options + ([None] if allow_none else [])))


def _dim_keepdim(draw, shape):
    return {"dim": _dim(draw, shape, allow_none=True), "keepdim": draw(st.booleans())}


def _nonempty_dim(draw, shape):
    return {"dim": _dim(draw, shape), "keepdim": draw(st.booleans())}


# ------------------------------------------------------------------ pointwise
def _broadcast_pair(plain_second: bool | None = None):
    def draw_case(draw, mesh_shape):
        shape = draw(dims(min_ndim=1))
        keep = draw(st.integers(0, len(shape)))
        plain = draw(st.booleans()) if plain_second is None else plain_second
        keep = max(keep, 1) if plain else keep  # a plain 0-dim operand: ZERO_DIM_PLAIN_GRAD
        other = tuple(n if draw(st.booleans()) else 1 for n in shape[len(shape) - keep:])
        return [draw_input(draw, shape, mesh_shape), draw_input(draw, other, mesh_shape, plain=plain)], {}

    return draw_case


def _mul_dtensor_scalar(x, s):
    """A 0-dim DTensor operand (``s``) meeting a ShardTensor."""
    if isinstance(x, ShardTensor):
        s = DTensor.from_local(s, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
    return x * s


def _with_scalar_tensor(draw, mesh_shape):
    shape = draw(dims(min_ndim=1))
    return [draw_input(draw, shape, mesh_shape), draw_input(draw, (), mesh_shape, plain=True)], {}


def _same_shape_pair(draw, mesh_shape):
    """Two inputs of one shape in independent layouts (the second maybe plain): losses' input and target."""
    shape = draw(dims(min_ndim=1))
    return [draw_input(draw, shape, mesh_shape), draw_input(draw, shape, mesh_shape, plain=draw(st.booleans()))], {}


POINTWISE = {
    "sin": Op(torch.sin, _unary(), ANY),
    "exp_times_x": Op(lambda x: torch.exp(x) * x, _unary(), ANY),
    "relu": Op(torch.relu, _unary(), REAL),
    "gelu": Op(F.gelu, _unary(), REAL),
    "where_positive": Op(lambda x: torch.where(x > 0, x, 0.1 * x), _unary(), REAL),
    "affine_scalar": Op(lambda x: x * 2.5 - 1, _unary(), ANY),
    "add_broadcast": Op(torch.add, _broadcast_pair(), ANY),
    "mul_broadcast": Op(torch.mul, _broadcast_pair(), ANY),
    "div_plain_weight": Op(lambda x, w: x / (w.abs() + 1), _broadcast_pair(plain_second=True), ANY),
    "mul_zero_dim_plain": Op(torch.mul, _with_scalar_tensor, ANY, grad=False),  # gradient: ZERO_DIM_PLAIN_GRAD
    # per-element ops of rules/losses.py and rules/channel_ops.py (torch's op on the aligned local pieces)
    "mse_loss_sum": Op(lambda x, y: F.mse_loss(x, y, reduction="sum"), _same_shape_pair, REAL),
    "smooth_l1_loss_none": Op(lambda x, y: F.smooth_l1_loss(x, y, reduction="none", beta=0.5), _same_shape_pair, REAL),
    "prelu_one_weight": Op(lambda x: F.prelu(x, torch.full((1,), 0.25, dtype=x.dtype)), _unary(), REAL),
    # complex-only: conjugation (a lazy bit in torch), the real/complex views, parts and magnitudes
    "conj_mul": Op(lambda x, y: x.conj() * y, _broadcast_pair(), COMPLEX_DTYPES),
    "real_imag": Op(lambda x: x.real * 2 - x.conj().imag, _unary(), COMPLEX_DTYPES),
    "abs_angle": Op(lambda x: x.abs() + torch.angle(x + 1j), _unary(), COMPLEX_DTYPES),
    "view_as_real_roundtrip": Op(lambda x: torch.view_as_complex(torch.view_as_real(x.conj()) * 2), _unary(),
                                 COMPLEX_DTYPES),
}
#: A plain 0-dim tensor that requires grad, meeting a ShardTensor.
ZERO_DIM_PLAIN_GRAD = {"mul_zero_dim_plain_grad": Op(torch.mul, _with_scalar_tensor, ANY)}
KNOWN_POINTWISE = {"mul_zero_dim_dtensor": Op(_mul_dtensor_scalar, _with_scalar_tensor, EXACT)}

# ------------------------------------------------------------------ reductions
REDUCTIONS = {
    "sum": Op(lambda x, dim, keepdim: x.sum() if dim is None else x.sum(dim, keepdim=keepdim),
              _unary(args=_dim_keepdim), ANY),
    "mean": Op(lambda x, dim, keepdim: x.mean() if dim is None else x.mean(dim, keepdim=keepdim),
               _unary(args=_dim_keepdim), ANY),
    "amax": Op(lambda x, dim, keepdim: x.amax(dim, keepdim=keepdim),
               _unary(dims(min_ndim=1), args=_nonempty_dim, expand=False), REAL),
    "max_dim": Op(lambda x, dim, keepdim: x.max(dim, keepdim=keepdim),
                  _unary(dims(min_ndim=1), args=_nonempty_dim, expand=False), REAL),
    "argmin": Op(lambda x, dim, keepdim: x.argmin(dim, keepdim=keepdim),
                 _unary(dims(min_ndim=1), args=_nonempty_dim, expand=False), REAL, grad=False),
    "var": Op(lambda x, dim, keepdim: x.var(dim, keepdim=keepdim), _unary(dims(min_ndim=1), args=_nonempty_dim),
              ANY_EXACT),
    "vector_norm": Op(lambda x, dim, keepdim: torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim),
                      _unary(args=_dim_keepdim), ANY_EXACT),
    "abs_amax": Op(lambda x, dim, keepdim: x.abs().amax(dim, keepdim=keepdim),
                   _unary(dims(min_ndim=1), args=_nonempty_dim, expand=False), COMPLEX_DTYPES),
    "logsumexp": Op(lambda x, dim, keepdim: torch.logsumexp(x, dim, keepdim=keepdim),
                    _unary(dims(min_ndim=1), args=_nonempty_dim), EXACT),
}


# ------------------------------------------------------------------ views
def _reshape_target(draw, shape):
    """A shape with the same numel: split one dim into two factors, merge neighbours, add a 1, or flatten."""
    target = list(shape)
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["split", "merge", "one", "flatten"]))
        if kind == "split" and target:
            d = draw(st.integers(0, len(target) - 1))
            n = target[d]
            factors = [a for a in range(1, n + 1) if n % a == 0] or [1]
            a = draw(st.sampled_from(factors))
            target[d:d + 1] = [a, n // a if a else 0]
        elif kind == "merge" and len(target) >= 2:
            d = draw(st.integers(0, len(target) - 2))
            target[d:d + 2] = [target[d] * target[d + 1]]
        elif kind == "one":
            target.insert(draw(st.integers(0, len(target))), 1)
        elif kind == "flatten":
            target = [int(torch.Size(target).numel())]
    return {"shape": tuple(target)}


def _perm(draw, shape):
    return {"dims": tuple(draw(st.permutations(range(len(shape)))))}


def _two_dims(draw, shape):
    return {"a": _dim(draw, shape), "b": _dim(draw, shape)}


def _squeezable(draw):
    shape = list(draw(dims(min_ndim=1)))
    shape[draw(st.integers(0, len(shape) - 1))] = 1
    return tuple(shape)


def _expand_to(draw, shape):
    target = [draw(st.integers(1, 3)) if n == 1 else n for n in shape]
    return {"shape": tuple([draw(st.integers(1, 2))] * draw(st.integers(0, 1)) + target)}


_SAME_SIZE_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}

VIEWS = {
    "reshape": Op(lambda x, shape: x.reshape(shape), _unary(args=_reshape_target), ANY),
    "view": Op(lambda x, shape: x.view(shape), _unary(args=_reshape_target), ANY),
    "permute": Op(lambda x, dims: x.permute(dims), _unary(args=_perm), ANY),
    "transpose": Op(lambda x, a, b: x.transpose(a, b), _unary(dims(min_ndim=1), args=_two_dims), ANY),
    "squeeze": Op(lambda x, dim: x.squeeze(dim),
                  _unary(st.composite(lambda draw: _squeezable(draw))(), args=lambda d, s: {"dim": _dim(d, s)}), ANY),
    "unsqueeze": Op(lambda x, dim: x.unsqueeze(dim),
                    _unary(args=lambda d, s: {"dim": d(st.integers(-len(s) - 1, len(s)))}), ANY),
    "expand": Op(lambda x, shape: x.expand(shape) * 1, _unary(args=_expand_to), ANY),
}
KNOWN_VIEWS = {"view_dtype": Op(lambda x: x.view(_SAME_SIZE_INT[x.dtype]), _unary(), EXACT, grad=False)}


# ------------------------------------------------------------------ joins
def _cat_pair(stack: bool):
    def draw_case(draw, mesh_shape):
        shape = draw(dims(min_ndim=1))
        d = draw(st.integers(0, len(shape) - 1))
        other = list(shape)
        if not stack:
            other[d] = draw(st.integers(0, 4))
        dim = draw(st.integers(0, len(shape))) if stack else d
        return [draw_input(draw, shape, mesh_shape), draw_input(draw, other, mesh_shape)], {"dim": dim}

    return draw_case


def _same_layout_cat(draw, mesh_shape):
    """Two operands of one layout (placements and shard sizes), each with its own memory layout, joined along
    a dim neither shards: the local join of ``rules/joins.cat_same_layout``; a dim sharded everywhere: the
    general rule."""
    shape = draw(dims(min_ndim=1))
    first = draw_input(draw, shape, mesh_shape)
    free = [d for d, sizes in enumerate(first.dim_sizes) if sizes is None]
    d = draw(st.sampled_from(free or list(range(len(shape)))))
    other = list(shape)
    other[d] = draw(st.integers(0, 4))
    second = draw_input(draw, other, mesh_shape)
    if free:
        second = replace(second, placements=first.placements, dim_sizes=first.dim_sizes)
    return [first, second], {"dim": d - len(shape) if draw(st.booleans()) else d}


def _same_spec_pair(draw, mesh_shape):
    """Two operands of one spec (shape, placements, shard sizes), each rank's pieces in their own memory layouts:
    ``add`` of such operands is answered in ``ShardTensor.__torch_dispatch__`` (the residual adds and autograd's
    gradient sums of a step)."""
    first = draw_input(draw, draw(dims()), mesh_shape)
    second = draw_input(draw, first.shape, mesh_shape)
    return [first, replace(second, placements=first.placements, dim_sizes=first.dim_sizes)], {}


def _narrow_args(draw, shape):
    d = draw(st.integers(0, len(shape) - 1))
    start = draw(st.integers(0, shape[d]))
    return {"dim": d, "start": start, "length": draw(st.integers(0, shape[d] - start))}


def _select_args(draw, shape):
    d = draw(st.sampled_from([k for k, n in enumerate(shape) if n > 0]))
    return {"dim": d, "index": draw(st.integers(-shape[d], shape[d] - 1))}


def _nonempty_shape():
    return dims(min_ndim=1, min_extent=1)


#: Drawn on its own (tests/properties/test_joins.py): the function-level fast path of same-layout operands.
SAME_LAYOUT_CAT = {"cat_same_layout": Op(lambda x, y, dim: torch.cat([x, y], dim), _same_layout_cat, ANY)}

#: Drawn on its own (tests/properties/test_pointwise.py): ``x + y + x`` of one spec: the forward adds and, in
#: backward, the sum of ``x``'s two gradients, all of one spec.
SAME_SPEC_ADD = {"add_same_spec": Op(lambda x, y: x + y + x, _same_spec_pair, ANY)}

JOINS = {
    "cat": Op(lambda x, y, dim: torch.cat([x, y], dim), _cat_pair(stack=False), ANY),
    "stack": Op(lambda x, y, dim: torch.stack([x, y], dim), _cat_pair(stack=True), ANY),
    "narrow": Op(lambda x, dim, start, length: x.narrow(dim, start, length),
                 _unary(dims(min_ndim=1), args=_narrow_args), ANY),
    "select": Op(lambda x, dim, index: x.select(dim, index), _unary(_nonempty_shape(), args=_select_args), ANY),
    "split": Op(lambda x, size, dim: x.split(size, dim),
                _unary(dims(min_ndim=1), args=lambda d, s: {"size": d(st.integers(1, 4)), "dim": _dim(d, s)}), ANY),
}


# ------------------------------------------------------------------ matmul
def _matmul_case(draw, mesh_shape):
    m, k, n = (draw(st.integers(0, 4)) for _ in range(3))
    batch = draw(st.sampled_from([(), (2,), (1,), (2, 3)]))
    b_batch = draw(st.sampled_from([(), batch[-1:] if batch else ()]))
    plain = draw(st.booleans())
    return [draw_input(draw, (*batch, m, k), mesh_shape), draw_input(draw, (*b_batch, k, n), mesh_shape, plain=plain)], {}


def _plain_weight_case(draw, mesh_shape):
    """``x`` a ShardTensor of any layout, ``w`` a plain tensor (a parameter): the contraction's fast path."""
    m, k, n = (draw(st.integers(0, 4)) for _ in range(3))
    batch = draw(st.sampled_from([(), (2,), (1,), (2, 3)]))
    w_batch = draw(st.sampled_from([(), batch[-1:] if batch else ()]))
    return [draw_input(draw, (*batch, m, k), mesh_shape), draw_input(draw, (*w_batch, k, n), mesh_shape, plain=True)], {}


def _linear_case(draw, mesh_shape):
    shape = draw(dims(min_ndim=1, max_ndim=3))
    out = draw(st.integers(0, 4))
    return [draw_input(draw, shape, mesh_shape), draw_input(draw, (out, shape[-1]), mesh_shape, plain=True),
            draw_input(draw, (out,), mesh_shape, plain=True)], {}


def _einsum_case(draw, mesh_shape):
    b, i, j, k = (draw(st.integers(0, 4)) for _ in range(4))
    return [draw_input(draw, (b, i, j), mesh_shape), draw_input(draw, (b, j, k), mesh_shape)], {}


MATMUL = {
    "matmul": Op(torch.matmul, _matmul_case, ANY),
    "linear": Op(F.linear, _linear_case, ANY),
    "einsum_bij_bjk": Op(lambda x, y: torch.einsum("bij,bjk->bik", x, y), _einsum_case, ANY),
    "einsum_bij_bjk_sum": Op(lambda x, y: torch.einsum("bij,bjk->k", x, y), _einsum_case, ANY),
}

#: Drawn on its own (tests/properties/test_matmul.py): a plain weight, served before promotion by the
#: contraction's fast path, through ``torch.matmul`` and through ``ShardTensor.__matmul__``.
PLAIN_WEIGHT_PRODUCT = {
    "matmul_plain_weight": Op(torch.matmul, _plain_weight_case, ANY),
    "matmul_operator_plain_weight": Op(lambda x, w: x @ w, _plain_weight_case, ANY),
}

# ------------------------------------------------------------------ dim ops
def _topk_args(draw, shape):
    d = draw(st.integers(0, len(shape) - 1))
    return {"k": draw(st.integers(0, shape[d])), "dim": d, "largest": draw(st.booleans())}


def _layer_norm_case(draw, mesh_shape):
    shape = draw(dims(min_ndim=1, min_extent=1))
    k = draw(st.integers(1, len(shape)))
    affine = draw(st.booleans())
    inputs = [draw_input(draw, shape, mesh_shape)]
    if affine:
        inputs += [draw_input(draw, shape[-k:], mesh_shape, plain=True) for _ in range(2)]
    return inputs, {"k": k}


def _layer_norm(x, *affine, k):
    return F.layer_norm(x, x.shape[len(x.shape) - k:], *affine)


def _dim_only(draw, shape):
    return {"dim": _dim(draw, shape)}


DIM_OPS = {
    "softmax": Op(lambda x, dim: F.softmax(x, dim), _unary(dims(min_ndim=1), args=_dim_only), REAL),
    "log_softmax": Op(lambda x, dim: F.log_softmax(x, dim), _unary(dims(min_ndim=1), args=_dim_only), EXACT),
    "cumsum": Op(lambda x, dim: x.cumsum(dim), _unary(dims(min_ndim=1), args=_dim_only), ANY_EXACT),
    "sort": Op(lambda x, dim, descending: torch.sort(x, dim=dim, descending=descending),
               _unary(dims(min_ndim=1), args=lambda d, s: {"dim": _dim(d, s), "descending": d(st.booleans())},
                      expand=False), REAL),
    "topk": Op(lambda x, k, dim, largest: torch.topk(x, k, dim, largest),
               _unary(dims(min_ndim=1), args=_topk_args, expand=False), REAL),
    "layer_norm": Op(_layer_norm, _layer_norm_case, EXACT),
    "flip": Op(lambda x, dim: x.flip(dim), _unary(dims(min_ndim=1), args=_dim_only), ANY),
    "roll": Op(lambda x, shift, dim: x.roll(shift, dim),
               _unary(dims(min_ndim=1), args=lambda d, s: {"shift": d(st.integers(-5, 5)), "dim": _dim(d, s)}), ANY),
}


# ------------------------------------------------------------------ indexing
def _index_select_case(draw, mesh_shape):
    shape = draw(dims(min_ndim=1, min_extent=1))
    d = draw(st.integers(0, len(shape) - 1))
    idx = draw_input(draw, (draw(st.integers(0, 5)),), mesh_shape, plain=draw(st.booleans()), kind=("index", shape[d]))
    return [draw_input(draw, shape, mesh_shape), idx], {"dim": d}


def _gather_case(draw, mesh_shape):
    shape = draw(dims(min_ndim=1, min_extent=1))
    d = draw(st.integers(0, len(shape) - 1))
    ishape = tuple(draw(st.integers(0, n)) if k != d else draw(st.integers(0, 4)) for k, n in enumerate(shape))
    idx = draw_input(draw, ishape, mesh_shape, plain=draw(st.booleans()), kind=("index", shape[d]))
    return [draw_input(draw, shape, mesh_shape), idx], {"dim": d}


def _basic_index(draw, shape):
    key = []
    for n in shape[: draw(st.integers(0, len(shape)))]:
        if n and draw(st.booleans()):
            key.append(draw(st.integers(-n, n - 1)))
        else:
            start = draw(st.one_of(st.none(), st.integers(-n - 1, n + 1)))
            stop = draw(st.one_of(st.none(), st.integers(-n - 1, n + 1)))
            key.append(slice(start, stop, draw(st.integers(1, 3))))
    if draw(st.booleans()):
        key.insert(draw(st.integers(0, len(key))), None)
    return {"key": tuple(key)}


def _tensor_index_case(draw, mesh_shape):
    shape = draw(dims(min_ndim=1, min_extent=1))
    idx = draw_input(draw, (draw(st.integers(0, 5)),), mesh_shape, plain=True, kind=("index", shape[0]))
    return [draw_input(draw, shape, mesh_shape), idx], {}


def _scatter_write_case(draw, mesh_shape):
    """``x``, an index of at most ``x``'s extents (any layout, plain or sharded) and a source shaped like the index."""
    shape = draw(dims(min_ndim=1, min_extent=1))
    d = draw(st.integers(0, len(shape) - 1))
    ishape = tuple(draw(st.integers(0, n)) if k != d else draw(st.integers(0, 5)) for k, n in enumerate(shape))
    idx = draw_input(draw, ishape, mesh_shape, plain=draw(st.booleans()), kind=("index", shape[d]))
    reduce = draw(st.sampled_from(["sum", "mean", "amax", "amin", "prod"]))
    args = {"dim": d, "reduce": reduce, "include_self": draw(st.booleans())}
    return [draw_input(draw, shape, mesh_shape), idx, draw_input(draw, ishape, mesh_shape)], args


def _index_add_case(draw, mesh_shape):
    shape = draw(dims(min_ndim=1, min_extent=1))
    n = draw(st.integers(0, 5))
    idx = draw_input(draw, (n,), mesh_shape, plain=draw(st.booleans()), kind=("index", shape[0]))
    return [draw_input(draw, shape, mesh_shape), idx, draw_input(draw, (n, *shape[1:]), mesh_shape)], {}


INDEXING = {
    "scatter_reduce": Op(
        lambda x, i, s, dim, reduce, include_self: x.scatter_reduce(dim, i, s, reduce, include_self=include_self),
        _scatter_write_case,
        REAL,
    ),
    "scatter_add": Op(lambda x, i, s, dim, reduce, include_self: x.scatter_add(dim, i, s), _scatter_write_case, ANY),
    "index_add": Op(lambda x, i, s: x.index_add(0, i, s, alpha=2), _index_add_case, ANY),
    "index_select": Op(lambda x, i, dim: x.index_select(dim, i), _index_select_case, ANY),
    "gather": Op(lambda x, i, dim: torch.gather(x, dim, i), _gather_case, ANY),
    "getitem_basic": Op(lambda x, key: x[key], _unary(args=_basic_index), ANY),
    "getitem_tensor": Op(lambda x, i: x[i], _tensor_index_case, ANY),
}

# ------------------------------------------------------------------ tensor_like
TENSOR_LIKE = {
    "zeros_like": Op(torch.zeros_like, _unary(), ANY),
    "full_like": Op(lambda x: torch.full_like(x, 3.0), _unary(), REAL),
    "clone": Op(torch.clone, _unary(), ANY),
    "clone_contiguous_format": Op(lambda x: x.clone(memory_format=torch.contiguous_format), _unary(), ANY),
    "to_float64": Op(lambda x: x.to(torch.float64), _unary(), REAL),
    "to_bfloat16": Op(lambda x: x.to(torch.bfloat16), _unary(), EXACT),
    "detach_mul": Op(lambda x: x.detach() * x, _unary(), ANY),
    "to_complex128": Op(lambda x: x.to(torch.complex128), _unary(), ANY_EXACT),
}
KNOWN_TENSOR_LIKE = {"contiguous": Op(lambda x: x.contiguous(), _unary(), ANY, contiguous_output=True)}


# ------------------------------------------------------------------ spatial (conv, pool, interpolate, pad, norms)
def _image_input(draw, mesh_shape, k, min_extent=1, channels=None):
    spatial = tuple(draw(st.integers(min_extent, 7)) for _ in range(k))
    c = draw(st.integers(1, 3)) if channels is None else channels
    shape = (draw(st.integers(1, 2)), c, *spatial)
    return shape, draw_input(draw, shape, mesh_shape, shardable=[0, *range(2, 2 + k)])


def _conv_case(draw, mesh_shape):
    k = draw(st.integers(1, 2))
    shape, x = _image_input(draw, mesh_shape, k)
    out_c, kernel = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    weight = draw_input(draw, (out_c, shape[1], *([kernel] * k)), mesh_shape, plain=True)
    bias = draw_input(draw, (out_c,), mesh_shape, plain=True)
    args = {"stride": draw(st.integers(1, 2)), "padding": draw(st.integers(0, kernel - 1)),
            "dilation": draw(st.integers(1, 2))}
    return [x, weight, bias], args


def _conv(x, w, b, **kw):
    return (F.conv1d if x.ndim == 3 else F.conv2d)(x, w, b, **kw)


def _pool_case(draw, mesh_shape):
    shape, x = _image_input(draw, mesh_shape, 2)
    kernel = draw(st.integers(1, 3))
    return [x], {"kernel_size": kernel, "stride": draw(st.integers(1, 3)), "padding": draw(st.integers(0, kernel // 2)),
                 "kind": draw(st.sampled_from(["max", "avg"]))}


def _pool(x, kind, **kw):
    return (F.max_pool2d if kind == "max" else F.avg_pool2d)(x, **kw)


def _interp_case(draw, mesh_shape):
    shape, x = _image_input(draw, mesh_shape, 2)
    mode = draw(st.sampled_from(["nearest", "bilinear", "bicubic"]))
    size = tuple(draw(st.integers(1, 9)) for _ in range(2))
    args = {"size": size, "mode": mode}
    if mode != "nearest":
        args["align_corners"] = draw(st.booleans())
    return [x], args


def _pad_case(draw, mesh_shape):
    shape, x = _image_input(draw, mesh_shape, 2, min_extent=3)
    mode = draw(st.sampled_from(["constant", "reflect", "replicate", "circular"]))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(4))
    return [x], {"pad": pads, "mode": mode}


def _norm_case(draw, mesh_shape):
    shape, x = _image_input(draw, mesh_shape, 2, channels=draw(st.sampled_from([2, 4])))
    weight = draw_input(draw, (shape[1],), mesh_shape, plain=True)
    bias = draw_input(draw, (shape[1],), mesh_shape, plain=True)
    return [x, weight, bias], {"kind": draw(st.sampled_from(["group", "batch", "instance"]))}


def _norm(x, w, b, kind):
    if kind == "group":
        return F.group_norm(x, 2, w, b)
    if kind == "instance":
        return F.instance_norm(x, weight=w, bias=b)
    return F.batch_norm(x, None, None, w, b, training=True)


SPATIAL = {
    "conv": Op(_conv, _conv_case, EXACT),
    "pool": Op(_pool, _pool_case, EXACT),
    "interpolate": Op(F.interpolate, _interp_case, EXACT),
    "pad": Op(F.pad, _pad_case, ANY_EXACT),
    "norm": Op(_norm, _norm_case, EXACT),
}


# ------------------------------------------------------------------ attention
def _sdpa_case(draw, mesh_shape):
    n, h, L, S, e, ev = (draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 7)),
                         draw(st.integers(1, 7)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    ev = e if draw(st.booleans()) else ev  # equal head dims: the fused CPU kernel's path
    shapes = [(n, h, L, e), (n, h, S, e), (n, h, S, ev)]
    inputs = [draw_input(draw, s, mesh_shape, shardable=[0, 2]) for s in shapes]
    return inputs, {"is_causal": draw(st.booleans())}


ATTENTION = {"sdpa": Op(F.scaled_dot_product_attention, _sdpa_case, EXACT)}

# ------------------------------------------------------------------ layouts
def _placements(draw, shape, mesh_shape):
    """Target placements for ``shape`` over ``mesh_shape`` (Replicate or Shard of any dim, nesting allowed)."""
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return tuple(draw(st.sampled_from(options)) for _ in mesh_shape)


def _layout_case(draw, mesh_shape):
    shape = draw(dims())
    return [draw_input(draw, shape, mesh_shape)], {"placements": _placements(draw, shape, mesh_shape)}


def _redistribute(x, placements):
    """``x`` in ``placements`` (the reference: ``x`` itself)."""
    return x.redistribute(x.device_mesh, placements) if isinstance(x, ShardTensor) else x * 1


def _scatter_case(draw, mesh_shape):
    inputs, args = _layout_case(draw, mesh_shape)
    world = 1
    for n in mesh_shape:
        world *= n
    return inputs, {**args, "src": draw(st.integers(0, world - 1))}


def _scatter(x, placements, src):
    """``scatter_tensor`` of ``x``'s values from global rank ``src`` (the reference: ``x`` itself)."""
    if not isinstance(x, ShardTensor):
        return x * 1
    full = x.full_tensor()
    held = full if torch.distributed.get_rank() == src else None
    return scatter_tensor(held, src, x.device_mesh, placements, requires_grad=x.requires_grad)


LAYOUTS = {
    "redistribute": Op(_redistribute, _layout_case, ANY),
    "scatter_tensor": Op(_scatter, _scatter_case, ANY, grad=False),  # the result is a new leaf
}

#: Dtypes gloo cannot send (complex, int16), through ops of several families: their rules
#: are dtype-agnostic, the communication underneath is what these dtypes exercise.
GLOO_DTYPES = {
    **{f"complex_{name}": Op(table[name].fn, table[name].draw, COMPLEX_DTYPES)
       for table, name in [(POINTWISE, "exp_times_x"), (POINTWISE, "mul_broadcast"), (REDUCTIONS, "sum"),
                           (VIEWS, "reshape"), (JOINS, "cat"), (MATMUL, "matmul")]},
    "view_int16": Op(lambda x: x.view(torch.int16), _unary(), ("bfloat16",), grad=False),
}

_TABLES = (POINTWISE, KNOWN_POINTWISE, ZERO_DIM_PLAIN_GRAD, REDUCTIONS, VIEWS, KNOWN_VIEWS, JOINS, SAME_LAYOUT_CAT, SAME_SPEC_ADD, MATMUL, PLAIN_WEIGHT_PRODUCT, DIM_OPS,
           INDEXING, TENSOR_LIKE, KNOWN_TENSOR_LIKE, SPATIAL, ATTENTION, LAYOUTS, GLOO_DTYPES)
#: Every op by name: ranks look a case's op up here.
OPS = {name: op for table in _TABLES for name, op in table.items()}
assert len(OPS) == sum(map(len, _TABLES)), "op names must be unique across tables"
