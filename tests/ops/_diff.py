"""Differential testing: a sharded op against the same op on the full tensor.

``check(fn, inputs, ...)`` runs ``fn`` twice on every rank: once on plain
global tensors (the single-process reference) and once on ShardTensors cut
from them with the requested layouts (uneven shard sizes, empty shards). It
compares the forward output, the gradients of every input and of every
parameter of ``module`` (if given). The backward is driven by a gradient in
the output's own layout, so the op's backward sees exactly what a following
sharded op would send it.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from physicsnemo_dp import ShardTensor
from physicsnemo_dp.collectives import mesh_device

from ..core._util import box, make_spec, on_mesh_device, shard_from_global

#: World sizes of the op-family and spatial-op tests besides the 2x2 mesh (``@distributed``'s default adds 4).
#: 3 ranks make uneven and empty shards; the 2x2 mesh has 4 ranks and the 2-D placements.
#: A 4-way split of one dim adds little to those here (4 ranks ran 23 % of these tests'
#: time): the property tests (``tests/properties``) draw 1-D meshes of 1-4 ranks for every family.
OP_WORLD_SIZES = (1, 3)

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
TOL.update({torch.complex128: TOL[torch.float64], torch.complex64: TOL[torch.float32]})


def _differentiable(t) -> bool:
    return t.is_floating_point() or t.is_complex()


def layouts(mesh, ndim: int, dims=None, partial: bool = False):
    """Placements to try for an ``ndim``-d input: each shardable dim, and Replicate.

    On a 2-D mesh: pairs of (placement over mesh dim 0, over mesh dim 1), a
    covering set of about ``n`` rather than all ``n**2``: every option next to
    its neighbour in ``options`` (two dims sharded over different mesh dims;
    sharded with replicated or pending over the other), so every option
    appears once on each mesh dim; plus the first dim sharded over both mesh
    dims (nested sharding) and, with ``partial``, Partial on both. The full
    product is drawn at random by the property tests (``tests/properties``),
    which pick any placement per mesh dim; enumerating it here quadrupled the
    2x2 runs, and a set of ``2 n`` (every option nested) still made the 2x2
    mesh a fifth of the suite's time.
    """
    dims = list(range(ndim)) if dims is None else [d % ndim for d in dims]
    options = [Shard(d) for d in dims] + [Replicate()] + ([Partial()] if partial else [])
    if mesh.ndim == 1:
        return [(p,) for p in options]
    pairs = [(p, options[(i + 1) % len(options)]) for i, p in enumerate(options)]
    pairs += [(options[0], options[0])] + ([(Partial(), Partial())] if partial else [])
    both_replicated = (Replicate(), Replicate())
    return [pair for pair in dict.fromkeys(pairs) if pair != both_replicated] + [both_replicated]


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _assert_close(actual, expected, what, dtype):
    tol = TOL.get(dtype, dict(rtol=1e-3, atol=1e-3))
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if not torch.allclose(actual, expected, equal_nan=True, **tol):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3e}")


def _comparable(o, r):
    """``(actual, expected)``: what to compare of a result ``o`` with the reference ``r``.

    A ShardTensor without a pending sum is compared where it lives: its local
    tensor with the reference's box for this rank, after its global and
    local shapes. Gathering every output and gradient to every rank instead
    took a third of the op tests' time: with 4 ranks on 2 cores each
    collective is a wait for the slowest rank (even one 8-byte all-gather per
    call cost as much again). That the ranks agree on one layout, so that
    their boxes tile the tensor, is what the property tests check, through
    ``full_tensor`` (``tests/properties/_runner.py``), and the core tests of
    specs. With a pending sum the full tensor is compared.
    """
    if not isinstance(o, ShardTensor):
        return o, r
    if o._spec.has_partial:
        return o.full_tensor(), r
    assert tuple(o.shape) == tuple(r.shape), f"global shape {tuple(o.shape)} != expected {tuple(r.shape)}"
    local = o.to_local()
    assert tuple(local.shape) == tuple(o._spec.local_shape), f"local shape {tuple(local.shape)} != spec's {tuple(o._spec.local_shape)}"
    return local, r[box(o._spec)]


def check(fn, inputs, mesh, *, module=None, kind="uneven", grad=True, label="", salt=0):
    """Compare ``fn`` on ShardTensors with ``fn`` on the full tensors.

    Args:
        fn: ``fn(*tensors)`` or, with ``module``, ``fn(module, *tensors)``.
        inputs: list of ``(global_tensor, placements or None)``; ``None`` keeps
            the input a plain tensor (it gets promoted when it meets a ShardTensor).
        module: optional ``nn.Module``; its reference copy runs on the full
            tensors and its parameter gradients are compared.
        kind: ``"uneven"`` (deliberately uneven sizes with empty shards) or ``"chunk"``.
    Returns the sharded output (for further checks).
    """
    inputs = [(on_mesh_device(g, mesh), p) for g, p in inputs]  # ctx.device: CUDA under PDP_TEST_DEVICE=cuda
    if module is not None:
        module.to(mesh_device(mesh))
        module.zero_grad(set_to_none=True)  # deepcopy does not copy .grad: start both from zero
    ref_module = copy.deepcopy(module) if module is not None else None
    dtype = inputs[0][0].dtype
    ref_inputs = [g.detach().clone().requires_grad_(grad and _differentiable(g)) for g, _ in inputs]
    sharded = []
    for i, (g, placements) in enumerate(inputs):
        if placements is None:
            sharded.append(g.detach().clone().requires_grad_(grad and _differentiable(g)))
        else:
            spec = make_spec(mesh, placements, tuple(g.shape), kind, dtype=g.dtype, salt=salt + i)
            sharded.append(shard_from_global(g, spec, requires_grad=grad and _differentiable(g)))
    ref_out = fn(ref_module, *ref_inputs) if module is not None else fn(*ref_inputs)
    out = fn(module, *sharded) if module is not None else fn(*sharded)
    where = f"{label} inputs={[p for _, p in inputs]}"
    ref_list, out_list = _tensors(ref_out), _tensors(out)
    assert len(ref_list) == len(out_list), where
    for k, (o, r) in enumerate(zip(out_list, ref_list)):
        actual, expected = _comparable(o, r)
        if _differentiable(r):
            _assert_close(actual.detach(), expected.detach(), f"{where} output {k}", dtype)
        else:
            assert torch.equal(actual, expected), f"{where} output {k}: {actual} != {expected}"
    if not grad:
        return out
    gen = torch.Generator().manual_seed(1234)
    pairs = [(o, r) for o, r in zip(out_list, ref_list) if r.requires_grad]
    if not pairs:
        return out
    grads_ref, grads_out, outs, refs = [], [], [], []
    for o, r in pairs:
        w = torch.randint(-4, 5, tuple(r.shape), generator=gen).to(r.dtype)
        if r.is_complex():  # an imaginary part too: a real cotangent would miss sign errors of conjugation
            w = w + 1j * torch.randint(-4, 5, tuple(r.shape), generator=gen).to(r.dtype)
        w = w.to(r.device)
        refs.append(r)
        grads_ref.append(w)
        outs.append(o)
        if isinstance(o, ShardTensor):
            spec = o._spec
            gspec = spec.with_layout(
                tuple(Replicate() if p.is_partial() else p for p in spec.placements), spec.dim_sizes
            )
            grads_out.append(shard_from_global(w, gspec))
        else:
            grads_out.append(w)
    torch.autograd.backward(refs, grads_ref)
    torch.autograd.backward(outs, grads_out)
    for i, (s, r) in enumerate(zip(sharded, ref_inputs)):
        if r.grad is None:
            continue
        g = s.grad
        assert g is not None, f"{where}: input {i} got no gradient"
        _assert_close(*_comparable(g, r.grad), f"{where} grad of input {i}", dtype)
    if module is not None:
        for (name, p), (_, rp) in zip(module.named_parameters(), ref_module.named_parameters()):
            if rp.grad is None:
                continue
            assert p.grad is not None, f"{where}: parameter {name} got no gradient"
            assert not isinstance(p.grad, ShardTensor), f"{where}: parameter {name} grad is a ShardTensor"
            _assert_close(p.grad, rp.grad, f"{where} grad of parameter {name}", dtype)
    return out
