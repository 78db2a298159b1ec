"""Contractions on uneven shards: mm-family, matmul, linear, einsum; free and contracted dims sharded."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

aten = torch.ops.aten


def _g(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pairs(mesh, a_ndim, b_ndim):
    """Layout pairs: each side sharded alone, both sharded (alike or not), a plain operand."""
    la, lb = layouts(mesh, a_ndim), layouts(mesh, b_ndim)
    rep = la[-1]
    pairs = [(p, None) for p in la] + [(rep, p) for p in lb[:-1]] + [(None, p) for p in lb[:-1]]
    pairs += [(p, q) for p in la[:-1] for q in lb[:-1]][:: max(1, len(la) - 2)]
    return pairs


@distributed(world_sizes=OP_WORLD_SIZES)
def test_mm_bmm_mv_dot(ctx):
    cases = [
        ("mm", torch.mm, (7, 5), (5, 3)),
        ("mm-method", lambda a, b: a.mm(b), (7, 5), (5, 3)),
        ("bmm", torch.bmm, (3, 7, 5), (3, 5, 2)),
        ("mv", torch.mv, (7, 5), (5,)),
        ("dot", torch.dot, (7,), (7,)),
    ]
    for name, fn, sa, sb in cases:
        for pa, pb in _pairs(ctx.mesh, len(sa), len(sb)):
            check(fn, [(_g(sa, 1), pa), (_g(sb, 2), pb)], ctx.mesh, label=name)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_matmul_any_batch_dims(ctx):
    cases = [
        ((7, 5), (5, 3)),
        ((2, 7, 5), (5, 3)),  # batch on one side only
        ((5,), (2, 5, 3)),  # 1-D left
        ((2, 7, 5), (5,)),  # 1-D right
        ((2, 1, 4, 5), (3, 5, 2)),  # broadcast batch dims
    ]
    for sa, sb in cases:
        for pa, pb in _pairs(ctx.mesh, len(sa), len(sb)):
            for fn in (torch.matmul, lambda a, b: a @ b):
                check(fn, [(_g(sa, 3), pa), (_g(sb, 4), pb)], ctx.mesh, label=f"matmul {sa}@{sb}")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_addmm_baddbmm_addmv(ctx):
    cases = [
        ("addmm", torch.addmm, (3,), (7, 5), (5, 3)),
        ("addmm-2d-bias", torch.addmm, (7, 1), (7, 5), (5, 3)),
        ("baddbmm", torch.baddbmm, (3, 7, 2), (3, 7, 5), (3, 5, 2)),
        ("addmv", torch.addmv, (7,), (7, 5), (5,)),
    ]
    for name, fn, sc, sa, sb in cases:
        for pa, pb in _pairs(ctx.mesh, len(sa), len(sb)):
            for pc, beta, alpha in ((None, 1, 1), (layouts(ctx.mesh, len(sc))[0], 0.5, -2.0)):
                check(
                    lambda c, a, b: fn(c, a, b, beta=beta, alpha=alpha),
                    [(_g(sc, 5), pc), (_g(sa, 6), pa), (_g(sb, 7), pb)],
                    ctx.mesh,
                    label=f"{name} beta={beta}",
                )


@distributed(world_sizes=OP_WORLD_SIZES)
def test_linear_on_nd_inputs_any_dim_sharded(ctx):
    """(B, N, C) inputs with B > 1, sharded on any dim including the token dim N."""
    torch.manual_seed(0)
    for bias in (True, False):
        layer = torch.nn.Linear(4, 3, bias=bias).double()
        for placements in layouts(ctx.mesh, 3):
            check(lambda m, x: m(x), [(_g((3, 7, 4), 8), placements)], ctx.mesh, module=layer, label=f"Linear bias={bias}")
            layer.zero_grad(set_to_none=True)
    w, b = _g((3, 4), 9), _g((3,), 10)
    for placements in layouts(ctx.mesh, 2):
        check(F.linear, [(_g((7, 4), 11), placements), (w, None), (b, None)], ctx.mesh, label="F.linear 2-D")
        check(lambda x, w: F.linear(x, w), [(_g((7, 4), 11), placements), (_g((4,), 12), None)], ctx.mesh, label="1-D weight")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_einsum(ctx):
    cases = [
        ("bij,bjk->bik", (3, 7, 5), (3, 5, 2)),
        ("ij,kj->ik", (7, 5), (4, 5)),
        ("bnc,c->bn", (3, 7, 4), (4,)),
        ("...ij,jk", (2, 7, 5), (5, 3)),
        ("ij,ij->", (7, 5), (7, 5)),
        ("i,j->ij", (7,), (5,)),
        ("ij->j", (7, 5), None),
        ("bhnd, bhmd -> bhnm", (2, 3, 5, 4), (2, 3, 6, 4)),
    ]
    for eq, sa, sb in cases:
        for pa, pb in _pairs(ctx.mesh, len(sa), len(sb or (1,))):
            if sb is None:
                check(lambda a: torch.einsum(eq, a), [(_g(sa, 13), pa or layouts(ctx.mesh, len(sa))[-1])], ctx.mesh, label=eq)
            else:
                check(lambda a, b: torch.einsum(eq, a, b), [(_g(sa, 13), pa), (_g(sb, 14), pb)], ctx.mesh, label=eq)
    # list form and three operands
    for p in layouts(ctx.mesh, 2):
        check(
            lambda a, b, c: torch.einsum("ij,jk,kl->il", [a, b, c]),
            [(_g((7, 5), 15), p), (_g((5, 4), 16), p), (_g((4, 3), 17), None)],
            ctx.mesh,
            label="einsum 3 operands",
        )


@distributed(world_sizes=OP_WORLD_SIZES)
def test_sharded_contraction_dim_gives_partial_without_communication(ctx):
    mesh = ctx.mesh
    A, B = _g((7, 5), 1), _g((5, 3), 2)
    pa, pb = (Shard(1),) * mesh.ndim, (Shard(0),) * mesh.ndim
    a = shard_from_global(A, make_spec(mesh, pa, A.shape))  # dim 1 sizes: uneven_table(5, n, salt=1)
    b_alike = shard_from_global(B, make_spec(mesh, pb, B.shape, salt=1))  # dim 0 sizes: the same table
    b_chunked = shard_from_global(B, make_spec(mesh, pb, B.shape, kind="chunk"))
    for b in (B, b_alike):  # a replicated operand is only sliced
        with count_collectives() as c:
            y = a @ b
        assert c.total_calls == 0
        assert all(p == Partial() for p in y.placements)
        assert torch.allclose(y.full_tensor(), A @ B)
    y = a @ b_chunked  # shards of other sizes: the smaller operand is redistributed
    assert all(p == Partial() for p in y.placements)
    assert torch.allclose(y.full_tensor(), A @ B)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_partial_operand_stays_pending(ctx):
    mesh = ctx.mesh
    for name, fn, sa, sb in (("mm", torch.mm, (7, 5), (5, 3)), ("linear", F.linear, (3, 7, 4), (2, 4))):
        A, W = _g(sa, 1), _g(sb, 2)
        a = shard_from_global(A, make_spec(mesh, (Partial(),) * mesh.ndim, sa))
        with count_collectives() as c:
            y = fn(a, W)
        assert c.total_calls == 0, name
        assert all(p.is_partial() for p in y.placements), name
        assert torch.allclose(y.full_tensor(), fn(A, W)), name
        for placements in layouts(mesh, len(sa), partial=True):
            check(fn, [(A, placements), (W, None)], mesh, label=f"{name} partial")


@distributed(world_sizes=OP_WORLD_SIZES)
def test_linear_issues_no_forward_communication(ctx):
    mesh = ctx.mesh
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3).double()
    for placements in layouts(mesh, 3, dims=(0, 1)):
        x = shard_from_global(_g((3, 7, 4)), make_spec(mesh, placements, (3, 7, 4)), requires_grad=True)
        with count_collectives() as fwd:
            y = layer(x)
        assert fwd.total_calls == 0, placements
        assert y._spec.dim_sizes[:2] == x._spec.dim_sizes[:2]
        with count_collectives() as bwd:
            y.backward(torch.ones_like(y))
        assert set(bwd.calls) <= {"all_reduce"}, bwd.summary()
        # one all-reduce per mesh dim that shards the input: the weight and bias gradients together
        # (on one rank, where nothing is summed, one no-op call per parameter)
        sharded_mesh_dims = sum(p.is_shard() for p in placements)
        assert bwd.total_calls == (1 if mesh.size() > 1 else 2) * sharded_mesh_dims, bwd.summary()
        layer.zero_grad()


@distributed(world_sizes=OP_WORLD_SIZES)
def test_dispatch_level_rules(ctx):
    """The ATen ops themselves (reached below autograd, e.g. from other ops' formulas)."""
    mesh = ctx.mesh
    cases = [
        (aten.mm.default, (_g((7, 5), 1), _g((5, 3), 2)), {}),
        (aten.bmm.default, (_g((3, 7, 5), 1), _g((3, 5, 2), 2)), {}),
        (aten.mv.default, (_g((7, 5), 1), _g((5,), 2)), {}),
        (aten.dot.default, (_g((7,), 1), _g((7,), 2)), {}),
        (aten.addmm.default, (_g((3,), 0), _g((7, 5), 1), _g((5, 3), 2)), dict(beta=0.5, alpha=2.0)),
        (aten.baddbmm.default, (_g((3, 7, 2), 0), _g((3, 7, 5), 1), _g((3, 5, 2), 2)), {}),
        (aten.addmv.default, (_g((7,), 0), _g((7, 5), 1), _g((5,), 2)), dict(beta=2)),
    ]
    for op, tensors, kwargs in cases:
        expected = op(*tensors, **kwargs)
        for placements in layouts(mesh, tensors[-2].ndim):
            args = list(tensors)
            args[-2] = shard_from_global(tensors[-2], make_spec(mesh, placements, tensors[-2].shape))
            args[-1] = shard_from_global(tensors[-1], make_spec(mesh, layouts(mesh, tensors[-1].ndim)[-1], tensors[-1].shape))
            out = op(*args, **kwargs)
            assert torch.allclose(out.full_tensor(), expected), (op, placements)


@distributed(world_sizes=OP_WORLD_SIZES)
def test_bad_shapes_raise_on_every_rank(ctx):
    mesh = ctx.mesh
    a = shard_from_global(_g((7, 5)), make_spec(mesh, layouts(mesh, 2)[0], (7, 5)))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(a, _g((4, 3)))
    with pytest.raises(RuntimeError, match="expected 3-D"):
        torch.bmm(a, _g((5, 3)))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        F.linear(a, _g((3, 4)))
    with pytest.raises(NotImplementedError, match="diagonal"):
        torch.einsum("ii->i", shard_from_global(_g((5, 5)), make_spec(mesh, layouts(mesh, 2)[0], (5, 5))))


@distributed(world_sizes=OP_WORLD_SIZES)
def test_linear_with_sharded_features_gathers_the_weight_gradient_not_the_input(ctx):
    """Contracted dim sharded: forward gives a pending sum without communication; in backward
    the weight gradient comes out sharded like the input's features and only it is gathered."""
    mesh = ctx.mesh
    X, W = _g((20, 6), 1), _g((3, 6), 2)
    placements = (Shard(1),) * mesh.ndim  # the contracted dim sharded over every mesh dim
    x = shard_from_global(X, make_spec(mesh, placements, X.shape), requires_grad=True)
    w = W.clone().requires_grad_(True)
    with count_collectives() as fwd:
        y = F.linear(x, w)
    assert fwd.total_calls == 0 and all(p.is_partial() for p in y.placements)
    G = _g((20, 3), 3)
    grad = shard_from_global(G, make_spec(mesh, (Replicate(),) * mesh.ndim, G.shape))  # gradient of a pending sum
    with count_collectives() as bwd:
        torch.autograd.backward([y], [grad])
    assert set(bwd.calls) <= {"all_gather"}, bwd.summary()
    assert bwd.total_received <= W.numel() * 8, bwd.summary()
    Xr, Wr = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
    F.linear(Xr, Wr).backward(G)
    assert torch.allclose(x.grad.full_tensor(), Xr.grad) and torch.allclose(w.grad, Wr.grad)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_an_operand_is_saved_only_for_the_other_operands_gradient(ctx):
    """As torch's mm, a contraction keeps an operand for backward only if another operand needs a gradient:
    activations times a frozen weight keep no activation, data without grad times a weight keep no weight."""
    mesh = ctx.mesh
    X, W, G = _g((9, 4), 1), _g((3, 4), 2), _g((9, 3), 3)
    spec = make_spec(mesh, (Shard(0),), X.shape)
    g = shard_from_global(G, make_spec(mesh, (Shard(0),), G.shape))
    Xr, Wr = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
    F.linear(Xr, Wr).backward(G)

    x = shard_from_global(X, spec, requires_grad=True)
    y = F.linear(x, W)  # a frozen weight
    saved = y.grad_fn.saved_tensors
    assert saved[0] is None and torch.equal(saved[1].full_tensor(), W)
    y.backward(g)
    assert torch.allclose(x.grad.full_tensor(), Xr.grad)

    w = torch.nn.Parameter(W.clone())
    y = F.linear(shard_from_global(X, spec), w)  # data without grad
    saved = y.grad_fn.saved_tensors
    assert saved[1] is None and torch.equal(saved[0].full_tensor(), X)
    with count_collectives() as bwd:
        y.backward(g)
    assert bwd.total_calls == 1 and set(bwd.calls) == {"all_reduce"}, bwd.summary()  # the weight's, once
    assert type(w.grad) is torch.Tensor and torch.allclose(w.grad, Wr.grad)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_backward_plans_are_kept_per_gradient_layout(ctx):
    """A contraction's backward plans its gradients once per forward plan and output-gradient layout: an upstream
    gradient in another layout (replicated, or a pending sum) gets its own plans and the right gradients; the same
    layout again plans nothing new."""
    from physicsnemo_dp.rules.matmul import contract

    mesh = ctx.mesh
    X, W, B, G = _g((9, 4), 1), _g((3, 4), 2), _g((3,), 3), _g((9, 3), 4)
    Xr, Wr, Br = (t.clone().requires_grad_(True) for t in (X, W, B))
    F.linear(Xr, Wr, Br).backward(G)
    spec = make_spec(mesh, (Shard(0),), X.shape)
    w, b = torch.nn.Parameter(W.clone()), torch.nn.Parameter(B.clone())
    grads = [shard_from_global(G, make_spec(mesh, (p,), G.shape)) for p in (Shard(0), Replicate(), Partial())]
    contract._GRADS.clear()
    counts = []
    for g in grads + grads:
        x = shard_from_global(X, spec, requires_grad=True)
        w.grad = b.grad = None
        F.linear(x, w, b).backward(g)
        assert torch.allclose(x.grad.full_tensor(), Xr.grad), g._spec.placements
        assert torch.allclose(w.grad, Wr.grad) and torch.allclose(b.grad, Br.grad), g._spec.placements
        counts.append(len(contract._GRADS))
    assert counts == [1, 2, 3, 3, 3, 3], counts


def test_local_kernels_are_the_plain_calls():
    """``linear`` runs ``F.linear`` on the local pieces and a 2-D ``matmul`` runs ``mm``: the plain call's bits."""
    from physicsnemo_dp.rules.matmul import linear_equation, matmul_equation
    from physicsnemo_dp.rules.matmul.local import local_program

    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((3, 7, 4), (5, 4), (5,)))
    eq = linear_equation(tuple(x.shape), tuple(w.shape))
    program = local_program(eq, (tuple(x.shape), tuple(w.shape)), (3, 7, 5), 1)
    assert program.kernel.form == "linear"
    assert torch.equal(program.run([x, w], None), F.linear(x, w))
    assert torch.equal(program.run([x, w], None, b), F.linear(x, w, b))
    assert torch.allclose(program.run([x, w], None, b, beta=0.5), F.linear(x, w) + 0.5 * b)  # scaled: the general path
    a, m = torch.randn(7, 4, generator=gen), torch.randn(4, 5, generator=gen)
    program = local_program(matmul_equation("matmul", (7, 4), (4, 5)), ((7, 4), (4, 5)), (7, 5))
    assert program.kernel.form == "mm" and torch.equal(program.run([a, m], None), a @ m)
    bmm = local_program(matmul_equation("matmul", (2, 7, 4), (2, 4, 5)), ((2, 7, 4), (2, 4, 5)), (2, 7, 5))
    assert bmm.kernel.form == ""


@distributed(world_sizes=OP_WORLD_SIZES)
def test_contraction_of_a_few_modes_saves_them_not_the_spectrum(ctx):
    """An FNO layer contracts a few modes of a large spectrum: backward keeps copies of those
    modes, not views holding the whole spectrum's storage alive (+20 % peak memory on the FNO)."""
    mesh = ctx.mesh
    G = torch.randn(2, 4, 24, 13, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    x = shard_from_global(G, make_spec(mesh, (Shard(1),) * mesh.ndim, G.shape, dtype=G.dtype))
    w = torch.randn(4, 4, 3, 3, dtype=torch.complex64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(getattr(t, "_local_tensor", t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.einsum("bixy,ioxy->boxy", x[:, :, :3, :3], w)
    assert saved, "the contraction saved nothing for backward"
    for t in saved:
        if t.numel():
            assert t.untyped_storage().nbytes() <= 2 * t.numel() * t.element_size(), (tuple(t.shape), t.untyped_storage().nbytes())
    y.abs().sum().backward()
    Wr = w.detach().clone().requires_grad_(True)
    torch.einsum("bixy,ioxy->boxy", G[:, :, :3, :3], Wr).abs().sum().backward()
    assert torch.allclose(w.grad, Wr.grad, atol=1e-5)
