"""Compiled against eager: same sharded inputs, same outputs, gradients and layouts.

``compare(fn, inputs, mesh, backend=...)`` cuts ShardTensors from global
tensors (deliberately uneven shards, empty ones included), runs ``fn`` eagerly
and under ``torch.compile`` (``fullgraph=True`` by default: any graph break is
an error) on fresh copies of the same inputs and of ``module``, drives both
backwards with the same output gradient, and compares the forward outputs
(values *and* layouts), the gradients of every input and of every module
parameter, and the module buffers (running statistics). A compile counter
proves that a graph was really compiled.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate

from physicsnemo_dp import ShardTensor
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ..ops._diff import _assert_close, _tensors

BACKENDS = ("aot_eager", "inductor")

#: Where each backend runs. A cold Inductor compile costs 10-120 s per case on
#: a 2-core machine, so the default run (CI) compiles with Inductor on 3 ranks
#: (uneven shards, an empty one) and with aot_eager on 3 ranks and the 2x2
#: mesh. ``PDP_COMPILE_MATRIX=full`` adds aot_eager on 1 rank and Inductor on
#: the 2x2 mesh: the measured matrix in docs/compile.md.
FULL = os.environ.get("PDP_COMPILE_MATRIX") == "full"


def meshes_for(backend: str):
    """The ``@distributed`` decorator of a test compiling with ``backend``: where it may run at all."""
    world_sizes = (1, 3) if backend == "aot_eager" else (3,)
    return distributed(world_sizes=world_sizes, mesh_2d=True, timeout=1200)


def skip_unless_in_scope(ctx, backend: str, inductor_by_default: bool = True) -> None:
    """Skip this (mesh, backend) cell unless the current scope (default or full) includes it.

    ``inductor_by_default=False``: the cell's Inductor run adds a cold compile
    (10-25 s here) for little the default run lacks. Inductor compiles the
    plain-tensor graph AOTAutograd made from our rules, which the aot_eager
    run of the same cell checks; what Inductor adds is code generation and
    scheduling, and the scheduling risk (collectives issued in another order
    on another rank) is what the default Inductor cells exercise: the matrix's
    CNN (halos), the regional ring block (weight-gradient reductions; it caught
    such a reordering), the per-rank graph cache and the lopsided collective.
    It runs in the full scope.
    """
    if not FULL and (ctx.world_size == 1 or (backend == "inductor" and ctx.mesh.ndim == 2)):
        pytest.skip(f"{backend} on this mesh runs with PDP_COMPILE_MATRIX=full only")
    if not FULL and backend == "inductor" and not inductor_by_default:
        pytest.skip("this cell under inductor runs with PDP_COMPILE_MATRIX=full only (aot_eager runs it by default)")


def make_inputs(inputs, mesh, kind="uneven"):
    """Leaf tensors for ``[(global tensor, placements or None), ...]`` (None: a plain tensor)."""
    out = []
    for i, (g, placements) in enumerate(inputs):
        grad = g.is_floating_point()
        if placements is None:
            out.append(g.detach().clone().requires_grad_(grad))
        else:
            spec = make_spec(mesh, placements, tuple(g.shape), kind, dtype=g.dtype, salt=i)
            out.append(shard_from_global(g, spec, requires_grad=grad))
    return out


def _out_grad(o, seed):
    """An integer-valued gradient for output ``o`` in its layout (Partial read as Replicate)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-4, 5, tuple(o.shape), generator=gen).to(o.dtype)
    if not isinstance(o, ShardTensor):
        return w
    spec = o._spec
    gspec = spec.with_layout(tuple(Replicate() if p.is_partial() else p for p in spec.placements), spec.dim_sizes)
    return shard_from_global(w, gspec)


def run(fn, module, xs, grad=True):
    """Outputs of ``fn`` (flattened), after a backward driven by fixed output gradients."""
    out = fn(module, *xs) if module is not None else fn(*xs)
    outs = _tensors(out)
    if grad:
        pairs = [(o, _out_grad(o, 100 + k)) for k, o in enumerate(outs) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return outs


def _full(t):
    return t.full_tensor() if isinstance(t, ShardTensor) else t


def assert_same(where, dtype, outs, eager, xs=(), eager_xs=(), module=None, eager_module=None):
    """Outputs (values and layouts), input gradients, parameter gradients and buffers agree."""
    assert len(outs) == len(eager), where
    for k, (o, e) in enumerate(zip(outs, eager)):
        assert type(o) is type(e), f"{where} output {k}: {type(o).__name__} != {type(e).__name__}"
        if isinstance(o, ShardTensor):
            assert o._spec == e._spec, f"{where} output {k}: layout {o._spec} != eager {e._spec}"
        _assert_close(_full(o).detach(), _full(e).detach(), f"{where} output {k}", dtype)
    for i, (x, ex) in enumerate(zip(xs, eager_xs)):
        if ex.grad is None:
            assert x.grad is None, f"{where}: input {i} got a gradient only when compiled"
            continue
        assert x.grad is not None, f"{where}: input {i} got no gradient when compiled"
        _assert_close(_full(x.grad), _full(ex.grad), f"{where} grad of input {i}", dtype)
    if module is None:
        return
    for (name, p), (_, ep) in zip(module.named_parameters(), eager_module.named_parameters()):
        if ep.grad is None:
            continue
        assert p.grad is not None, f"{where}: parameter {name} got no gradient when compiled"
        assert not isinstance(p.grad, ShardTensor), f"{where}: parameter {name} grad is a ShardTensor"
        _assert_close(p.grad, ep.grad, f"{where} grad of parameter {name}", dtype)
    for (name, b), (_, eb) in zip(module.named_buffers(), eager_module.named_buffers()):
        _assert_close(b.double(), eb.double(), f"{where} buffer {name}", dtype)


def compare(fn, inputs, mesh, *, backend, module=None, grad=True, kind="uneven", label="", fullgraph=True):
    """Assert that ``torch.compile(fn, backend=backend, fullgraph=fullgraph)`` matches eager ``fn``.

    Args:
        fn: ``fn(*tensors)`` or, with ``module``, ``fn(module, *tensors)``.
        inputs: list of ``(global_tensor, placements or None)``; ``None`` keeps
            the input plain (it is promoted when it meets a ShardTensor).
    Returns the compile counter (``frame_count`` graphs were compiled).
    """
    from torch._dynamo.testing import CompileCounterWithBackend

    where = f"{label} [{backend}] inputs={[p for _, p in inputs]}"
    eager_module = copy.deepcopy(module)
    eager_xs = make_inputs(inputs, mesh, kind)
    eager = run(fn, eager_module, eager_xs, grad)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled_module = copy.deepcopy(module)
    xs = make_inputs(inputs, mesh, kind)
    outs = run(torch.compile(fn, backend=counter, fullgraph=fullgraph), compiled_module, xs, grad)
    torch._dynamo.reset()
    assert counter.frame_count >= 1, f"{where}: nothing was compiled"
    assert_same(where, inputs[0][0].dtype, outs, eager, xs if grad else (), eager_xs, compiled_module, eager_module)
    return counter
