"""The elementwise fast path above the dispatcher steps aside wherever the dispatcher must see the op.

Elementwise functions on ShardTensors of one layout that record no gradient
run on the local tensors in ``__torch_function__`` (see
``rules/pointwise._elementwise_handler``). Checked against the full tensors in
one process, and that the usual route is taken when a gradient is recorded,
a dispatch mode watches, a dispatch handler is registered for the ATen op, a
pending sum is involved, or the call writes in place.

The contractions' fast path (``x @ w``, ``F.linear(x, w[, b])`` with plain
weights, ``rules/matmul._fast_product`` / ``_fast_linear``): taken (no generic
promotion), bitwise the general path's values and gradients, and stepping aside
for ShardTensor weights, autocast, other promotion modes, keyword calls and
user handlers.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_dp import ShardTensor
from tests._harness import distributed
from tests.core._util import integer_tensor, make_spec, shard_from_global

aten = torch.ops.aten

CALLS = [
    lambda t: t + t, lambda t: 2.0 - t, lambda t: t * 0.5, lambda t: t / 3, lambda t: -t, lambda t: t**2,
    torch.tanh, torch.sigmoid, torch.exp, lambda t: torch.add(t, t, alpha=2), lambda t: torch.maximum(t, t * 2),
    F.gelu, F.silu, F.relu, lambda t: torch.relu(t * 0.5 + 1.0),
]  # fmt: skip


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shard_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.shard_ops += any(isinstance(a, ShardTensor) for a in args)
        return func(*args, **(kwargs or {}))


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_fast_path_matches_the_full_tensor_and_steps_aside(ctx):
    G = integer_tensor((7, 5), seed=1) / 4
    placements = (Shard(0),) * ctx.mesh.ndim if ctx.mesh.ndim == 1 else (Shard(0), Shard(1))
    spec = make_spec(ctx.mesh, placements, G.shape)
    for k, call in enumerate(CALLS):
        x = shard_from_global(G, spec)
        y = call(x)
        assert y._spec.dim_sizes == spec.dim_sizes and y._spec.placements == spec.placements, k
        assert torch.allclose(y.full_tensor(), call(G)), k
        # a recorded gradient takes the usual route (autograd sees the op)
        xg = shard_from_global(G, spec, requires_grad=True)
        yg = call(xg)
        assert yg.grad_fn is not None, k
        yg.sum().backward()
        ref = G.clone().requires_grad_(True)
        call(ref).sum().backward()
        assert torch.allclose(xg.grad.full_tensor(), ref.grad), k
        # a dispatch mode sees the ShardTensor op
        with _Seen() as seen:
            call(x)
        assert seen.shard_ops > 0, k


@distributed(world_sizes=(2,), mesh_2d=False)
def test_dispatch_handlers_pending_sums_and_in_place_calls_take_the_usual_route(ctx):
    G = integer_tensor((6, 4), seed=2)
    x = shard_from_global(G, make_spec(ctx.mesh, (Shard(0),), G.shape))
    called = []

    def handler(func, types, args, kwargs):
        called.append(func)
        from physicsnemo_dp.rules.pointwise import pointwise_rule

        return pointwise_rule(func, args, kwargs)

    ShardTensor.register_dispatch_handler(aten.tanh.default, handler)
    try:
        torch.tanh(x)
    finally:
        from physicsnemo_dp.dispatch.registry import dispatch_handlers

        dispatch_handlers.unregister(aten.tanh.default)
    assert called == [aten.tanh.default]
    p = shard_from_global(G, make_spec(ctx.mesh, (Partial(),), G.shape))
    assert torch.allclose(torch.tanh(p).full_tensor(), torch.tanh(G))  # reduced first, not tanh of contributions
    z = shard_from_global(G - 1, make_spec(ctx.mesh, (Shard(0),), G.shape))
    out = F.relu(z, True)
    assert out is z and torch.equal(z.full_tensor(), F.relu(G - 1))


def _rowwise_cases(mesh):
    """(placements, whole rows?) for a (rows, features) input normalized over its features."""
    if mesh.ndim == 2:
        return [((Shard(0), Shard(0)), True), ((Shard(0), Shard(1)), False)]
    return [((Shard(0),), True), ((Shard(1),), False), ((Partial(),), False)]


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_layer_norm_over_whole_rows_skips_the_plan_and_matches(ctx):
    """Rows whole on their rank: straight to torch's fused kernel (no meta call), same values and gradients."""
    import physicsnemo_dp.spatial.norm as norm

    G = integer_tensor((9, 6), seed=3) / 4
    ln = torch.nn.LayerNorm(6, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.copy_(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        ln.bias.copy_(torch.linspace(-1, 1, 6, dtype=torch.float64))
    ref_x = G.clone().requires_grad_(True)
    ref_y = ln(ref_x)
    (ref_y * G).sum().backward()
    ref = (ref_y.detach(), ref_x.grad, ln.weight.grad.clone(), ln.bias.grad.clone())
    meta_output, metas = norm.meta_output, []
    norm.meta_output = lambda *a: metas.append(1) or meta_output(*a)  # counts the general path's meta calls
    try:
        for placements, whole in _rowwise_cases(ctx.mesh):
            metas.clear()
            ln.zero_grad()
            x = shard_from_global(G, make_spec(ctx.mesh, placements, G.shape), requires_grad=True)
            y = ln(x)
            assert (not metas) == whole, placements
            (y * shard_from_global(G, y._spec)).sum().backward()
            got = (y.full_tensor(), x.grad.full_tensor(), ln.weight.grad, ln.bias.grad)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b)
    finally:
        norm.meta_output = meta_output


# --------------------------------------------------------------------------- #
# Contractions with a plain weight: x @ w, F.linear(x, w[, b]) served before promotion
# --------------------------------------------------------------------------- #
_CONTRACTIONS = {
    "x @ w": lambda x, w, b: x @ w,
    "torch.matmul": lambda x, w, b: torch.matmul(x, w),
    "F.linear": lambda x, w, b: F.linear(x, w.t()),
    "F.linear + bias": lambda x, w, b: F.linear(x, w.t(), b),
}


def _contraction_step(ctx, name, G, W, B, placements):
    """Forward and every gradient of one contraction with plain (leaf) weight and bias; the number of general-path calls."""
    import physicsnemo_dp.dispatch.torch_function as tf

    w = torch.nn.Parameter(W.clone().t().contiguous().t() if name.startswith("F.linear") else W.clone())
    b = torch.nn.Parameter(B.clone())
    x = shard_from_global(G, make_spec(ctx.mesh, placements, G.shape), requires_grad=True)
    general, promote_args = [], tf.promote_args
    tf.promote_args = lambda *a: general.append(1) or promote_args(*a)  # counts calls that took the general path
    try:
        y = _CONTRACTIONS[name](x, w, b)
    finally:
        tf.promote_args = promote_args
    (y * shard_from_global(torch.ones(y.shape, dtype=G.dtype) / 3, y._spec)).sum().backward()
    return (y.full_tensor(), x.grad.full_tensor(), w.grad, b.grad), len(general)


def _general_path_only():
    """Context in which the contractions' fast path is off (the handlers keep only the general path)."""
    import contextlib

    from physicsnemo_dp.rules.matmul import FUNCTIONS

    @contextlib.contextmanager
    def off():
        saved = {f: h.before_promotion for f, h in FUNCTIONS.items() if getattr(h, "before_promotion", None)}
        try:
            for f in saved:
                FUNCTIONS[f].before_promotion = None
            yield
        finally:
            for f, fast in saved.items():
                FUNCTIONS[f].before_promotion = fast

    return off()


def _program_only():
    """Context in which contractions run their local program, never the plain kernel directly (``Prepared.direct``)."""
    import contextlib

    from physicsnemo_dp.rules.matmul import contract

    def clear():
        contract.propagate.cache_clear()
        for cache in (contract._PAIRS, contract._GRADS, __import__("physicsnemo_dp.rules.matmul").rules.matmul._FAST):
            cache.clear()

    @contextlib.contextmanager
    def off():
        direct_kernel = contract.direct_kernel
        contract.direct_kernel = lambda program: None
        clear()
        try:
            yield
        finally:
            contract.direct_kernel = direct_kernel
            clear()

    return off()


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_contraction_fast_path_is_taken_and_bitwise_the_general_path(ctx):
    """A ShardTensor times a plain weight skips the general path; values and every gradient are bitwise those of
    the general path and match one process (uneven rows, an empty shard at world 3, the 2x2 mesh, buckets)."""
    from physicsnemo_dp import bucket_gradients
    from physicsnemo_dp.promotion import clear_gradient_buckets

    gen = torch.Generator().manual_seed(5)
    G, W, B = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((7, 5), (5, 4), (4,)))
    placements = (Shard(0),) * ctx.mesh.ndim
    for name, call in _CONTRACTIONS.items():
        ref_x, ref_w, ref_b = (t.clone().requires_grad_(True) for t in (G, W, B))
        ref_y = call(ref_x, ref_w, ref_b)
        (ref_y / 3).sum().backward()
        ref = (ref_y.detach(), ref_x.grad, ref_w.grad, ref_b.grad if name.endswith("bias") else None)
        fast, general_calls = _contraction_step(ctx, name, G, W, B, placements)
        assert general_calls == 0, name
        with _general_path_only():
            slow, general_calls = _contraction_step(ctx, name, G, W, B, placements)
        assert general_calls == 1, name
        with _program_only():  # the plain kernel called directly (mm, linear) gives the local program's bits
            program, _ = _contraction_step(ctx, name, G, W, B, placements)
        for a, b, c, r in zip(fast, slow, program, ref):
            assert (a is None) == (b is None) == (c is None), name
            assert a is None or (torch.equal(a, b) and torch.equal(a, c)), name
            if r is not None:
                torch.testing.assert_close(a, r)
    # gradient buckets: the bucket's node reduces the weight's gradient, as on the general path
    lin = torch.nn.Linear(5, 4, dtype=torch.float64)
    bucket_gradients(lin)
    try:
        grads = []
        for off in (False, True):
            lin.zero_grad()
            x = shard_from_global(G, make_spec(ctx.mesh, placements, G.shape), requires_grad=True)
            with _general_path_only() if off else torch.enable_grad():
                lin(x).sum().backward()
            grads.append((lin.weight.grad.clone(), lin.bias.grad.clone(), x.grad.full_tensor()))
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        clear_gradient_buckets()


@distributed(world_sizes=(2,), mesh_2d=False)
def test_contraction_fast_path_steps_aside(ctx):
    """The general path serves a ShardTensor weight, autocast, a promotion mode other than SILENT, keyword
    calls and a user's function handler; under checks the fast path runs the same plan and values."""
    import contextlib
    import warnings

    import physicsnemo_dp.dispatch.torch_function as tf
    from physicsnemo_dp import promotion_mode
    from physicsnemo_dp.debug import checks

    G = integer_tensor((6, 4), seed=7, dtype=torch.float32)
    W = integer_tensor((4, 3), seed=8, dtype=torch.float32)
    x = shard_from_global(G, make_spec(ctx.mesh, (Shard(0),), G.shape, dtype=G.dtype))
    w = torch.nn.Parameter(W.clone())
    general, promote_args = [], tf.promote_args
    tf.promote_args = lambda *a: general.append(1) or promote_args(*a)
    try:
        general.clear()
        x @ shard_from_global(W, make_spec(ctx.mesh, (Replicate(),), W.shape, dtype=W.dtype))
        assert general, "ShardTensor weight"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            general.clear()
            y = x @ w
            assert general and y.dtype == torch.bfloat16, "autocast"
        general.clear()
        F.linear(x, weight=w.t())
        assert general, "keyword"
        with promotion_mode("warn"), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            general.clear()
            x @ w
            assert general and seen, "warn mode"
        with promotion_mode("disabled"):
            try:
                x @ w
                raise AssertionError("DISABLED promotion must refuse a plain weight")
            except Exception as e:  # the general path's PromotionError
                assert "DISABLED" in str(e)
        handled = []
        from physicsnemo_dp.dispatch.registry import function_handlers

        with contextlib.ExitStack() as stack:  # (``x @ w`` reaches the hook as one of these, by torch version)
            for f in (torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul):
                stack.enter_context(function_handlers.override(f, lambda f, t, a, k: handled.append(1) or "user"))
            assert x @ w == "user" and handled
        general.clear()
        with checks():
            y = x @ w
        assert not general
        torch.testing.assert_close(y.full_tensor(), G @ W)
    finally:
        tf.promote_args = promote_args


@distributed(world_sizes=(2,), mesh_2d=False)
def test_matmul_operator_skips_the_hook_and_steps_aside(ctx):
    """``x @ w`` enters ``ShardTensor.__matmul__``, which offers the call to the fast path without torch's hook
    (no ``__torch_function__`` entry), with the hook's own values and gradients bit for bit; a
    TorchFunctionMode still sees the call, disabled subclass torch-function still reaches the dispatcher, and
    a call the fast path declines (a ShardTensor weight) goes through the hook."""
    from torch.overrides import TorchFunctionMode

    import physicsnemo_dp.shard_tensor as st
    from physicsnemo_dp.rules.matmul import contract

    gen = torch.Generator().manual_seed(9)
    G, W = torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(5, 4, generator=gen, dtype=torch.float64)
    spec = make_spec(ctx.mesh, (Shard(0),), G.shape)
    entered, hook = [], st.handle_torch_function

    def step(call):
        x, w = shard_from_global(G, spec, requires_grad=True), torch.nn.Parameter(W.clone())
        entered.clear()
        st.handle_torch_function = lambda func, *rest: entered.append(func) or hook(func, *rest)
        try:
            y = call(x, w)
        finally:
            st.handle_torch_function = hook
        (y * shard_from_global(torch.ones(y.shape, dtype=G.dtype) / 3, y._spec)).sum().backward()
        return (y._spec, y._local_tensor, x.grad._local_tensor, w.grad), len(entered)

    (y_spec, *fast), fast_entries = step(lambda x, w: x @ w)
    (ref_spec, *hooked), hook_entries = step(lambda x, w: torch.Tensor.__matmul__(x, w))
    assert fast_entries == 0 and hook_entries == 1
    assert y_spec is ref_spec and all(torch.equal(a, b) for a, b in zip(fast, hooked))
    torch.testing.assert_close(fast[-1], G.t() @ torch.ones(7, 4, dtype=G.dtype) / 3)

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    x, w = shard_from_global(G, spec), torch.nn.Parameter(W.clone())
    with Watch() as watch:
        y = x @ w
    assert watch.seen, "a TorchFunctionMode sees x @ w"
    torch.testing.assert_close(y.full_tensor(), G @ W)
    dispatched, dispatch = [], st.handle_torch_dispatch
    st.handle_torch_dispatch = lambda func, *rest: dispatched.append(func) or dispatch(func, *rest)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            y = x @ w
    finally:
        st.handle_torch_dispatch = dispatch
    assert aten.mm.default in dispatched, "subclass torch-function disabled: the dispatcher serves x @ w"
    torch.testing.assert_close(y.full_tensor(), G @ W)
    entered.clear()
    st.handle_torch_function = lambda func, *rest: entered.append(func) or hook(func, *rest)
    try:
        y = x @ shard_from_global(W, make_spec(ctx.mesh, (Replicate(),), W.shape))
    finally:
        st.handle_torch_function = hook
    assert len(entered) == 1, "declined by the fast path: torch's hook"  # (it reports Tensor.matmul)
    torch.testing.assert_close(y.full_tensor(), G @ W)
    # the plan runs torch.mm on the local tensors directly (no moves, no bias)
    wv = __import__("physicsnemo_dp.promotion").promotion.promote(W, ctx.mesh)
    assert contract.prepare(contract.Equation((("n", "k"), ("k", "m")), ("n", "m")), (x, wv)).direct is torch.mm


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_linear_reductions_run_their_rule_without_the_dispatcher(ctx):
    """``sum``/``mean``/``nansum`` (``rules/reductions/functions.LinearReduction``) call their dispatch rule
    directly: no ATen call on a ShardTensor reaches the dispatcher, the bits and layouts (values and
    gradients) are those of the dispatcher path, and a dispatch mode or a dispatch handler still sees the op."""
    import physicsnemo_dp.shard_tensor as st
    from physicsnemo_dp.dispatch.registry import dispatch_handlers
    from physicsnemo_dp.rules.reductions import functions

    G = integer_tensor((5, 7), seed=3) / 4
    placements = (Shard(0),) * ctx.mesh.ndim if ctx.mesh.ndim == 1 else (Shard(0), Shard(1))
    spec = make_spec(ctx.mesh, placements, G.shape)
    calls = [lambda t: t.mean(), lambda t: t.sum(1, keepdim=True), lambda t: torch.mean(t, (0, 1), dtype=torch.float64),
             lambda t: torch.nansum(t), lambda t: t.nansum(0, keepdim=True), lambda t: t.sum(dtype=torch.float64)]  # fmt: skip
    seen, dispatch = [], st.handle_torch_dispatch
    for k, call in enumerate(calls):
        runs = []
        for direct in (True, False):
            x = shard_from_global(G, spec, requires_grad=True)
            intercepted = functions._intercepted
            functions._intercepted = intercepted if direct else (lambda op: True)
            st.handle_torch_dispatch = lambda func, *rest: seen.append(func) or dispatch(func, *rest)
            try:
                seen.clear()
                y = call(x)
            finally:
                st.handle_torch_dispatch, functions._intercepted = dispatch, intercepted
            assert bool(seen) != direct, (k, seen)
            y.backward(torch.ones_like(y))
            runs.append((y, x.grad))
        (y, g), (y_ref, g_ref) = runs
        for a, b in ((y, y_ref), (g, g_ref)):
            assert a._spec == b._spec and torch.equal(a._local_tensor, b._local_tensor), k
        ref = G.clone().requires_grad_(True)
        call(ref).backward(torch.ones_like(call(ref)))
        assert torch.allclose(y.full_tensor(), call(G)) and torch.allclose(g.full_tensor(), ref.grad), k
        with _Seen() as watching:
            call(shard_from_global(G, spec))
        assert watching.shard_ops > 0, k
    handled = []
    ShardTensor.register_dispatch_handler(
        aten.mean.dim, lambda func, types, args, kwargs: handled.append(func) or functions._sum_like(func, args, kwargs)
    )
    try:
        shard_from_global(G, spec).mean()
    finally:
        dispatch_handlers.unregister(aten.mean.dim)
    assert handled == [aten.mean.dim]


# --------------------------------------------------------------------------- #
# Per-step costs below the op: gradient sums, *_like factories, the backward entry, autograd Functions
# --------------------------------------------------------------------------- #
class _Count:
    """Wrap ``owner.name`` with a call counter (``calls``); ``restore()`` puts the original back."""

    def __init__(self, owner, name, fail=False):
        self.owner, self.name, self.calls = owner, name, 0
        self.original = getattr(owner, name)

        def counting(*args, **kwargs):
            self.calls += 1
            if fail:
                raise AssertionError(f"{name} was called: the fast path was not taken")
            return self.original(*args, **kwargs)

        setattr(owner, name, counting)

    def restore(self):
        setattr(self.owner, self.name, self.original)


@distributed(world_sizes=(1, 3), mesh_2d=True)
def test_step_fast_paths_are_taken_and_step_aside(ctx):
    """Same-spec ``a + b`` below autograd (forward adds and autograd's gradient sums), ``zeros_like`` /
    ``ones_like`` above the dispatcher, and the backward entry without ``_make_grads``: taken on every mesh,
    the full tensor's values and gradients; the general route for pending sums, other layouts, keyword
    calls, dispatch handlers and modes, and outside plain eager code; the same results in the checking
    mode and under autocast."""
    import physicsnemo_dp
    from physicsnemo_dp.dispatch import torch_dispatch
    from physicsnemo_dp.rules import pointwise, tensor_like

    G = integer_tensor((7, 5), seed=3) / 4
    placements = (Shard(0),) * ctx.mesh.ndim if ctx.mesh.ndim == 1 else (Shard(0), Shard(1))
    spec = make_spec(ctx.mesh, placements, G.shape)
    for checking in (False, True):
        with physicsnemo_dp.debug.checks(checking):
            # the add: forward and the gradient sum of a tensor used twice, never through the general loop
            general = _Count(pointwise, "_same_spec_fast_path", fail=True)
            make_grads = _Count(torch.autograd, "_make_grads")
            try:
                x = shard_from_global(G, spec, requires_grad=True)
                y = x * x + x  # x's three gradients are summed by autograd
                y.backward(torch.ones_like(y))
            finally:
                general.restore()
                make_grads.restore()
            assert make_grads.calls == 0  # a gradient in the output's own layout needs no _make_grads
            ref = G.clone().requires_grad_()
            (ref * ref + ref).backward(torch.ones_like(ref))
            assert torch.allclose(y.full_tensor(), G * G + G)
            assert torch.allclose(x.grad.full_tensor(), ref.grad)
    # the add steps aside: a pending sum, another layout (the general rule redistributes)
    general = _Count(pointwise, "_same_spec_fast_path")
    try:
        p = shard_from_global(G, make_spec(ctx.mesh, (Partial(),) * ctx.mesh.ndim, G.shape))
        other = shard_from_global(G, make_spec(ctx.mesh, (Replicate(),) * ctx.mesh.ndim, G.shape))
        summed, mixed = p + p, shard_from_global(G, spec) + other
    finally:
        general.restore()
    assert general.calls == 2
    assert torch.allclose(summed.full_tensor(), 2 * p.full_tensor()) and torch.allclose(mixed.full_tensor(), 2 * G)
    # a plain gradient or one of another layout goes through torch's checks
    make_grads = _Count(torch.autograd, "_make_grads")
    try:
        x = shard_from_global(G, spec, requires_grad=True)
        (x * 2).backward(torch.ones(G.shape, dtype=G.dtype))
        (x * 2).backward(shard_from_global(torch.ones_like(G), make_spec(ctx.mesh, (Replicate(),) * ctx.mesh.ndim, G.shape)))
    finally:
        make_grads.restore()
    assert make_grads.calls == 2 and torch.allclose(x.grad.full_tensor(), torch.full_like(G, 4.0))
    # zeros_like / ones_like: no trip through the dispatcher, the dispatch rule's layout; the usual route otherwise
    pending = shard_from_global(G, make_spec(ctx.mesh, (Partial(),) * ctx.mesh.ndim, G.shape))
    for factory, value in ((torch.zeros_like, 0.0), (torch.ones_like, 1.0)):
        x = shard_from_global(G, spec)
        dispatched = _Count(torch_dispatch.table, "lookup")
        try:
            fast = factory(x)
            replicated = factory(pending)  # a pending sum's factory is whole: Replicate
        finally:
            dispatched.restore()
        assert dispatched.calls == 0
        assert fast._spec is spec and torch.equal(fast.full_tensor(), torch.full_like(G, value))
        assert all(type(q) is Replicate for q in replicated._spec.placements)
        with _Seen() as seen:
            factory(x)
        assert seen.shard_ops == 1  # a dispatch mode sees the ATen op
        dispatched = _Count(torch_dispatch.table, "lookup")
        eager = tensor_like.plain_eager
        tensor_like.plain_eager = lambda: False  # as while torch.compile traces
        try:
            cast, usual = factory(x, dtype=torch.float32), factory(x)
        finally:
            tensor_like.plain_eager = eager
            dispatched.restore()
        assert dispatched.calls == 2 and cast.dtype == torch.float32 and usual._spec is spec
        assert torch.equal(usual.full_tensor(), torch.full_like(G, value))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert factory(x).dtype == G.dtype
        called = []
        op = aten.zeros_like.default if factory is torch.zeros_like else aten.ones_like.default

        def handler(func, types, args, kwargs, called=called):
            called.append(func)
            return tensor_like._factory_like(func, args, kwargs)

        ShardTensor.register_dispatch_handler(op, handler)
        try:
            factory(x)
        finally:
            from physicsnemo_dp.dispatch.registry import dispatch_handlers

            dispatch_handlers.unregister(op)
        assert called == [op]
    # the same-spec add below autograd is the pointwise rule's answer, and a dispatch handler for it is called
    assert torch_dispatch.table.lookup(aten.add.Tensor) is pointwise.pointwise_rule
    called = []

    def add_handler(func, types, args, kwargs):
        called.append(func)
        return pointwise.pointwise_rule(func, args, kwargs)

    ShardTensor.register_dispatch_handler(aten.add.Tensor, add_handler)
    try:
        x = shard_from_global(G, spec, requires_grad=True)
        (x + x).sum().backward()
    finally:
        from physicsnemo_dp.dispatch.registry import dispatch_handlers

        dispatch_handlers.unregister(aten.add.Tensor)
    assert called and called[0] is aten.add.Tensor and torch.allclose(x.grad.full_tensor(), torch.full_like(G, 2.0))


@distributed(world_sizes=(1,), mesh_2d=False)
def test_library_functions_call_autograd_directly_and_refuse_a_double_backward(ctx):
    """Library autograd Functions in the ``forward(ctx, ...)`` style go straight to autograd's C++ ``apply``
    (torch's unwraps dead functorch wrappers with a generator first), their nodes call ``backward`` without
    torch's per-call lookup, and ``once_differentiable`` still refuses a second differentiation."""
    from physicsnemo_dp import _torch_compat, fusion
    from physicsnemo_dp.rules.joins import _SameCat

    for cls in (_SameCat, fusion._Enter, fusion._Leave, fusion._Fused):
        assert cls._backward_cls.apply is _torch_compat._backward_apply, cls
        assert _torch_compat._binds_to_itself(cls, 4)

    class WithVjp(_torch_compat.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def vjp(ctx, g):
            return g * 2

    assert WithVjp._backward_cls.apply is torch.autograd.function.BackwardCFunction.apply
    x0 = torch.ones(3, requires_grad=True)
    WithVjp.apply(x0).sum().backward()
    assert torch.equal(x0.grad, torch.full((3,), 2.0))
    G = integer_tensor((4, 3), seed=5)
    x = shard_from_global(G, make_spec(ctx.mesh, (Shard(0),), G.shape), requires_grad=True)
    unwrap = _Count(torch._functorch.utils, "unwrap_dead_wrappers")
    try:
        y = torch.cat([x, x * 2], dim=1)  # _SameCat
    finally:
        unwrap.restore()
    assert unwrap.calls == 0 and type(y.grad_fn).apply is _torch_compat._backward_apply
    v = torch.ones_like(y).requires_grad_()  # an upstream gradient that requires grad: a graph to differentiate
    (g,) = torch.autograd.grad(y, x, v, create_graph=True)
    assert torch.equal(g.full_tensor(), torch.full_like(G, 3.0)) and g.requires_grad
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        g.sum().backward()


@distributed(world_sizes=(3,), mesh_2d=False)
def test_metadata_reads_skip_promotion_and_a_handler_still_comes_first(ctx):
    """``x.shape``, ``x.size()``, ``x.stride()``, ``x.dim()`` on a ShardTensor skip promotion (route ``_READ``) and
    give the global tensor's metadata (uneven rows over three ranks); a function handler registered for such a
    read is still called (the lane steps aside), and its removal restores the lane."""
    from physicsnemo_dp.dispatch import registry
    from physicsnemo_dp.dispatch import torch_function as tf

    full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)
    x = shard_from_global(full, make_spec(ctx.mesh, (Shard(0),), (7, 5)))
    assert x._local_tensor.shape[0] != 7  # uneven rows: the local answer differs from the global one
    general, promote_args = [], tf.promote_args
    tf.promote_args = lambda *a: general.append(1) or promote_args(*a)
    try:
        reads = (lambda: x.shape, lambda: x.size(), lambda: x.size(1), lambda: x.stride(), lambda: x.dim())
        assert [r() for r in reads] == [full.shape, full.size(), full.size(1), full.stride(), full.dim()]
        assert not general, "a metadata read took promotion's pass"
        seen = []
        with registry.function_handlers.override(torch.Tensor.size, lambda f, t, a, k: seen.append(1) or "handled"):
            assert x.size() == "handled" and seen and general  # the handler's usual route, promotion first
        general.clear()
        assert x.size() == full.size() and not general  # the lane is back
    finally:
        tf.promote_args = promote_args
