"""Random ops on ShardTensors whose values do not depend on the decomposition.

Without these rules every rank would run torch's generator on its local
tensor: ranks seeded alike draw the *same* block (the field repeats with the
shard's period) and the result changes with the world size. Here every random
op

1. takes one 128-bit key from torch's generator (``generator=`` or the
   default generator of the tensor's device; :func:`physicsnemo_dp._philox.draw_key`),
   which advances that generator by the same amount on every rank;
2. evaluates Philox4x32-10 at the global flat indices of this rank's box of
   the output (:func:`physicsnemo_dp._philox.sample_box`): O(local) work and
   memory, no communication;
3. applies the distribution's elementwise formula.

So the values depend only on (key, global index): equal for every world size,
mesh shape and uneven split, bitwise on one device type; ranks that hold the
same box (Replicate, Partial mesh dims) hold the same values. They are *not*
torch's own stream: ``torch.randn_like(x)`` on a ShardTensor differs from
``torch.randn_like(x.full_tensor())``. The single-process reference is
:func:`physicsnemo_dp.random.reference`.

Dropout on CPU decomposes into ``empty_like``/``new_empty`` + ``bernoulli_``
+ pointwise ops; ``dropout2d``/``dropout3d``/``feature_alpha_dropout`` draw a
``(N, C, 1, ...)`` mask through ``new_empty`` of another shape, which is a
replicated tensor: every rank computes the whole (small) mask, so its values
are per (n, c) whatever the split. On accelerators ``F.dropout`` calls
``native_dropout``, served here too; its backward is pointwise.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import _philox, collectives
from .._checking import checks_enabled
from .._torch_compat import traced
from ..errors import PlacementError
from ..rule_kit import bind_args, meta_output, replicated_to_box, shard_tensor_cls, to_layout, wrap

aten = torch.ops.aten

__all__ = ["RULES", "distribution_values", "draw_key", "sample_spec"]


# --------------------------------------------------------------------------- #
# Sampling in a layout
# --------------------------------------------------------------------------- #
def _without_partial(spec):
    placements = tuple(Replicate() if issubclass(type(p), Partial) else p for p in spec.placements)
    return spec if placements == spec.placements else spec.with_layout(placements, spec.dim_sizes)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Real dtype the values are computed in (complex: its real part)."""
    return dtype.to_real() if dtype.is_complex else dtype


def sample_spec(kind: str, key: torch.Tensor, spec, dtype: torch.dtype, device) -> torch.Tensor:
    """This rank's local values of ``kind`` for a tensor of layout ``spec``.

    Complex dtypes draw real and imaginary parts as a trailing dim of 2
    (normals scaled by ``sqrt(1/2)``, torch's convention: ``E|z|**2 = 1``).
    """
    offsets, local_shape = spec.local_offsets(), tuple(spec.local_shape)
    shape = tuple(spec.global_shape)
    if dtype.is_complex:
        real = _philox.sample_box(kind, key, shape + (2,), offsets + (0,), local_shape + (2,), _work_dtype(dtype), device)
        if kind == "normal":
            real = real * math.sqrt(0.5)
        return torch.view_as_complex(real.contiguous())
    return _philox.sample_box(kind, key, shape, offsets, local_shape, dtype, device)


def _transform_dtype(dtype: torch.dtype) -> torch.dtype:
    """Distributions with a nonlinear formula are computed in float64 for float64, else in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _integers(key, spec, device, low: int, high: int) -> torch.Tensor:
    """Integers uniform in ``[low, high)`` (int64): ``low + bits63 mod (high - low)``.

    The modulo bias is at most ``(high - low) / 2**63``. The full signed 64-bit
    range (``random_(-2**63)`` on int64) uses all 64 bits.
    """
    span = high - low
    bits = sample_spec("word64", key, spec, torch.int64, device)
    if span == 2**64:
        return bits
    if span > 2**63:
        raise ValueError(
            f"random integers in [{low}, {high}) span more than 2**63 values; ShardTensor random ops "
            "support spans up to 2**63 (or exactly 2**64): narrow the range"
        )
    bits &= (1 << 63) - 1
    if span == 2**63:
        return bits + low
    return bits.remainder_(span).add_(low)


def distribution_values(kind: str, key, spec, dtype, device, params) -> torch.Tensor:
    """Local values of one distribution, in ``dtype``; ``params`` are Python scalars."""
    if kind == "uniform":
        low, high = params.get("from", 0.0), params.get("to", 1.0)
        u = sample_spec("uniform", key, spec, dtype, device)
        return u if (low, high) == (0.0, 1.0) else u.mul_(high - low).add_(low)
    if kind == "normal":
        z = sample_spec("normal", key, spec, dtype, device)
        mean, std = params.get("mean", 0.0), params.get("std", 1.0)
        return z if (mean, std) == (0.0, 1.0) else z.mul_(std).add_(mean)
    if kind == "integers":
        return _integers(key, spec, device, params["low"], params["high"]).to(dtype)
    if kind == "bernoulli":  # p a Python float; u in [0, 1) with 32 bits, compared in float64
        u = sample_spec("word32", key, spec, torch.int64, device).to(torch.float64).mul_(2.0**-32)
        return (u < params["p"]).to(dtype)
    work = _transform_dtype(dtype)
    if kind == "exponential":
        u = sample_spec("uniform", key, spec, work, device)
        return u.neg_().log1p_().div_(-params["lambd"]).to(dtype)
    if kind == "cauchy":
        u = sample_spec("uniform", key, spec, work, device)
        return u.sub_(0.5).mul_(math.pi).tan_().mul_(params["sigma"]).add_(params["median"]).to(dtype)
    if kind == "log_normal":
        z = sample_spec("normal", key, spec, work, device)
        return z.mul_(params["std"]).add_(params["mean"]).exp_().to(dtype)
    if kind == "geometric":  # u in (0, 1) so that the count is >= 1
        u = sample_spec("word32", key, spec, torch.int64, device).to(torch.float64).add_(0.5).mul_(2.0**-32)
        return u.log_().div_(math.log1p(-params["p"])).ceil_().to(dtype)
    raise ValueError(f"unknown distribution {kind!r}")


# --------------------------------------------------------------------------- #
# Argument handling
# --------------------------------------------------------------------------- #


def _probe(func, dtype, bound: dict) -> None:
    """Run ``func`` on a one-element CPU tensor with the same scalar arguments.

    Raises torch's own error for a bad argument (``std < 0``, ``p`` outside
    ``[0, 1]``, ``from >= to``, a dtype the op refuses), identically on every
    rank (it reads only arguments every rank shares) and before any work. A
    private generator keeps the probe from advancing the user's.
    """
    names = [a.name for a in func._schema.arguments]
    scalars = tuple(
        (n, v) for n, v in bound.items()
        if n in names[1:] and not isinstance(v, torch.Tensor) and n not in ("generator", "device", "pin_memory")
    )  # fmt: skip
    try:
        _probe_scalars(func, dtype, scalars)
    except TypeError as unhashable:  # an argument without a hash: probe uncached
        if "unhashable" not in str(unhashable):
            raise
        _probe_scalars.__wrapped__(func, dtype, scalars)


@functools.lru_cache(maxsize=256)
def _probe_scalars(func, dtype, scalars) -> None:
    """Memoised on the arguments: a model makes the same calls every step, and only errors matter."""
    func(torch.empty(1, dtype=dtype), **dict(scalars), generator=torch.Generator())


def draw_key(device, generator, mesh) -> torch.Tensor:
    """The op's Philox key from torch's generator; verified across ``mesh`` under the checking mode.

    Ranks whose generators disagree (seeded differently, or one rank drew a
    plain random tensor the others did not) would give a tensor whose shards
    come from different keys: replicated copies that differ, a sharded field
    that changes with the decomposition. Nothing notices that by default (it
    costs an all-gather per draw); under :func:`physicsnemo_dp.debug.checks`
    every rank compares the keys and raises the same error.
    """
    key = _philox.draw_key(device, generator)
    if checks_enabled() and not traced(key):
        rows = collectives.gather_ints(key.tolist(), mesh)
        if any(row != rows[0] for row in rows):
            odd = [r for r, row in enumerate(rows) if row != rows[0]]
            raise PlacementError(
                f"random op on a ShardTensor: torch's generator differs across ranks (mesh positions {odd} "
                "differ from position 0), so the ranks would draw different numbers for the same tensor. "
                "Seed every rank alike (torch.manual_seed(s) with the same s, or physicsnemo_dp.random.manual_seed) "
                "and make the same random draws on every rank"
            )
    return key


def _key(bound: dict, x, device=None) -> torch.Tensor:
    """The op's key on ``device`` (default: where ``x``'s local tensor lives)."""
    return draw_key(device or x._local_tensor.device, bound.get("generator"), x._spec.mesh)


def _box_of(t, spec):
    """Local values of operand ``t`` (ShardTensor or plain) over this rank's box of ``spec`` (broadcasting)."""
    ShardTensor = shard_tensor_cls()
    if not isinstance(t, ShardTensor):
        return replicated_to_box(t, spec) if isinstance(t, torch.Tensor) and t.ndim else t
    if tuple(t.shape) == tuple(spec.global_shape):
        return to_layout(t, spec)
    whole = to_layout(t, t._spec.with_layout((Replicate(),) * t._spec.mesh.ndim, (None,) * t.ndim))
    return replicated_to_box(whole, spec) if whole.ndim else whole


def _require_all(ok_local: torch.Tensor, operands, message: str) -> None:
    """Raise ``message`` on every rank if ``ok_local`` is false on any rank holding a sharded operand."""
    ShardTensor = shard_tensor_cls()
    flag = (~ok_local).to(torch.int64).reshape(1)
    for t in operands:
        if isinstance(t, ShardTensor):
            for m in range(t._spec.mesh.ndim):
                flag = collectives.all_reduce(flag, "max", t._spec.mesh, m)
            break
    if flag.item():
        raise RuntimeError(message)


def _store(x, values: torch.Tensor, spec):
    """Write ``values`` (this rank's box of ``spec``) into ShardTensor ``x`` in place."""
    x._local_tensor.copy_(values)  # a resolved pending reduction keeps the box: same local shape
    x._spec = spec
    return x


def _like_output(local: torch.Tensor, values: torch.Tensor, bound: dict) -> torch.Tensor:
    """``values`` with the strides a ``*_like`` factory would give (``memory_format``)."""
    fmt = bound.get("memory_format") or torch.preserve_format
    if fmt == torch.preserve_format and local.is_contiguous():
        return values
    return torch.empty_like(local, dtype=values.dtype, memory_format=fmt).copy_(values)


# --------------------------------------------------------------------------- #
# Rules
# --------------------------------------------------------------------------- #
#: in-place op -> (distribution, {schema argument name: parameter name})
_IN_PLACE = {
    aten.uniform_.default: ("uniform", {"from": "from", "to": "to"}),
    aten.normal_.default: ("normal", {"mean": "mean", "std": "std"}),
    aten.exponential_.default: ("exponential", {"lambd": "lambd"}),
    aten.cauchy_.default: ("cauchy", {"median": "median", "sigma": "sigma"}),
    aten.log_normal_.default: ("log_normal", {"mean": "mean", "std": "std"}),
    aten.geometric_.default: ("geometric", {"p": "p"}),
    aten.bernoulli_.float: ("bernoulli", {"p": "p"}),
}
#: functional twin -> in-place op (same arguments; the output is a new tensor like ``self``)
_FUNCTIONAL = {
    aten.uniform.default: aten.uniform_.default,
    aten.exponential.default: aten.exponential_.default,
    aten.cauchy.default: aten.cauchy_.default,
    aten.log_normal.default: aten.log_normal_.default,
    aten.geometric.default: aten.geometric_.default,
    aten.bernoulli.p: aten.bernoulli_.float,
}


def _distribution(func, args, kwargs):
    """``x.normal_(...)``, ``x.uniform_(...)``, ... and their functional twins."""
    in_place = _FUNCTIONAL.get(func, func)
    kind, names = _IN_PLACE[in_place]
    x = args[0]
    bound = bind_args(func, args, kwargs)
    dtype = x.dtype
    _probe(in_place, dtype, bound)
    spec = _without_partial(x._spec)
    params = {p: float(bound[n]) for n, p in names.items()}
    local = x._local_tensor
    values = distribution_values(kind, _key(bound, x), spec, dtype, local.device, params)
    if func is in_place:
        return _store(x, values, spec)
    return wrap(_like_output(local, values, {}), spec)


def _random_(func, args, kwargs):
    """``random_()``: ``[0, 2**mantissa]`` for floats, ``[0, max]`` for ints; ``random_(from, to)``: ``[from, to)``."""
    x = args[0]
    bound = bind_args(func, args, kwargs)
    _probe(func, x.dtype, bound)
    low = int(bound.get("from", 0) or 0)
    high = bound.get("to")
    if high is None:
        high = _random_top(x.dtype) + 1
    spec = _without_partial(x._spec)
    local = x._local_tensor
    values = _integers(_key(bound, x), spec, local.device, low, int(high)).to(x.dtype)
    return _store(x, values, spec)


def _random_top(dtype: torch.dtype) -> int:
    """Largest value of ``random_()`` without ``to`` (torch's convention)."""
    if dtype == torch.bool:
        return 1
    if dtype.is_floating_point:
        return 2 ** {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    return torch.iinfo(dtype).max


def _like(kind):
    def rule(func, args, kwargs):
        x = args[0]
        bound = bind_args(func, args, kwargs)
        local = x._local_tensor
        dtype = bound.get("dtype") or x.dtype
        device = bound.get("device") or local.device
        params = {}
        if kind == "integers":
            low, high = bound.get("low", 0), bound["high"]
            low, high = (int(v.item()) if isinstance(v, torch.Tensor) else int(v) for v in (low, high))
            torch.randint_like(torch.empty(1, dtype=dtype), low, high, generator=torch.Generator())  # torch's errors
            params = {"low": low, "high": high}
        spec = _without_partial(x._spec)
        values = distribution_values(kind, _key(bound, x, device), spec, dtype, device, params)
        return wrap(_like_output(local, values, bound), spec)

    return rule


def _bernoulli_tensor(func, args, kwargs):
    """``x.bernoulli_(p_tensor)`` / ``torch.bernoulli(probs)`` / ``torch.bernoulli(x, p_tensor)``."""
    x = args[0]
    bound = bind_args(func, args, kwargs)
    p = x if func is aten.bernoulli.default else bound["p"]
    if func is not aten.bernoulli.default:
        meta_output(func, [t for t in (x, p)], {})  # shape errors, the same on every rank
    spec = _without_partial(x._spec)
    local = x._local_tensor
    p_local = _box_of(p, spec).to(torch.float64)  # p is a tensor in every overload served here
    ok = ((p_local >= 0) & (p_local <= 1)).all()
    _require_all(ok, (x, p), f"{func}: expected every probability in p to be in [0, 1]")
    u = sample_spec("word32", _key(bound, x), spec, torch.int64, local.device).to(torch.float64)
    values = (u.mul_(2.0**-32) < p_local).to(x.dtype)
    if func is aten.bernoulli_.Tensor:
        return _store(x, values, spec)
    return wrap(_like_output(local, values, {}), spec)


def _normal_tensors(func, args, kwargs):
    """``torch.normal(mean, std)`` with a tensor mean and/or std: ``mean + std * z``, z laid out like the output."""
    ShardTensor = shard_tensor_cls()
    bound = bind_args(func, args, kwargs)
    mean, std = bound["mean"], bound["std"]
    out = meta_output(func, [mean, std], {})
    operands = [t for t in (mean, std) if isinstance(t, ShardTensor)]
    full = [t for t in operands if tuple(t.shape) == tuple(out.shape)]
    ref = next((t for t in full if any(issubclass(type(p), Shard) for p in t._spec.placements)), full[0] if full else None)
    if ref is not None:
        spec = _without_partial(ref._spec)
    else:
        mesh = operands[0]._spec.mesh
        spec = type(operands[0]._spec).chunked(mesh, (Replicate(),) * mesh.ndim, tuple(out.shape), out.dtype)
    if isinstance(std, torch.Tensor):
        s_local = _box_of(std, spec)
        ok = (s_local >= 0).all()
        _require_all(ok, (mean, std), "normal expects all elements of std >= 0.0")
    else:
        if std < 0:
            raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
        s_local = std
    device = operands[0]._local_tensor.device
    z = sample_spec("normal", _key(bound, operands[0]), spec, out.dtype, device)
    return wrap(z.mul_(s_local).add_(_box_of(mean, spec)), spec)


def _native_dropout(func, args, kwargs):
    """``native_dropout(x, p, train)`` (``F.dropout`` on accelerators): ``x * mask / (1 - p)``, torch's formula."""
    x, p, *rest = args
    train = rest[0] if rest else kwargs.get("train")
    local = x._local_tensor
    mask_spec = _without_partial(x._spec)
    if train is False:
        return wrap(local.clone(), x._spec), wrap(torch.ones_like(local, dtype=torch.bool), mask_spec)
    if not 0.0 <= p <= 1.0:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    u = sample_spec("word32", _key({}, x), mask_spec, torch.int64, local.device).to(torch.float64)
    mask = u.mul_(2.0**-32) < keep
    # the mask is the same on every rank of a pending reduction's group, and x * mask * scale
    # (scale >= 0) is linear and monotone: pending sums, maxima and minima stay pending.
    return wrap(local * mask * scale, x._spec), wrap(mask, mask_spec)


RULES = {
    **{op: _distribution for op in (*_IN_PLACE, *_FUNCTIONAL)},
    **{op: _random_ for op in (aten.random_.default, getattr(aten.random_, "from"), aten.random_.to)},
    **{op: _like("uniform") for op in (aten.rand_like.default, aten.rand_like.generator)},
    **{op: _like("normal") for op in (aten.randn_like.default, aten.randn_like.generator)},
    **{
        op: _like("integers")
        for op in (
            aten.randint_like.default,
            aten.randint_like.low_dtype,
            aten.randint_like.Tensor,
            aten.randint_like.generator,
            aten.randint_like.Tensor_generator,
            aten.randint_like.low_generator_dtype,
        )
    },
    **{op: _bernoulli_tensor for op in (aten.bernoulli_.Tensor, aten.bernoulli.default, aten.bernoulli.Tensor)},
    **{op: _normal_tensors for op in (aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)},
    aten.native_dropout.default: _native_dropout,
}
