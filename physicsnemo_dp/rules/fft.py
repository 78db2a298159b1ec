"""Discrete Fourier transforms (``torch.fft``) on ShardTensors.

Every ``torch.fft`` transform reaches three ATen ops: ``_fft_c2c``,
``_fft_r2c`` (real input, optionally one-sided: the last transformed dim
becomes ``n // 2 + 1``) and ``_fft_c2r`` (Hermitian half in, real out), plus
zero-padding/cropping for ``n``/``s``, a cast of real input to complex and
``conj`` (``hfft*``/``ihfft*``). ``fftshift``/``ifftshift`` are ``roll``
(:mod:`.dim_ops.reorder`: one all-to-all along a sharded dim, uneven shards
included).

**Along unsharded dims a transform is local** and the output keeps the
input's placements and shard sizes.

**Along a sharded dim the data is transposed** so that the dim is whole: the
transform runs in stages, each over the transformed dims that are whole at
that moment; between stages one all-to-all per mesh dim moves the shard from
a dim still to be transformed to a dim that is whole and needs nothing more
(slab decomposition on a 1-D mesh; pencil decomposition when two mesh dims
shard two transformed dims). The target of a shard is, in this order: a dim
this call has already transformed, a dim it does not transform (the largest,
if at least as long as the mesh dim), a transformed dim not yet reached, and
only when no dim can carry the shard a gather (``Replicate``). Newly sharded
dims take the split rule's sizes (``torch.chunk``), so every rank agrees on
the output's shape without communicating, also when the dim changed size
(``n // 2 + 1``). The result is **left in the transposed layout**: the return
trip is paid only by the inverse transform, so a spectral block
(``rfft2`` → multiply/truncate → ``irfft2``) costs one all-to-all each way.
``n``/``s`` padding or cropping of a dim happens when that dim is whole, just
before it is transformed.

Output placements, for a tensor ``(..., H, W)`` sharded on one mesh dim
(``H'``, ``W'``: the transformed dims; ``Wr = W // 2 + 1``):

===============================================  ==================  ===========================
call                                             input sharded on    output sharded on
===============================================  ==================  ===========================
any transform not touching the sharded dim       any other dim       the same dim, same sizes
``fft2``/``ifft2``/``fftn``/``ifftn``            ``H``               ``W'`` (one all-to-all)
``rfft2``/``rfftn``/``ihfft2``/``ihfftn``        ``H``               ``Wr`` (one all-to-all)
``irfft2``/``irfftn``/``hfft2``/``hfftn``        ``Wr`` (``W'``)     ``H`` (one all-to-all)
``rfft2`` and friends                            ``W``               a dim not transformed
                                                                     (else ``H`` then ``Wr``:
                                                                     two all-to-alls)
1-D ``fft``/``ifft``/``rfft``/``irfft``/         the transformed     the largest other dim at
``hfft``/``ihfft``                               dim                 least as long as the mesh
                                                                     dim (else gathered)
===============================================  ==================  ===========================

A block ``irfft2(f(rfft2(x)), s=x.shape[-2:])`` on ``x`` sharded along ``H``
therefore ends sharded along ``H`` again, with split-rule sizes (``x``'s own
when they are the split rule's).

**Backward** is written here, not taken from ATen's formulas (which build a
full-size zero spectrum, a replicated tensor on ShardTensors): every step is
linear, so the gradient runs the adjoint steps in reverse order through the
same staged transforms (``c2c`` → ``c2c`` of the opposite direction, ``r2c``
→ zero-pad the half spectrum, inverse ``c2c``, real part; ``c2r`` → ``r2c``
with the non-self-conjugate half doubled; pad ↔ crop; conj ↔ conj). It costs
the mirror all-to-alls and brings the gradient to the input's layout.

Communication per transform along a sharded dim, per mesh dim that moves:
one all-to-all of the tensor at the point of the transpose (for ``rfft2`` the
complex half spectrum, ``8 (W//2+1) / W`` bytes per float32 input element,
``(P-1)/P`` of it leaving each rank on even shards): the transpose itself,
which is the minimum. Pending sums (``Partial``) stay pending (every step is
linear); pending max/min are reduced first.

``FUNCTIONS`` take over the ``torch.fft`` functions above autograd (the plan
is torch's own decomposition, recorded once per call signature on meta
tensors, so arguments and errors are exactly torch's); ``RULES`` serve the
three ATen ops when they are called directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .. import _layout
from .._redistribute import grad_layout, redistribute_local, target_layout
from .._torch_compat import Function, TorchDispatchMode, on_real_tensors, torch_function_disabled
from ..rule_kit import normalize_dim, resolve_partial, shard_tensor_cls, wrap

aten = torch.ops.aten

__all__ = ["RULES", "FUNCTIONS"]


# --------------------------------------------------------------------------- #
# Steps: torch's decomposition of one torch.fft call, as data
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Step:
    """One linear step of a transform.

    ``kind``: ``"resize"`` (``dim`` to ``n``: crop or zero-pad at the end),
    ``"cast"`` (real to ``dtype``), ``"conj"``, or an FFT: ``"c2c"``
    (``flag`` = forward), ``"r2c"`` (``flag`` = onesided), ``"c2r"`` (``n`` =
    output size of the last dim); adjoints also use ``"real"`` (the real part)
    and ``"double"`` (positions ``1 .. n`` of ``dim`` times 2). ``sizes`` of an FFT: ``(dim, n)`` resizes
    applied to a dim just before it is transformed. ``shape`` is the global
    input shape of the step (what an adjoint returns to).
    """

    kind: str
    shape: tuple
    dims: tuple = ()
    norm: int = 0
    flag: bool = False
    dim: int = 0
    n: int = 0
    sizes: tuple = ()
    dtype: torch.dtype | None = None


_FFTS = ("c2c", "r2c", "c2r")


class _Recorder(TorchDispatchMode):
    """Records the ATen ops a torch.fft function issues (run on meta tensors)."""

    def __init__(self):
        super().__init__()
        self.steps: list[_Step] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.steps.extend(_steps_of(func, args, kwargs))
        return func(*args, **kwargs)


def _steps_of(func, args, kwargs) -> list[_Step]:
    x = args[0]
    shape = tuple(x.shape)
    if func is aten._fft_c2c.default:
        return [_Step("c2c", shape, tuple(args[1]), int(args[2]), bool(args[3]))]
    if func is aten._fft_r2c.default:
        return [_Step("r2c", shape, tuple(args[1]), int(args[2]), bool(args[3]))]
    if func is aten._fft_c2r.default:
        return [_Step("c2r", shape, tuple(args[1]), int(args[2]), n=int(args[3]))]
    if func is aten.constant_pad_nd.default:
        pad = list(args[1])
        out = []
        for i in range(len(pad) // 2):
            d, left, right = len(shape) - 1 - i, pad[2 * i], pad[2 * i + 1]
            if left != 0:
                raise NotImplementedError(f"fft: unexpected padding at the start of dim {d}")
            if right:
                out.append(_Step("resize", shape, dim=d, n=shape[d] + right))
        return out
    if func is aten.slice.Tensor:
        d, start, end, step = (list(args[1:]) + [0, 0, None, 1][len(args) - 1 :])[:4]
        d = normalize_dim(d, len(shape))
        end = shape[d] if end is None else min(end, shape[d])
        if start not in (0, None) or step != 1:
            raise NotImplementedError(f"fft: unexpected slice {start}:{end}:{step} of dim {d}")
        return [_Step("resize", shape, dim=d, n=end)] if end != shape[d] else []
    if func is aten._to_copy.default:
        return [_Step("cast", shape, dtype=kwargs.get("dtype", x.dtype))]
    if func in (aten._conj.default, aten._conj_physical.default, aten.conj_physical.default):
        return [_Step("conj", shape)]
    if func in (aten.clone.default, aten.alias.default, aten.detach.default, aten.view.default):
        return []
    raise NotImplementedError(
        f"ShardTensor FFTs: torch's decomposition reached {func}, which the fft family does not "
        "know; report it with the call that reached it"
    )


@functools.lru_cache(maxsize=512)
@on_real_tensors
def _plan(func, shape, dtype, args, kwargs):
    """The steps of ``func(x, *args, **kwargs)`` for a global ``x`` of ``shape``/``dtype``, and its output.

    Run on meta tensors, so bad arguments raise torch's own error, the same
    on every rank, before anything moves.
    """
    x, recorder = torch.empty(shape, dtype=dtype, device="meta"), _Recorder()
    with recorder:
        out = func(x, *args, **dict(kwargs))
    return tuple(_fold(recorder.steps)), (tuple(out.shape), out.dtype)


def _fold(steps):
    """Attach resizes that directly precede an FFT of their dim to that FFT (applied when the dim is whole)."""
    out: list[_Step] = []
    for s in steps:
        if s.kind in _FFTS:
            sizes = []
            shape = None
            while out and out[-1].kind == "resize" and out[-1].dim in s.dims:
                r = out.pop()
                sizes.insert(0, (r.dim, r.n))
                shape = r.shape
            if sizes:  # the step's own sizes (if any) apply after the folded ones
                merged = dict(sizes)
                merged.update(dict(s.sizes))
                s = _Step(s.kind, shape, s.dims, s.norm, s.flag, n=s.n, sizes=tuple(merged.items()))
        out.append(s)
    return out


@functools.lru_cache(maxsize=512)
def _adjoint(steps) -> tuple:
    """Steps of the adjoint (the vector-Jacobian product), in execution order (memoised: steps are data)."""
    out: list[_Step] = []
    for s in reversed(steps):
        shape_out = _shape_after(s)
        if s.kind == "resize":
            out.append(_Step("resize", shape_out, dim=s.dim, n=s.shape[s.dim]))
        elif s.kind == "cast":
            out.append(_Step("real", shape_out))
        elif s.kind in ("conj", "double"):  # self-adjoint
            out.append(_Step(s.kind, shape_out, dim=s.dim, n=s.n))
        elif s.kind == "c2c":
            out.append(_Step("c2c", shape_out, s.dims, s.norm, not s.flag))
        elif s.kind == "r2c":
            last = s.dims[-1]
            n_in = _input_sizes(s)[last]
            sizes = ((last, n_in),) if s.flag else ()
            out.append(_Step("c2c", shape_out, s.dims, s.norm, False, sizes=sizes))
            out.append(_Step("real", _shape_with(shape_out, sizes)))
        elif s.kind == "c2r":  # r2c of the gradient, non-self-conjugate half doubled
            last, n = s.dims[-1], s.n
            out.append(_Step("r2c", shape_out, s.dims, s.norm, True))
            doubled = n - (n // 2 + 1)
            if doubled > 0:
                out.append(_Step("double", _shape_with(shape_out, ((last, n // 2 + 1),)), dim=last, n=doubled))
        else:
            raise AssertionError(f"no adjoint for fft step {s.kind}")
        if s.sizes:  # the input resizes folded into an FFT: their adjoints come after it
            mid = _shape_with(s.shape, s.sizes)
            for d, _ in s.sizes:
                out.append(_Step("resize", mid, dim=d, n=s.shape[d]))
                mid = _shape_with(mid, ((d, s.shape[d]),))
    return tuple(_fold(out))


def _input_sizes(s) -> dict:
    """Sizes of an FFT step's dims after its folded resizes."""
    return dict(enumerate(_shape_with(s.shape, s.sizes)))


def _shape_with(shape, sizes) -> tuple:
    shape = list(shape)
    for d, n in sizes:
        shape[d] = n
    return tuple(shape)


def _shape_after(s) -> tuple:
    if s.kind == "resize":
        return _shape_with(s.shape, ((s.dim, s.n),))
    shape = list(_shape_with(s.shape, s.sizes))
    if s.kind == "r2c" and s.flag:
        shape[s.dims[-1]] = shape[s.dims[-1]] // 2 + 1
    elif s.kind == "c2r":
        shape[s.dims[-1]] = s.n
    return tuple(shape)


# --------------------------------------------------------------------------- #
# Execution on a local tensor and its spec
# --------------------------------------------------------------------------- #
def _sharded(spec, d) -> bool:
    """Whether a mesh dim of size > 1 splits dim ``d`` (a size-1 mesh dim leaves it whole)."""
    return any(issubclass(type(p), Shard) and p.dim == d and spec.mesh.size(m) > 1 for m, p in enumerate(spec.placements))


def _respec(spec, shape, dtype, dim_sizes=None):
    """``spec`` with a new global shape and dtype; dims held whole by size-1 mesh dims follow the shape."""
    tables = list(spec.dim_sizes if dim_sizes is None else dim_sizes)
    for d, table in enumerate(tables):
        if table is not None and len(table) == 1:
            tables[d] = (shape[d],)
    return type(spec).from_sizes(spec.mesh, spec.placements, shape, dtype, tuple(tables))


def _resize_local(local, d, n):
    """Crop or zero-pad ``local`` along a whole dim ``d`` to ``n``."""
    have = local.shape[d]
    if n <= have:
        return local.narrow(d, 0, n)
    shape = list(local.shape)
    shape[d] = n
    out = local.new_zeros(shape)  # one buffer (a cat with a block of zeros would hold both at once)
    out.narrow(d, 0, have).copy_(local)
    return out


def _resize(local, spec, d, n):
    """Crop or zero-pad dim ``d`` to ``n`` in place of the layout: no communication.

    Along a sharded dim each shard keeps its part of ``[0, n)`` (cropping) or
    the last shard grows by the zeros (padding).
    """
    shape = _shape_with(spec.global_shape, ((d, n),))
    if not _sharded(spec, d):
        return _resize_local(local, d, n), _respec(spec, shape, local.dtype)
    table = spec.dim_sizes[d]
    me = _layout.table_index(spec.mesh_shape, _layout.sharding_mesh_dims(spec.placements, d), spec.coordinate)
    offsets = [sum(table[:i]) for i in range(len(table))]
    if n <= sum(table):
        new = tuple(max(0, min(s, n - o)) for s, o in zip(table, offsets))
    else:
        new = table[:-1] + (table[-1] + n - sum(table),)
    sizes = list(spec.dim_sizes)
    sizes[d] = new
    return _resize_local(local, d, new[me]), _respec(spec, shape, local.dtype, dim_sizes=tuple(sizes))


def _double(local, spec, d, count, owned):
    """Multiply global positions ``1 .. count`` of dim ``d`` by 2 (c2r's adjoint).

    In place when ``owned`` (``local`` was made by an earlier step of this run,
    as c2r's adjoint's r2c makes it: one buffer less at the backward's peak);
    else on a copy, so a caller's tensor is never changed.
    """
    offset = spec.local_offsets()[d]
    lo, hi = max(1 - offset, 0), min(1 + count - offset, local.shape[d])
    if hi <= lo:
        return local
    if not owned:
        local = local.clone()
    local.narrow(d, lo, hi - lo).mul_(2)
    return local


def _transpose_targets(spec, dims, pending, keep_whole):
    """Placements that move shards of pending dims to dims that can carry them (see module doc).

    The shard of ``keep_whole`` (r2c's halved dim before its first stage)
    moves first and must move: a gather if no dim can take it. Other shards
    without a target stay for a later stage, when transformed dims can take
    them (pencil decomposition); only if no shard can move at all are they
    gathered.
    """
    shape = spec.global_shape
    placements = list(spec.placements)
    movers = [m for m, p in enumerate(placements) if issubclass(type(p), Shard) and p.dim in pending and spec.mesh.size(m) > 1]
    movers.sort(key=lambda m: placements[m].dim != keep_whole)
    used = {p.dim for m, p in enumerate(placements) if issubclass(type(p), Shard) and m not in movers}
    done = [d for d in dims if d not in pending]
    others = [d for d in range(len(shape)) if d not in dims]
    stuck = []
    for m in movers:
        size = spec.mesh.size(m)
        tiers = (
            [d for d in done if d not in used and shape[d] >= size],
            [d for d in others if d not in used and shape[d] >= size],
            [d for d in done if d not in used and shape[d] > 0],
            [d for d in pending if d != keep_whole and d not in used and not _sharded(spec, d) and shape[d] >= size],
        )
        target = next((max(t, key=lambda d: shape[d]) for t in tiers if t), None)
        if target is not None:
            placements[m] = Shard(target)
            used.add(target)
        elif placements[m].dim == keep_whole:
            placements[m] = Replicate()
        else:
            stuck.append(m)
    if len(stuck) == len(movers):  # nothing can move: gather
        for m in stuck:
            placements[m] = Replicate()
    return tuple(placements)


def _fft(local, spec, step):
    """One FFT step on a ShardTensor's local tensor, staged around the sharded dims."""
    dims = tuple(normalize_dim(d, len(spec.global_shape)) for d in step.dims)
    sizes = dict(step.sizes)
    special = dims[-1] if step.kind in ("r2c", "c2r") else None
    pending = list(dims)
    first = True
    for _ in range(2 * len(dims) + 2):
        if not pending:
            return local, spec
        ready = [d for d in pending if not _sharded(spec, d)]
        if step.kind == "r2c" and first:
            stage = ready if special in ready else []
        elif step.kind == "c2r":
            stage = ready if len(ready) == len(pending) else [d for d in ready if d != special]
        else:
            stage = ready
        if not stage:
            keep_whole = special if step.kind == "r2c" and first else None
            placements = _transpose_targets(spec, dims, pending, keep_whole)
            layout = target_layout(spec, placements)
            new = spec.with_layout(layout.placements, layout.dim_sizes)
            local, spec = redistribute_local(local, spec, new), new
            continue
        stage = [d for d in dims if d in stage]  # torch's order: the halved/expanded dim last
        shape = list(spec.global_shape)
        for d in stage:
            if d in sizes:
                local = _resize_local(local, d, sizes[d])
                shape[d] = sizes[d]
        if step.kind == "r2c" and first:
            if step.flag:
                shape[special] = shape[special] // 2 + 1
            local = _local_fft(aten._fft_r2c, local, shape, stage, step.norm, step.flag)
        elif step.kind == "c2r" and special in stage:
            shape[special] = step.n
            local = _local_fft(aten._fft_c2r, local, shape, stage, step.norm, step.n)
        else:
            forward = step.flag if step.kind == "c2c" else step.kind == "r2c"
            local = _local_fft(aten._fft_c2c, local, shape, stage, step.norm, forward)
        spec = _respec(spec, tuple(shape), local.dtype)
        pending = [d for d in pending if d not in stage]
        first = False
    raise AssertionError(f"fft staging did not converge for {step} on {spec}")


def _local_fft(op, local, shape, *args):
    """``op(local, *args)``; an empty shard (which the FFT backends refuse) gives an empty result.

    ``shape`` is the global output shape: only transformed dims, which are
    whole here, change size.
    """
    if local.numel():
        return op(local, *args)
    out_shape = [n if d in args[0] else local.shape[d] for d, n in enumerate(shape)]
    dtype = local.dtype.to_complex() if op is aten._fft_r2c else local.dtype.to_real() if op is aten._fft_c2r else local.dtype
    return local.new_empty(out_shape, dtype=dtype)


def _run(local, spec, steps):
    """Execute ``steps`` on this rank's ``local`` laid out as ``spec``.

    ``owned`` tracks whether ``local`` is a tensor this run made (an FFT's or
    a conjugation's output), which a later step may change in place; the
    given tensor, and views (crops, real parts), are never changed.
    """
    owned = False
    for s in steps:
        if s.kind in _FFTS:
            local, spec = _fft(local, spec, s)
            owned = True
        elif s.kind == "resize":
            local, spec = _resize(local, spec, normalize_dim(s.dim, len(spec.global_shape)), s.n)
            owned = False
        elif s.kind == "cast":
            local = local.to(s.dtype)
            spec = _respec(spec, spec.global_shape, local.dtype)
            owned = False
        elif s.kind == "real":
            local = torch.real(local)
            spec = _respec(spec, spec.global_shape, local.dtype)
            owned = False
        elif s.kind == "conj":
            local = torch.conj_physical(local)
            owned = True
        elif s.kind == "double":
            doubled = _double(local, spec, s.dim, s.n, owned)
            owned = owned or doubled is not local  # nothing to double returns the tensor as it was
            local = doubled
        else:
            raise AssertionError(f"unknown fft step {s.kind}")
    return local, spec


def _linear_input(x):
    """Local tensor and spec of ``x`` with pending max/min reduced (sums stay: every step is linear)."""
    mesh_dims = [m for m, p in enumerate(x._spec.placements) if issubclass(type(p), Partial) and p.reduce_op not in ("sum", "avg")]
    return resolve_partial(x, mesh_dims) if mesh_dims else (x._local_tensor, x._spec)


# --------------------------------------------------------------------------- #
# Function level (above autograd): torch.fft.*
# --------------------------------------------------------------------------- #
class _Transform(Function):
    @staticmethod
    def forward(x, steps):
        local, spec = _linear_input(x)
        local, spec = _run(local, spec, steps)
        return wrap(local, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, steps = inputs
        ctx.steps = steps
        ctx.in_spec = x._spec
        ctx.out_spec = output._spec

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, shard_tensor_cls()):
            grad = wrap(grad, grad_layout(ctx.out_spec))
        local, spec = _linear_input(grad)
        local, spec = _run(local, spec, _adjoint(ctx.steps))
        target = grad_layout(ctx.in_spec)
        if spec.placements != target.placements or spec.dim_sizes != target.dim_sizes:
            local = redistribute_local(local, spec, target, implicit=False)  # the gradient in its input's layout
        return wrap(local, target), None


def _key(v):
    """A hashable form of an argument (lists of sizes or dims become tuples)."""
    return tuple(v) if isinstance(v, (list, torch.Size)) else v


def _handler(python_func, types, args, kwargs):
    x = args[0] if args else kwargs.get("input")
    if "out" in kwargs or not isinstance(x, shard_tensor_cls()):
        with torch_function_disabled():
            return python_func(*args, **kwargs)
    rest = tuple(_key(a) for a in args[1:])
    named = tuple(sorted((k, _key(v)) for k, v in kwargs.items() if k != "input"))
    steps, _ = _plan(python_func, tuple(x._spec.global_shape), x.dtype, rest, named)
    return _Transform.apply(x, steps)


_PUBLIC = (
    "fft", "ifft", "rfft", "irfft", "hfft", "ihfft",
    "fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2",
    "fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn",
)  # fmt: skip

FUNCTIONS = {getattr(torch.fft, name): _handler for name in _PUBLIC}


# --------------------------------------------------------------------------- #
# ATen level: the three ops called directly
# --------------------------------------------------------------------------- #
def _aten_rule(kind):
    def rule(func, args, kwargs):
        x = args[0]
        steps = _steps_of(func, args, kwargs)
        local, spec = _linear_input(x)
        local, spec = _run(local, spec, steps)
        return wrap(local, spec)

    rule.__name__ = f"_fft_{kind}_rule"
    return rule


RULES = {
    aten._fft_c2c.default: _aten_rule("c2c"),
    aten._fft_r2c.default: _aten_rule("r2c"),
    aten._fft_c2r.default: _aten_rule("c2r"),
}
