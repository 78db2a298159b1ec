"""Whole training steps, eager against ``torch.compile`` (Inductor), on ShardTensors and on plain tensors.

A step is what training runs: ``zero_grad``, forward, a loss (the mean square
of the output, so every rank's contribution is reduced as a real loss is),
``backward`` and an SGD ``step``. Four models:

* **U-Net** of ``examples/unet_darcy.py`` (conv blocks, max-pool, bilinear
  upsampling, skips concatenated), sharded along the rows;
* **FNO** of ``examples/spectral_models.py`` (4 Fourier layers: every FFT
  transposes), sharded along the rows;
* **MeshGraphNet** of ``examples/graph_models.py`` on the plate-with-hole mesh
  of :mod:`.graph` (nodes in Hilbert order split in contiguous ranges; every
  processor layer fetches its ghost nodes' latents);
* **transformer block** (pre-norm, 4 heads): sequence-sharded, so its
  attention is ring attention. Compiled *regionally*, as the docs recommend:
  the token-wise parts before and after the attention are compiled
  (``fullgraph=True``), the second with the loss (as the other models compile
  theirs), the ring between them runs eagerly.

Each model runs four ways from the same weights: eager and compiled, on the
plain global input (the single-device baseline) and on this rank's shard. At
P = 1 the transformer block also runs compiled on a tensor subclass that does
nothing (:mod:`._bare_subclass`): torch's own cost for any wrapper subclass at
the regions' boundaries, the floor under ShardTensor's figure.
Compilation happens in the two warm-up steps, which are timed apart (compile
time, reported, never in a step's time). Steps are then timed interleaved
(fastest of ``rounds``, see :mod:`._timing`) by the CPU clock of the whole
process, summed over ranks: the work done (on this 2-core machine the wall
clock mostly measures waiting for a core).

Figures (targets from issue 30):

* P = 1: compiled ShardTensor step / compiled plain step <= 1.05 (and the
  same ratio eager, informative): what the library still costs once compiled;
  for the transformer block also the do-nothing subclass's compiled step /
  compiled plain step (informative: what torch costs any subclass there);
* P >= 2: compiled step / eager step, CPU work of all ranks, <= 1.0;
* graph breaks in a step (counted while it is compiled) and graphs compiled
  per step after warm-up (recompilations), both <= 0; the count is the
  ``ratio`` (baseline 1 and the number of timed steps);
* compile time: the two warm-up steps / one eager step (informative);
* a model whose step does not compile on some rank gets one row instead,
  "step fails to compile" (a count, target 0) with the error's first line.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from physicsnemo_dp.debug import compile_counts

from . import _models, graph
from ._bare_subclass import Bare, BareAttention
from ._record import Result, over_ranks
from ._timing import fastest_by, repeated

SUITE = "compiled"
_STEPS = ("eager plain", "compiled plain", "eager sharded", "compiled sharded")


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        # aot_eager: the library's part of compiling (tracing, AOTAutograd, graph breaks, recompilations)
        # without Inductor's code generation, which takes minutes per graph on a loaded 2-core machine
        return dict(grid=16, width=4, tokens=16, dim=16, around=16, rings=3, layers=2, rounds=1, calls=1,
                    backend="aot_eager")  # fmt: skip
    s = max(scale, 1 / 16) ** 0.5  # graph nodes grow with scale
    return dict(grid=int(64 * scale), width=8, tokens=int(256 * scale), dim=64, around=int(64 * s),
                rings=int(16 * s), layers=4, rounds=15, calls=3, backend="inductor")  # fmt: skip


def _examples():
    folder = str(Path(__file__).resolve().parents[1] / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)


class _QKV(nn.Module):
    """LayerNorm and the query/key/value projection, split into heads: (B, N, C) -> 3 x (B, H, N, C/H)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.proj(self.norm(x)).chunk(3, dim=-1)
        return tuple(t.reshape(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))


class _Out(nn.Module):
    """Heads merged, output projection and residual, then LayerNorm -> MLP -> residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x, attn):
        b, h, n, d = attn.shape
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, h * d))
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Block(nn.Module):
    """A pre-norm transformer block; :meth:`compile_regions` compiles everything but the attention."""

    #: the attention between the regions (an instance may set its own: :class:`._bare_subclass.BareAttention`)
    attend = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, dim: int, heads: int = 4):
        super().__init__()
        self.qkv, self.out = _QKV(dim, heads), _Out(dim)

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(x, F.scaled_dot_product_attention(q, k, v))

    def tail(self, x, attn):
        """The step's last region: the output part and the loss (``_loss(self.out(x, attn))``)."""
        return _loss(self.out(x, attn))

    def step_loss(self, x):
        """``_loss(self(x))``, with the loss in the last region (compiled with it by :meth:`compile_regions`)."""
        return self.tail(x, self.attend(*self.qkv(x)))

    def compile_regions(self, backend: str = "inductor") -> "Block":
        """Everything but the attention compiled, in two regions: before it, and after it with the loss.

        As the whole-model steps compile their loss with the model, the step's
        loss is compiled with the last region (:meth:`step_loss`); the attention
        (ring attention on a sequence-sharded input) runs eagerly between them.
        """
        self.qkv = torch.compile(self.qkv, backend=backend, fullgraph=True)
        self.tail = torch.compile(self.tail, backend=backend, fullgraph=True)
        return self


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def _cases(mesh, grid: int, width: int, tokens: int, dim: int, around: int, rings: int, layers: int) -> dict:
    """name -> (build model, plain inputs, sharded inputs, regional, bare inputs or None): argument tuples."""
    _examples()
    device = _models.mesh_device(mesh)

    def field(rows, cols, channels=1):
        plain = _models.global_input((1, channels, rows, cols)).to(device)
        return (plain,), (_models.shard(plain, mesh, 2),)

    def unet():
        from unet_darcy import UNet

        return UNet(width=width, depth=2)

    def fno():
        from spectral_models import FNO2d

        return FNO2d(width=width, modes=(grid // 4, grid // 4), layers=4)

    plain_x, sharded_x, _ = graph.inputs(mesh, around, rings)
    seq = _models.global_input((1, tokens, dim)).to(device)
    return {
        "unet": (unet, *field(grid, grid), False, None),
        "fno": (fno, *field(grid, grid), False, None),
        "meshgraphnet": (lambda: graph.model(width, layers, device), plain_x, sharded_x, False, None),
        "transformer block": (lambda: Block(dim), (seq,), (_models.shard(seq, mesh, 1),), True,
                              (Bare(seq.clone()),)),
    }


def _trainer(net: nn.Module, backend: str | None, regional: bool) -> Callable:
    """One training step of ``net`` (eager if ``backend`` is None, else compiled whole or regionally)."""
    if backend and regional:
        net.compile_regions(backend)
        forward = net.step_loss  # the attention runs eagerly between the regions, the loss in the last one
    elif backend:
        forward = torch.compile(lambda *args: _loss(net(*args)), backend=backend)
    else:
        forward = lambda *args: _loss(net(*args))  # noqa: E731
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step(args):
        optimizer.zero_grad(set_to_none=True)
        forward(*args).backward()
        optimizer.step()

    return step


def run(mesh, grid: int, width: int, tokens: int, dim: int, around: int, rings: int, layers: int, rounds: int,
        calls: int, backend: str = "inductor", models=("unet", "fno", "meshgraphnet", "transformer block"),
        compare_dtensor: bool = False
        ) -> list[Result]:  # fmt: skip
    P = mesh.size()
    results = []
    for name, (build, plain, sharded, regional, bare) in _cases(
        mesh, grid, width, tokens, dim, around, rings, layers
    ).items():
        if name not in models:
            continue
        torch.compiler.reset()  # each model's graphs from scratch (the step function's code is shared)
        torch.manual_seed(0)
        device = _models.mesh_device(mesh)
        net = build().to(device)
        kinds = _STEPS if P == 1 else _STEPS[2:]  # at P > 1 the figures compare sharded steps with each other
        if P == 1 and bare is not None and device.type == "cpu":  # BareAttention runs the CPU kernel
            kinds += ("compiled bare",)
        inputs = {"plain": plain, "sharded": sharded, "bare": bare}
        steps, compile_seconds, counts, failure = {}, {}, {}, None
        for kind in kinds:
            eager, on = kind.split()
            args = inputs[on]
            model = copy.deepcopy(net)
            if on == "bare":
                model.attend = BareAttention.apply
            step = _trainer(model, backend if eager == "compiled" else None, regional)
            before, start = compile_counts(), time.perf_counter()
            try:
                step(args)
                step(args)  # a second call: a graph whose guards fail on it is recompiled here, not while timed
            except Exception as error:  # a backend that cannot compile the model (the same on every rank)
                failure = f"{kind}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
                break
            compile_seconds[kind] = time.perf_counter() - start
            counts[kind] = {k: v - before[k] for k, v in compile_counts().items()}
            steps[kind] = repeated(lambda step=step, args=args: step(args), calls)
        if over_ranks(failure is not None, "max"):  # reported, never dropped: ranks' output is not shown
            results.append(Result(SUITE, f"{name}: step fails to compile with {backend} ({(failure or '')[:120]})",
                                  P, 1, 1, "count", ("<=", 0)))  # fmt: skip
            continue
        before = compile_counts()
        best = fastest_by(steps, rounds, [time.process_time])
        recompiled = compile_counts()["graphs"] - before["graphs"]
        cpu = {kind: over_ranks(b[0]) / calls for kind, b in best.items()}
        title = f"{name}{', regional' if regional else ''}{'' if backend == 'inductor' else f' [{backend}]'}"
        if P == 1:
            results += [
                Result(SUITE, f"{title}: compiled ShardTensor step / compiled plain step", P,
                       cpu["compiled sharded"], cpu["compiled plain"], "s", ("<=", 1.05)),
                Result(SUITE, f"{title}: eager ShardTensor step / eager plain step", P,
                       cpu["eager sharded"], cpu["eager plain"], "s"),
            ]  # fmt: skip
            if "compiled bare" in cpu:
                results.append(Result(SUITE, f"{title}: compiled step of a subclass that does nothing / compiled plain "
                                      "step (torch's floor)", P, cpu["compiled bare"], cpu["compiled plain"], "s"))
        results += [
            Result(SUITE, f"{title}, CPU: compiled step / eager step, all ranks", P,
                   cpu["compiled sharded"], cpu["eager sharded"], "s", ("<=", 1.0) if P > 1 else None),
            Result(SUITE, f"{title}: graph breaks in a compiled ShardTensor step", P,
                   over_ranks(counts["compiled sharded"]["graph_breaks"], "max"), 1, "count", ("<=", 0)),
            Result(SUITE, f"{title}: graphs compiled per step after warm-up (recompilations)", P,
                   over_ranks(recompiled, "max"), (rounds + 1) * calls * len(kinds), "count", ("<=", 0)),
            Result(SUITE, f"{title}: compile time (2 warm-up steps) / eager step", P,
                   over_ranks(compile_seconds["compiled sharded"], "max"), cpu["eager sharded"] / P, "s"),
        ]  # fmt: skip
    torch.compiler.reset()
    return results
