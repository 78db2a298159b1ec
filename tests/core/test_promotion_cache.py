"""Repeated promotion of a plain weight reuses its promoted view, and gradients stay exact.

A model applies the same plain parameters on every call; the promoted view
of a parameter is kept while the parameter is unchanged (same object, version
counter, storage). These tests check the reuse itself and everything it must
not change: gradients over several optimizer steps, gradient accumulation
over several backward passes, a weight used twice in one step, in-place
updates and ``.data`` swaps, ``no_grad``, and intermediate (non-leaf) tensors,
each against the same computation on the full tensors in one process.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_dp.promotion import promote
from tests._harness import distributed

from ._util import integer_tensor, make_spec, shard_from_global


def _x(ctx, rows=9, cols=4):
    X = integer_tensor((rows, cols), seed=1)
    spec = make_spec(ctx.mesh, (Shard(0),) * ctx.mesh.ndim if ctx.mesh.ndim == 1 else (Shard(0), Shard(1)), X.shape)
    return X, shard_from_global(X, spec)


@distributed
def test_training_steps_match_one_process(ctx):
    X, x = _x(ctx)
    W0 = integer_tensor((3, 4), seed=2)
    w, ref = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    opt, ref_opt = torch.optim.SGD([w], lr=0.25), torch.optim.SGD([ref], lr=0.25)
    for step in range(3):
        y = F.linear(x, w) + (x @ w.t()) * 0.5  # the weight twice in one step
        assert promote(w, ctx.mesh) is promote(w, ctx.mesh)  # kept while unchanged
        (y * y).sum().backward()
        r = F.linear(X, ref) + (X @ ref.t()) * 0.5
        (r * r).sum().backward()
        assert type(w.grad) is torch.Tensor
        assert torch.allclose(w.grad, ref.grad), step
        before = promote(w, ctx.mesh)
        opt.step(), ref_opt.step()
        assert promote(w, ctx.mesh) is not before  # the step bumped the version: promoted afresh
        opt.zero_grad(), ref_opt.zero_grad()
    assert torch.allclose(w, ref)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_gradient_accumulation_over_backward_passes(ctx):
    X, x = _x(ctx)
    W0 = integer_tensor((3, 4), seed=3)
    w, ref = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    for k in range(3):  # three micro-batches, one promoted view, three backward passes through it
        F.linear(x * (k + 1), w).pow(2).sum().backward()
        F.linear(X * (k + 1), ref).pow(2).sum().backward()
    assert torch.allclose(w.grad, ref.grad)


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_in_place_updates_and_data_swaps_are_seen(ctx):
    X, x = _x(ctx)
    w = torch.nn.Parameter(integer_tensor((3, 4), seed=4))
    F.linear(x, w)
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(F.linear(x, w).full_tensor(), F.linear(X, w.detach()))
    w.data = integer_tensor((3, 4), seed=5)
    assert torch.equal(F.linear(x, w).full_tensor(), F.linear(X, w.detach()))


@distributed(world_sizes=(2,), mesh_2d=False)
def test_no_grad_and_intermediate_tensors_are_not_kept(ctx):
    w = torch.nn.Parameter(integer_tensor((3, 4), seed=6))
    with torch.no_grad():
        p = promote(w, ctx.mesh)
    assert p.grad_fn is None and not p.requires_grad
    h = w * 2  # an intermediate result: keeping its view would keep its graph alive
    assert promote(h, ctx.mesh) is not promote(h, ctx.mesh)
    assert promote(w, ctx.mesh).grad_fn is not None
