"""F.scaled_dot_product_attention on ShardTensors against the single-process op."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests._harness import distributed

from ..ops._diff import check

R, S2 = Replicate(), Shard(2)


def _g(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _layouts(mesh):
    """(q, k, v) placements: every combination of sharded/replicated sequence, batch over "ddp" on 2-D."""
    combos = [(S2, S2, S2), (S2, R, R), (R, S2, S2), (R, R, R), (S2, S2, R), (R, R, S2)]
    if mesh.ndim == 1:
        return [tuple((p,) for p in c) for c in combos]
    return [tuple((Shard(0), p) for p in c) for c in combos] + [((R, S2), (R, S2), (R, S2)), ((S2, R), (R, S2), (R, S2))]


def _qkv(L=7, S=6, Hq=2, Hk=2, E=3, Ev=4, N=2, seed=0):
    return _g((N, Hq, L, E), seed), _g((N, Hk, S, E), seed + 1), _g((N, Hk, S, Ev), seed + 2)


def _run(mesh, fn, tensors, layout, label):
    check(fn, [(t, p) for t, p in zip(tensors, layout)], mesh, label=label)


@distributed(timeout=300)
def test_layouts_and_options(ctx):
    mesh = ctx.mesh
    sdpa = F.scaled_dot_product_attention
    bool_mask = torch.rand((7, 6), generator=torch.Generator().manual_seed(5)) > 0.4
    add_mask = _g((2, 1, 7, 6), 6)
    pad = torch.rand((2, 1, 1, 6), generator=torch.Generator().manual_seed(7)) > 0.3
    cases = [
        ("plain", _qkv(), lambda q, k, v: sdpa(q, k, v)),
        ("causal", _qkv(), lambda q, k, v: sdpa(q, k, v, is_causal=True)),
        ("causal L=S", _qkv(S=7), lambda q, k, v: sdpa(q, k, v, is_causal=True)),
        ("causal L<S", _qkv(L=5, S=9), lambda q, k, v: sdpa(q, k, v, is_causal=True)),
        ("bool mask", _qkv(), lambda q, k, v: sdpa(q, k, v, attn_mask=bool_mask)),
        ("additive mask", _qkv(), lambda q, k, v: sdpa(q, k, v, attn_mask=add_mask)),
        ("key padding", _qkv(), lambda q, k, v: sdpa(q, k, v, attn_mask=pad)),
        ("scale", _qkv(), lambda q, k, v: sdpa(q, k, v, scale=0.3)),
        ("gqa", _qkv(Hq=4, Hk=2), lambda q, k, v: sdpa(q, k, v, enable_gqa=True)),
        ("gqa causal", _qkv(Hq=6, Hk=2, L=6, S=6), lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)),
        ("broadcast heads", _qkv(Hq=3, Hk=1), lambda q, k, v: sdpa(q, k, v)),
    ]
    for layout in _layouts(mesh):
        for label, tensors, fn in cases:
            _run(mesh, fn, tensors, layout, label)


def _zigzag_causal_sdpa(**kw):
    """Causal SDPA run in zig-zag order on ShardTensors (natural order in and out), plain SDPA otherwise."""
    from physicsnemo_dp import ShardTensor
    from physicsnemo_dp.attention import from_zigzag, to_zigzag, zigzag_causal

    def fn(q, k, v):
        if not isinstance(q, ShardTensor):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        m = q.device_mesh.ndim - 1
        q, k, v = (to_zigzag(t, dim=2, mesh_dim=m) for t in (q, k, v))
        with zigzag_causal():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        return from_zigzag(out, dim=2, mesh_dim=m)

    return fn


@distributed(timeout=300)
def test_zigzag_load_balanced_causal(ctx):
    mesh = ctx.mesh
    layouts = [
        lay for lay in _layouts(mesh)
        if S2 in (lay[0][-1], lay[1][-1]) and all(S2 not in p[:-1] for p in lay)  # sequence over the last mesh dim
    ]
    for layout in layouts:
        _run(mesh, _zigzag_causal_sdpa(), _qkv(L=11, S=11), layout, "zigzag")
        _run(mesh, _zigzag_causal_sdpa(), _qkv(L=9, S=13), layout, "zigzag L<S")
        _run(mesh, _zigzag_causal_sdpa(enable_gqa=True), _qkv(L=10, S=10, Hq=4, Hk=2), layout, "zigzag gqa")


@distributed(timeout=300)
def test_float32_and_lower_dims(ctx):
    mesh = ctx.mesh
    sdpa = F.scaled_dot_product_attention
    q, k, v = (t.float() for t in _qkv())
    for layout in _layouts(mesh):
        _run(mesh, lambda q, k, v: sdpa(q, k, v, is_causal=True), (q, k, v), layout, "float32")
    if mesh.ndim == 1:  # 3-D (heads, L, E) and 2-D (L, E) inputs, sequence sharded
        for seq in (1, 0):
            s, tensors = Shard(seq), [t[0] if seq else t[0, 0] for t in _qkv()]
            for p in ((s, s, s), (s, R, R), (R, s, s)):
                _run(mesh, lambda q, k, v: sdpa(q, k, v, is_causal=True), tensors, [(x,) for x in p], f"{3 - seq}-d")


@distributed(timeout=300)
def test_sharded_masks(ctx):
    """Masks passed as ShardTensors: rows split like the queries, columns like the keys (travelling in the ring)."""
    mesh = ctx.mesh
    sdpa = F.scaled_dot_product_attention
    full = torch.rand((2, 1, 7, 6), generator=torch.Generator().manual_seed(8)) > 0.4
    pad = torch.rand((2, 1, 1, 6), generator=torch.Generator().manual_seed(9)) > 0.3
    bias = _g((2, 2, 7, 6), 10)

    def on(p):
        return (p,) if mesh.ndim == 1 else (Shard(0), p)
    for layout in _layouts(mesh)[:3]:  # ring, sharded queries, sharded keys
        for mask, placements in ((full, Shard(2)), (full, Shard(3)), (pad, Shard(3)), (bias, Shard(2)), (bias, Shard(3))):
            check(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m.detach()), [*zip(_qkv(), layout), (mask, on(placements))],
                  mesh, label=f"mask {tuple(mask.shape)} {placements}")  # fmt: skip


@distributed(world_sizes=(1, 3), timeout=300)
def test_one_kernel_call_on_the_local_tensors(ctx):
    """Whole keys on a rank, one tile, one query head per key head, E == Ev: the fused CPU kernel runs on the
    local (B, H, L, E) tensors as given (``WholeAttention``), with the values and gradients of the full-tensor
    call and the bits of the grouped path (``SDPAFunction``), on every layout; taken at P = 1 when q, k and v
    share a layout (a ring of one rank included; queries against sharded keys keep their merged backward)."""
    from physicsnemo_dp.attention import function
    from physicsnemo_dp.attention import sdpa as sdpa_module

    from ..core._util import make_spec, shard_from_global

    mesh, sdpa = ctx.mesh, F.scaled_dot_product_attention
    taken, apply, direct = [], function.WholeAttention.apply, sdpa_module._WHOLE_APPLY
    function.WholeAttention.apply = lambda *a: taken.append(1) or apply(*a)
    sdpa_module._WHOLE_APPLY = lambda *a: taken.append(1) or direct(*a)  # the hook's fast path binds C++ apply
    try:
        for causal in (False, True):
            tensors = _qkv(L=7, S=7, E=4, Ev=4)
            fn = lambda q, k, v: sdpa(q, k, v, is_causal=causal)  # noqa: E731
            for layout in _layouts(mesh):
                taken.clear()
                _run(mesh, fn, tensors, layout, f"whole-call causal={causal}")
                if mesh.size() == 1 and mesh.device_type == "cpu" and layout[0] == layout[1] == layout[2]:
                    assert taken, f"{layout}: the one-call path was not taken"
                runs = []
                for whole in (True, False):
                    xs = [shard_from_global(t, make_spec(mesh, p, tuple(t.shape), salt=i), requires_grad=True)
                          for i, (t, p) in enumerate(zip(tensors, layout))]  # fmt: skip
                    found = function._whole_call
                    function._whole_call = found if whole else (lambda *a: None)
                    sdpa_module._WHOLE.clear()  # the handler's memo of whole calls follows the patched decision
                    try:
                        out = fn(*xs)
                        out.backward(out.detach() * 0 + 1)
                    finally:
                        function._whole_call = found
                        sdpa_module._WHOLE.clear()
                    runs.append([out._local_tensor] + [x.grad._local_tensor for x in xs])
                for a, b in zip(*runs):
                    assert torch.equal(a, b), f"{layout} causal={causal}: not the grouped path's bits"
    finally:
        function.WholeAttention.apply = apply
        sdpa_module._WHOLE_APPLY = direct
    # an in-place change of the output before backward is caught: the general path saves the ShardTensor, the
    # memoised one (the second call) its local tensor and a witness of its version counter
    q, k, v = (shard_from_global(t, make_spec(mesh, _layouts(mesh)[0][0], tuple(t.shape)), requires_grad=True)
               for t in _qkv(L=7, S=7, E=4, Ev=4))  # fmt: skip
    sdpa_module._WHOLE.clear()
    for call in range(2):
        out = sdpa(q, k, v)
        if call == 1 and mesh.size() == 1:
            assert isinstance(out.grad_fn, function.EagerWholeAttention._backward_cls)
        with torch.no_grad():
            out.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(out.detach() * 0 + 1)
    out = sdpa(q, k, v)
    out.mul_(2)  # recorded: the in-place op's node comes first, then the attention's
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(out.detach() * 0 + 1)


@distributed(world_sizes=(1, 3), mesh_2d=False, timeout=300)
def test_repeated_whole_call_skips_planning(ctx):
    """A call the general path runs as one kernel call (``WholeAttention``), repeated with the same specs and
    options, goes from the handler straight to ``WholeAttention`` with the memoised plan (the general entry is
    not called again), with the general path's bits; it steps aside for a mask, a sharded ring (P = 3), a
    layout the general path would move, and under a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from physicsnemo_dp.attention import sdpa as sdpa_module

    from ..core._util import make_spec, shard_from_global

    mesh, sdpa = ctx.mesh, F.scaled_dot_product_attention
    general, entered = sdpa_module.scaled_dot_product_attention, []
    sdpa_module.scaled_dot_product_attention = lambda *a, **k: entered.append(1) or general(*a, **k)

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(layout, fast, mask=None, mode=False, **options):
        """(out, dq, dk, dv) locals and whether the general entry ran, the fast path on or off."""
        xs = [shard_from_global(t, make_spec(mesh, p, tuple(t.shape), salt=i), requires_grad=True)
              for i, (t, p) in enumerate(zip(_qkv(L=7, S=7, E=4, Ev=4), layout))]  # fmt: skip
        found = sdpa_module._whole_plan
        sdpa_module._whole_plan = found if fast else (lambda *a: None)
        sdpa_module._WHOLE.clear()
        try:
            fn = (lambda: sdpa(*xs, **options)) if mask is None else (lambda: sdpa(*xs, attn_mask=mask, **options))
            fn()  # the first call decides (and fills the memo)
            entered.clear()
            if mode:
                with _Seen():
                    out = fn()
            else:
                out = fn()
            out.backward(out.detach() * 0 + 1)
        finally:
            sdpa_module._whole_plan = found
            sdpa_module._WHOLE.clear()
        return [out._local_tensor] + [x.grad._local_tensor for x in xs], bool(entered)

    try:
        S, R = (Shard(2),), (Replicate(),)
        for options in ({}, {"is_causal": True}, {"scale": 0.3}):
            for layout in ((S, S, S), (S, R, R)):
                bits, general_ran = run(layout, True, **options)
                reference, _ = run(layout, False, **options)
                if mesh.size() == 1 or (layout[1] == R and not options):  # keys whole on the rank: one kernel call
                    assert not general_ran, (layout, options)  # (causal on a query shard: per rank, unchecked)
                elif layout[1] == S:  # a ring of three ranks
                    assert general_ran, (layout, options)
                for a, b in zip(bits, reference):
                    assert torch.equal(a, b), (layout, options)
        # steps aside: a mask, a layout the general path moves first, a dispatch mode
        mask = torch.ones(7, 7, dtype=torch.bool).tril()
        assert run((S, S, S), True, mask=mask)[1]
        assert run((R, S, S), True)[1] or mesh.size() == 1  # queries replicated, keys sharded: moved first
        assert run((S, S, S), True, mode=True)[1]
    finally:
        sdpa_module.scaled_dot_product_attention = general


@distributed(world_sizes=(1, 3), mesh_2d=False, timeout=300)
def test_whole_call_before_promotion(ctx):
    """A repeated whole call with three ShardTensors is served by the hook's step 0 (``before_promotion``:
    ``WholeAttention``'s C++ ``apply`` bound once, no promotion, no handler) with the handler's bits, forward and
    gradients, also on uneven query shards (7 rows over 3 ranks against replicated keys); it steps aside (the
    handler serves the call) under autocast, under a dispatch mode, with a mask, with a plain key tensor (to be
    promoted) and for a ring of three ranks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from physicsnemo_dp.attention import sdpa as sdpa_module

    from ..core._util import make_spec, shard_from_global

    mesh, sdpa = ctx.mesh, F.scaled_dot_product_attention
    direct, fast = sdpa_module._WHOLE_APPLY, []
    sdpa_module._WHOLE_APPLY = lambda *a: fast.append(1) or direct(*a)

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(layout, step0, dtype=torch.float64, plain_key=False, mask=None, mode=None, **options):
        """(out, dq, dk, dv) locals and whether step 0 served the second call; step 0 on or off."""
        tensors = [t.to(dtype) for t in _qkv(L=7, S=7, E=4, Ev=4)]
        xs = [shard_from_global(t, make_spec(mesh, p, tuple(t.shape), dtype=dtype, salt=i), requires_grad=True)
              for i, (t, p) in enumerate(zip(tensors, layout))]  # fmt: skip
        if plain_key:
            xs[1] = tensors[1].clone().requires_grad_(True)
        if mask is not None:
            options["attn_mask"] = mask
        hook = sdpa_module.sdpa_handler.before_promotion
        if not step0:
            sdpa_module.sdpa_handler.before_promotion = lambda *a: NotImplemented
        try:
            sdpa(*xs, **options)  # the first call fills the memo
            fast.clear()
            with mode if mode is not None else torch.autocast("cpu", enabled=False):
                out = sdpa(*xs, **options)
            out.backward(out.detach() * 0 + 1)
        finally:
            sdpa_module.sdpa_handler.before_promotion = hook
        grads = [x.grad._local_tensor if hasattr(x.grad, "_local_tensor") else x.grad for x in xs]
        return [out._local_tensor] + grads, bool(fast)

    try:
        S, Rr = (Shard(2),), (Replicate(),)
        for options in ({}, {"is_causal": True}, {"scale": 0.3}):
            for layout in ((S, S, S), (S, Rr, Rr)):
                bits, served = run(layout, True, **options)
                reference, _ = run(layout, False, **options)
                if mesh.size() == 1 or (layout[1] == Rr and not options):  # keys whole on the rank: one call
                    assert served, (layout, options)
                elif layout[1] == S:  # a ring of three ranks (causal on a query shard: decided per rank)
                    assert not served, (layout, options)
                for a, b in zip(bits, reference):
                    assert torch.equal(a, b), (layout, options)
        # steps aside
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        bits, served = run((S, S, S), True, dtype=torch.float32, mode=autocast)
        with autocast:
            expected = sdpa(*(t.float() for t in _qkv(L=7, S=7, E=4, Ev=4))).dtype
        assert not served and bits[0].dtype == expected, (served, bits[0].dtype)  # autocast's operands, as torch's
        assert not run((S, S, S), True, mode=_Seen())[1]
        assert not run((S, S, S), True, mask=torch.ones(7, 7, dtype=torch.bool).tril())[1]
        assert not run((S, S, S), True, plain_key=True)[1]
    finally:
        sdpa_module._WHOLE_APPLY = direct
