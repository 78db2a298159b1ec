"""Propagation apart from execution: pure, memoised plans whose bytes are what the ops then move.

``propagation.plan(op, *specs)`` answers from layouts alone; the rules run the
same memoised plans. Checked here: the plan is a pure function of hashable
metadata (the same object comes back; nothing but meta tensors is made while planning), its
bytes per rank equal what ``count_collectives()`` records when the op runs on
uneven layouts (worlds 1-4 and the 2x2 mesh), and its output spec is the one
the op produces.
"""

from itertools import product

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_dp import count_collectives, propagation
from physicsnemo_dp._torch_compat import pytree
from tests._harness import distributed

from ._util import integer_tensor, make_spec, shard_from_global

aten = torch.ops.aten


class _NoTensorOps(TorchDispatchMode):
    """Fails on any op on data: planning may only ask torch's shape checks, on meta tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]  # cat: a list
        if leaves and all(t.device.type == "meta" for t in leaves) or str(kwargs.get("device")) == "meta":
            return func(*args, **kwargs)
        raise AssertionError(f"planning ran a tensor op on data: {func}")


def _specs(mesh, shape, kinds=("uneven", "chunk")):
    """Specs of ``shape`` in several layouts of ``mesh`` (uneven and chunked shards, Partial, Replicate)."""
    one = [Shard(0), Shard(1), Replicate(), Partial()]
    out = []
    for placements in product(one, repeat=mesh.ndim):
        for kind in kinds:
            if kind == "chunk" and not any(p.is_shard() for p in placements):
                continue
            out.append(make_spec(mesh, placements, shape, kind))
    return out


def _check_bytes(plan, counter, where):
    assert plan.summary() == counter.summary(), where
    assert (plan.bytes_sent, plan.bytes_received) == (counter.total_sent, counter.total_received), where


@distributed
def test_pointwise_plan_bytes_and_output_equal_the_run(ctx):
    shape = (7, 6)
    A, B = integer_tensor(shape, seed=1), integer_tensor(shape, seed=2)
    specs = _specs(ctx.mesh, shape)
    cases = [(a, b) for a in specs for b in specs[:: max(1, len(specs) // 5)]]
    for sa, sb in cases:
        with _NoTensorOps():
            plan = propagation.plan(aten.mul.Tensor, sa, sb)
        assert propagation.plan(aten.mul.Tensor, sa, sb) is plan  # memoised: the same object back
        a, b = shard_from_global(A, sa), shard_from_global(B, sb)
        with count_collectives() as counter:
            y = a * b
        where = f"{sa} * {sb}"
        _check_bytes(plan, counter, where)
        assert y._spec == plan.output_specs[0], where
        assert torch.equal(y.full_tensor(), A * B), where


@distributed
def test_unary_and_broadcast_plans(ctx):
    shape = (5, 6)
    A, bias = integer_tensor(shape, seed=3), integer_tensor((6,), seed=4)
    for sa in _specs(ctx.mesh, shape):
        sb = make_spec(ctx.mesh, (Replicate(),) * ctx.mesh.ndim, (6,), "chunk")
        for op, args, run in (
            (aten.tanh.default, (sa,), lambda a, b: torch.tanh(a)),
            (aten.add.Tensor, (sa, sb), lambda a, b: a + b),
        ):
            plan = propagation.plan(op, *args)
            a, b = shard_from_global(A, sa), shard_from_global(bias, sb)
            with count_collectives() as counter:
                y = run(a, b)
            _check_bytes(plan, counter, f"{op} {sa}")
            assert y._spec == plan.output_specs[0]
            assert torch.allclose(y.full_tensor(), run(A, bias))


@distributed
def test_contraction_plan_bytes_and_output_equal_the_run(ctx):
    n, k, m = 7, 6, 5
    X, W = integer_tensor((n, k), seed=5), integer_tensor((k, m), seed=6)
    xs = _specs(ctx.mesh, (n, k))
    ws = _specs(ctx.mesh, (k, m))[:: max(1, len(xs) // 4)]
    for sx, sw in product(xs, ws):
        if any(p.is_partial() for p in sx.placements) and any(p.is_partial() for p in sw.placements):
            continue  # a product of two pending sums is not a pending sum: reduced first, as the plan says too
        with _NoTensorOps():
            plan = propagation.plan(aten.mm.default, sx, sw)
        assert propagation.plan(torch.mm, sx, sw) is plan
        x, w = shard_from_global(X, sx), shard_from_global(W, sw)
        with count_collectives() as counter:
            y = torch.mm(x, w)
        where = f"{sx} @ {sw}"
        _check_bytes(plan, counter, where)
        assert y._spec == plan.output_specs[0], where
        assert torch.equal(y.full_tensor(), X @ W), where


@distributed(world_sizes=(2, 3, 4), mesh_2d=False)
def test_linear_plan_with_a_promoted_weight(ctx):
    X, W, b = integer_tensor((9, 4), seed=7), integer_tensor((3, 4), seed=8), integer_tensor((3,), seed=9)
    mesh = ctx.mesh
    for placement in (Shard(0), Shard(1)):
        sx = make_spec(mesh, (placement,), (9, 4), "uneven")
        sw = propagation.replicated(mesh, (3, 4), W.dtype)
        sb = propagation.replicated(mesh, (3,), b.dtype)
        plan = propagation.plan(F.linear, sx, sw, sb)
        x = shard_from_global(X, sx)
        with count_collectives() as counter:
            y = F.linear(x, W, b)
        _check_bytes(plan, counter, str(placement))
        assert y._spec == plan.output_specs[0]
        assert torch.allclose(y.full_tensor(), F.linear(X, W, b))


@distributed(world_sizes=(2, 3, 4))
def test_redistribution_steps_count_what_redistribute_moves(ctx):
    shape = (9, 7)
    G = integer_tensor(shape, seed=10)
    specs = _specs(ctx.mesh, shape)
    for src, dst in product(specs, specs):
        if any(p.is_partial() for p in dst.placements) and not any(p.is_partial() for p in src.placements):
            continue  # Replicate -> Partial moves nothing; Shard -> Partial pads: covered, but skip the many local ones
        steps = propagation.redistribution_steps(src, dst)
        x = shard_from_global(G, src)
        from physicsnemo_dp._redistribute import redistribute_local

        with count_collectives() as counter:
            redistribute_local(x._local_tensor, src, dst)
        plan = propagation.OpPlan((dst,), steps)
        _check_bytes(plan, counter, f"{src} -> {dst}")


def test_plan_refuses_families_that_plan_inline():
    with pytest.raises(NotImplementedError, match="plans while it runs"):
        propagation.plan(aten.cumsum.default, None, 0)


@distributed
def test_window_op_plan_bytes_equal_the_halo_exchange(ctx):
    from physicsnemo_dp.spatial import _geometry
    from physicsnemo_dp.spatial._window_op import build

    shape, pad = (2, 3, 9, 7), (1, 2, 2, 1)  # F.pad order: last dim first
    G = integer_tensor(shape, seed=11)
    placements = (Shard(2),) if ctx.mesh.ndim == 1 else (Shard(2), Shard(3))
    for mode in ("constant", "circular", "reflect"):
        spec = make_spec(ctx.mesh, placements, shape, "uneven")
        x = shard_from_global(G, spec)
        with count_collectives() as counter:
            y = F.pad(x, pad, mode=mode)
        expected = F.pad(G, pad, mode=mode)
        assert torch.equal(y.full_tensor(), expected), mode
        maps = {d: _geometry.Strided(shape[d], expected.shape[d], pad_left=pad[2 * (3 - d)]) for d in (3, 2)}
        geometry = build(spec, maps, tuple(expected.shape), mode=mode)
        assert build(spec, maps, tuple(expected.shape), mode=mode) is geometry  # memoised
        steps = geometry.comm_steps()
        plan = propagation.OpPlan((geometry.out_spec,), steps)
        assert y._spec == geometry.out_spec, mode
        _check_bytes(plan, counter, mode)


@distributed
def test_view_plan_bytes_and_output_equal_the_run(ctx):
    shape = (6, 4, 5)
    G = integer_tensor(shape, seed=12)
    cases = [
        (aten.view.default, ((24, 5),), lambda t: t.view(24, 5)),
        (aten.view.default, ((6, 20),), lambda t: t.reshape(6, 20)),
        (aten.view.default, ((2, 3, 20),), lambda t: t.reshape(2, 3, 20)),
        (aten.view.default, ((120,),), lambda t: t.reshape(120)),
        (aten.transpose.int, (0, 2), lambda t: t.transpose(0, 2)),
        (aten.permute.default, ((2, 0, 1),), lambda t: t.permute(2, 0, 1)),
        (aten.unsqueeze.default, (1,), lambda t: t.unsqueeze(1)),
    ]
    for sx in _specs(ctx.mesh, shape):
        for op, args, run in cases:
            with _NoTensorOps():
                plan = propagation.plan(op, sx, *args)
            assert propagation.plan(op, sx, *args) is plan
            x = shard_from_global(G, sx)
            with count_collectives() as counter:
                y = run(x)
            where = f"{op} {args} of {sx}"
            _check_bytes(plan, counter, where)
            assert y._spec == plan.output_specs[0], where
            assert torch.equal(y.full_tensor(), run(G)), where



def _outputs(y):
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _check_run(plan, run, tensors, full_args, counter_where):
    """Run ``run`` on ``tensors`` under the counter; bytes, output specs and values must be the plan's and torch's."""
    with count_collectives() as counter:
        y = run(*tensors)
    _check_bytes(plan, counter, counter_where)
    outs, expected = _outputs(y), _outputs(run(*full_args))
    assert tuple(t._spec for t in outs) == plan.output_specs, counter_where
    for got, want in zip(outs, expected):
        assert torch.allclose(got.full_tensor(), want, equal_nan=True), counter_where


@distributed
def test_reduction_plan_bytes_and_output_equal_the_run(ctx):
    shape = (7, 6)
    G = integer_tensor(shape, seed=13)
    cases = [
        (aten.sum.dim_IntList, ([0],), lambda t: t.sum(0)),
        (aten.sum.default, (), lambda t: t.sum()),
        (aten.mean.dim, ([1], True), lambda t: t.mean(1, keepdim=True)),
        (aten.amax.default, ([0],), lambda t: t.amax(0)),
        (aten.max.dim, (1,), lambda t: torch.max(t, 1)),
        (aten.argmin.default, (0,), lambda t: t.argmin(0)),
        (aten.prod.dim_int, (1,), lambda t: t.prod(1)),
        (aten.linalg_vector_norm.default, (2.0, [0, 1]), lambda t: torch.linalg.vector_norm(t)),
        (aten.var.correction, ([0],), lambda t: t.var(0)),
        # torch.std_mean composes std and mean (the mean left pending); the ATen op is planned as one
        (aten.std_mean.correction, ([0, 1],), lambda t: aten.std_mean.correction(t, [0, 1])),
    ]
    specs = _specs(ctx.mesh, shape)
    for k, sx in enumerate(specs):
        for op, args, run in cases[k % 2 :: 1 + (ctx.mesh.ndim > 1)]:  # on the 2x2 mesh, half the ops per layout
            with _NoTensorOps():
                plan = propagation.plan(op, sx, *args)
            assert propagation.plan(op, sx, *args) is plan  # memoised: the same object back
            _check_run(plan, run, (shard_from_global(G, sx),), (G,), f"{op} {args} of {sx}")


@distributed
def test_join_plan_bytes_and_output_equal_the_run(ctx):
    shape = (7, 6)
    A, B = integer_tensor(shape, seed=14), integer_tensor(shape, seed=15)
    single = [
        (aten.slice.Tensor, (0, 1, 6, 2), lambda t: t[1:6:2]),
        (aten.split.Tensor, (3, 0), lambda t: t.split(3, 0)),
        (aten.select.int, (0, -2), lambda t: t[-2]),
        (aten.select.int, (1, 4), lambda t: t[:, 4]),
        (aten.unbind.int, (1,), lambda t: t.unbind(1)),
    ]
    pairs = [
        (aten.cat.default, (0,), lambda a, b: torch.cat([a, b], 0)),
        (aten.cat.default, (1,), lambda a, b: torch.cat([a, b], 1)),
        (aten.stack.default, (1,), lambda a, b: torch.stack([a, b], 1)),
    ]
    specs = _specs(ctx.mesh, shape)
    stride = 1 + (ctx.mesh.ndim > 1)  # on the 2x2 mesh, half the ops per layout
    for k, sa in enumerate(specs):
        a = shard_from_global(A, sa)
        for op, args, run in single[k % stride :: stride]:
            with _NoTensorOps():
                plan = propagation.plan(op, sa, *args)
            assert propagation.plan(op, sa, *args) is plan
            _check_run(plan, run, (a,), (A,), f"{op} {args} of {sa}")
        sb = specs[(3 * k + 1) % len(specs)]
        for op, args, run in pairs[k % stride :: stride]:
            with _NoTensorOps():
                plan = propagation.plan(op, [sa, sb], *args)
            assert propagation.plan(op, (sa, sb), *args) is plan
            _check_run(plan, run, (a, shard_from_global(B, sb)), (A, B), f"{op} {args} of {sa}, {sb}")
    # a plain operand is planned as its promoted (replicated) spec
    sa = specs[0]
    plan = propagation.plan(aten.cat.default, [sa, propagation.replicated(ctx.mesh, (2, 6), B.dtype)], 0)
    _check_run(plan, lambda a, b: torch.cat([a, b]), (shard_from_global(A, sa), B[:2]), (A, B[:2]), "cat with plain")


@distributed
def test_softmax_plan_bytes_and_output_equal_the_run(ctx):
    shape = (5, 7)
    X, G = integer_tensor(shape, seed=16) / 4, integer_tensor(shape, seed=17)
    Y = torch.softmax(X, 1)
    specs = _specs(ctx.mesh, shape)
    for k, sx in enumerate(specs):
        for dim in (0, 1):
            op = (aten._softmax.default, aten._log_softmax.default)[(k + dim) % 2]
            with _NoTensorOps():
                plan = propagation.plan(op, sx, dim, False)
            assert propagation.plan(op, sx, dim, False) is plan
            _check_run(plan, lambda t: op(t, dim, False), (shard_from_global(X, sx),), (X,), f"{op} {dim} {sx}")
        # backward of softmax along dim 1: the output in this layout, the gradient in another one
        sy, sg = make_spec(ctx.mesh, sx.placements, shape, "chunk" if k % 2 else "uneven"), specs[-1 - k]
        back = aten._softmax_backward_data.default
        plan = propagation.plan(back, sg, sy, 1, torch.float64)
        if any(p.is_partial() for p in sy.placements):
            continue  # an output is never pending: the forward resolves it
        run = lambda g, y: back(g, y, 1, torch.float64)  # noqa: E731
        _check_run(plan, run, (shard_from_global(G, sg), shard_from_global(Y, sy)), (G, Y), f"backward {sg} {sy}")


@distributed
def test_sort_plan_bytes_and_output_equal_the_run(ctx):
    shape = (5, 7)
    X = integer_tensor(shape, seed=18)
    for k, sx in enumerate(_specs(ctx.mesh, shape)):
        dim = k % 2
        with _NoTensorOps():
            plan = propagation.plan(aten.sort.stable, sx, stable=True, dim=dim)
        assert propagation.plan(aten.sort.stable, sx, stable=True, dim=dim) is plan
        run = lambda t: torch.sort(t, dim=dim, stable=True)  # noqa: E731
        _check_run(plan, run, (shard_from_global(X, sx),), (X,), f"sort {dim} {sx}")


# --------------------------------------------------------------------------- #
# Attention: F.scaled_dot_product_attention and the fused CPU kernel's ops
# --------------------------------------------------------------------------- #
def _attention_cases(mesh):
    """``(label, q, k, v, mask or None, kwargs, canonical)``: specs on ``mesh``, uneven sequence shards.

    ``canonical`` marks inputs already in the attention's canonical layout, whose backward
    communicates only the schedule's own steps (checked against ``AttentionPlan.backward``).
    """
    from physicsnemo_dp import ShardTensorSpec

    def on(p):
        return (p,) if mesh.ndim == 1 else (Shard(0), p)

    batch = make_spec(mesh, on(Replicate()), (2, 1)).dim_sizes[0]  # one batch split for every input

    def spec(p, shape, salt, like=None, dtype=torch.float64):
        s = make_spec(mesh, on(p), shape, salt=salt, dtype=dtype)
        seq = like.dim_sizes[2] if like is not None else s.dim_sizes[2]  # values follow the keys
        sizes = (batch, s.dim_sizes[1], seq, *s.dim_sizes[3:])
        return ShardTensorSpec.from_sizes(mesh, s.placements, shape, dtype, sizes)

    S2, R = Shard(2), Replicate()
    qshape, kshape, vshape = (2, 4, 9, 3), (2, 4, 10, 3), (2, 4, 10, 4)
    q, k = spec(S2, qshape, 1), spec(S2, kshape, 2)
    v = spec(S2, vshape, 0, like=k)
    kr, vr = spec(R, kshape, 0), spec(R, vshape, 0)
    kg = spec(S2, (2, 2, 10, 3), 2)
    vg = spec(S2, (2, 2, 10, 4), 0, like=kg)
    mask = spec(Shard(3), (2, 1, 1, 10), 0, dtype=torch.bool)
    mask = mask.with_layout(mask.placements, (*mask.dim_sizes[:3], k.dim_sizes[2]))  # columns split like the keys
    cases = []
    for causal in (False, True):
        kw = {"is_causal": causal}
        cases += [
            ("ring", q, k, v, None, kw, True),
            ("ring, values in other shard sizes", q, k, spec(S2, vshape, 5), None, kw, False),
            ("kv_sharded", spec(R, qshape, 0), k, v, None, kw, True),
            ("local", q, kr, vr, None, kw, True),
            ("ring, gqa", q, kg, vg, None, {**kw, "enable_gqa": True}, True),
            ("pending query", make_spec(mesh, on(Partial()), qshape), k, v, None, kw, False),
        ]
    cases.append(("ring, key-padding mask travels", q, k, v, mask, {}, True))
    return cases


def _attention_inputs(specs, seed):
    """ShardTensors of ``specs`` (None stays None): small values, or a boolean mask of their dtype."""
    out = []
    for i, s in enumerate(specs):
        if s is None:
            out.append(None)
            continue
        data = integer_tensor(s.global_shape, seed + i, s.tensor_meta.dtype)
        out.append(shard_from_global(data / 8 if data.is_floating_point() else data, s))
    return out


def _check_sdpa(q, k, v, m, kw, canonical, where, values=True):
    from physicsnemo_dp._redistribute import grad_layout
    from physicsnemo_dp.attention.sdpa import plan_call

    args = (q, k, v) if m is None else (q, k, v, m)
    with _NoTensorOps():
        plan = propagation.plan(F.scaled_dot_product_attention, *args, **kw)
    assert propagation.plan(F.scaled_dot_product_attention, *args, **kw) is plan, where  # memoised
    tq, tk, tv, tm = _attention_inputs((q, k, v, m), 20)
    tq, tk, tv = (t.requires_grad_() for t in (tq, tk, tv))
    with count_collectives() as counter:
        out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, **kw)
    _check_bytes(plan, counter, where)
    assert out._spec == plan.output_specs[0], where
    if values:
        full = [None if t is None else t.full_tensor().detach() for t in (tq, tk, tv, tm)]
        want = F.scaled_dot_product_attention(*full[:3], attn_mask=full[3], **kw)
        assert torch.allclose(out.full_tensor(), want), where
    if canonical:  # the backward: the schedule's steps, the output's gradient in its gradient layout
        assert all(t is None for t in plan.operand_specs), where
        ap = plan_call(q, k, v, m, 0.0, kw.get("is_causal", False), None, kw.get("enable_gqa", False))
        grad = shard_from_global(integer_tensor(out.shape, 30) / 8, grad_layout(out._spec))
        with count_collectives() as counter:
            torch.autograd.backward(out, grad)
        _check_bytes(propagation.OpPlan((), ap.backward), counter, f"backward of {where}")


@distributed
def test_attention_plan_bytes_and_output_equal_the_run(ctx):
    for label, q, k, v, m, kw, canonical in _attention_cases(ctx.mesh):
        _check_sdpa(q, k, v, m, kw, canonical, f"{label} {kw}")


@distributed(world_sizes=(2, 3, 4))
def test_attention_plan_follows_zigzag_order_and_head_chunks(ctx):
    """Zig-zag causal order (its shard sizes) and a ring backward cut into head chunks are planned as run."""
    from physicsnemo_dp import ShardTensorSpec
    from physicsnemo_dp.attention import _propagate, zigzag_causal, zigzag_sizes

    mesh = ctx.mesh
    P, m = mesh.size(mesh.ndim - 1), mesh.ndim - 1
    placements = (Shard(2),) if mesh.ndim == 1 else (Shard(0), Shard(2))
    q, k, v = (
        ShardTensorSpec.from_sizes(mesh, placements, shape, torch.float64,
                                   ((1, 1) if mesh.ndim > 1 else None, None, zigzag_sizes(shape[2], P), None))
        for shape in ((2, 4, 11, 3), (2, 4, 11, 3), (2, 4, 11, 4))
    )  # fmt: skip
    with zigzag_causal():
        # (values in zig-zag order are tests/attention's: here the reference would need the permutation)
        _check_sdpa(q, k, v, None, {"is_causal": True}, True, "zigzag causal", values=False)
    saved = _propagate._MIN_CHUNK_BYTES
    _propagate._MIN_CHUNK_BYTES = 1  # these small blocks are cut in two head chunks
    _propagate.propagate.cache_clear()
    try:
        assert len(propagation.plan(F.scaled_dot_product_attention, q, k, v).steps) == P - 1  # forward: uncut
        _check_sdpa(q, k, v, None, {}, True, "head chunks")
        ap = _propagate.propagate(q, k, v, None, 0.0, False, None, False, False)
        assert len(ap.schedule.chunks) == 2 and len(ap.backward) == 2 * (2 * P - 2), m
    finally:
        _propagate._MIN_CHUNK_BYTES = saved
        _propagate.propagate.cache_clear()


@distributed
def test_fused_attention_op_plans_equal_the_run(ctx):
    """The fused CPU kernel's forward and backward ops (reached by nn.MultiheadAttention) plan as they run."""
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    for label, q, k, v, m, kw, _ in _attention_cases(ctx.mesh)[::2]:
        causal = kw.get("is_causal", False)
        if kw.get("enable_gqa"):
            continue  # the fused kernel's schema has no enable_gqa (its rules accept grouped heads as it)
        mkw = {} if m is None else {"attn_mask": m}
        where = f"{label} {kw}"
        with _NoTensorOps():
            plan = propagation.plan(fwd_op, q, k, v, 0.0, causal, **mkw)
        assert propagation.plan(fwd_op, q, k, v, 0.0, causal, **mkw) is plan, where
        tq, tk, tv, tm = _attention_inputs((q, k, v, m), 40)
        with torch.no_grad():
            with count_collectives() as counter:
                out, lse = fwd_op(tq, tk, tv, 0.0, causal, **({} if m is None else {"attn_mask": tm}))
            _check_bytes(plan, counter, where)
            assert (out._spec, lse._spec) == plan.output_specs, where
            # the gradient in a layout of its own (heads sharded): the rule redistributes it first
            gspec = make_spec(ctx.mesh, (Shard(1),) * ctx.mesh.ndim, out.shape, salt=3)
            grad = shard_from_global(integer_tensor(out.shape, 50) / 8, gspec)
            bplan = propagation.plan(bwd_op, gspec, q, k, v, out._spec, lse._spec, 0.0, causal, **mkw)
            with count_collectives() as counter:
                grads = bwd_op(grad, tq, tk, tv, out, lse, 0.0, causal, **({} if m is None else {"attn_mask": tm}))
            _check_bytes(bplan, counter, f"backward of {where}")
            assert tuple(g._spec for g in grads) == bplan.output_specs, where
