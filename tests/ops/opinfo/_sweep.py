"""Rank side of the OpInfo conformance sweep: PyTorch's op database against one process.

For every op of ``torch.testing._internal.common_methods_invocations.op_db`` that supports float64 on
CPU, the first :data:`MAX_SAMPLES` of its float64 samples (``requires_grad=True`` where the op supports
autograd) whose primary input holds a tensor of at least one dim run twice on every rank: on the plain tensors (the single-process reference) and with the
sample's *primary input* (``sample.input``, or each tensor of it when it is a list: ``cat``, ``stack``)
cut into a ShardTensor of the layout under test. Every other tensor argument stays a plain tensor, so
the library's promotion replicates it: that is what user code does (a sharded field times a plain
weight), and it keeps one definition of the layout for every op whatever its other arguments' shapes.

Layouts (:data:`LAYOUTS`): ``Shard(0)`` and ``Shard(-1)`` of the primary input over 3 ranks, and the
same dim sharded over both dims of the 2x2 mesh (nested: 4 shards). Shard sizes are deliberately
uneven with empty shards (:func:`uneven_sizes`: 10 rows over 3 ranks are 5/3/2, 2 rows are 1/0/1).

Per sample, every rank records one outcome (a JSON line in its progress file, so a job that dies or
hangs still leaves what it finished):

* ``pass``: every output equal (full tensors; global shape, dtype, values to float64 tolerance, Python
  results ``==``) and every gradient equal (of each input that requires grad, sharded or plain) for a
  fixed integer cotangent handed in the output's own layout;
* ``error``: the sharded run raised (the message's first line is kept: the test process checks that
  every rank raised the same);
* ``wrong``: it ran and something differs (the detail says what and the largest error);
* ``skip``: the sample is out of scope (0-dim primary input, the reference itself raises).

After each sample the ranks exchange their outcomes on a separate process group. If they differ (one
rank raised and another did not, or they raised different messages), the rest of the job is not
trustworthy (a collective may be left unmatched): every rank raises, the harness restarts the pool, and the test process resumes after
that op. A rank that raises also leaves a note for the library's stall check (``_stall.raised_alone``),
so peers waiting for it in a collective raise after ``PDP_STALL_SECONDS`` instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from physicsnemo_dp import ShardTensor, ShardTensorSpec, _stall
from physicsnemo_dp import _layout

#: At most this many samples per op (the issue's sweep).
MAX_SAMPLES = 8
#: float64 comparison tolerance (torch's own ``assertEqual`` defaults for float64).
TOL = dict(rtol=1e-7, atol=1e-7)

#: Layout id -> (world size, mesh shape, placements as a function of the primary input's ndim).
LAYOUTS = {
    "ws3-shard0": (3, (3,), "first"),
    "ws3-shardlast": (3, (3,), "last"),
    "mesh2x2-shard0": (4, (2, 2), "first"),
    "mesh2x2-shardlast": (4, (2, 2), "last"),
}

#: Ops whose values are undefined (uninitialised memory): only shape and dtype are compared.
SHAPE_ONLY = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"})


def op_key(op) -> str:
    """``name`` or ``name.variant`` (unique in ``op_db``)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_table() -> dict:
    """Every float64-capable op of PyTorch's OpInfo database, by :func:`op_key` (needs ``expecttest``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return {op_key(op): op for op in op_db if op.supports_dtype(torch.float64, "cpu")}


#: Families of the ops OpInfo describes with its generic class, by name (the rest: "other").
_FAMILIES = {
    "shape and views": (
        "reshape view view_as permute transpose swapaxes swapdims movedim moveaxis flatten unflatten squeeze "
        "unsqueeze expand expand_as narrow narrow_copy select split split_with_sizes chunk unbind tensor_split "
        "hsplit vsplit dsplit cat concat concatenate stack hstack vstack dstack column_stack row_stack t T H mT "
        "mH adjoint flip fliplr flipud roll rot90 tril triu diag diag_embed diagonal diagflat trace repeat tile "
        "ravel atleast_1d atleast_2d atleast_3d broadcast_to broadcast_tensors meshgrid unfold block_diag "
        "combinations cartesian_prod resize_ resize_as_ reshape_as view_copy alias_copy as_strided "
        "as_strided_copy as_strided_scatter slice unsafe_chunk unsafe_split repeat_interleave expand_copy permute_copy squeeze_copy transpose_copy unsqueeze_copy "
        "t_copy unbind_copy unfold_copy split_copy split_with_sizes_copy diagonal_copy _chunk_cat"
    ),
    "indexing and scatter": (
        "__getitem__ index_select index_add index_copy index_fill index_put index_reduce gather scatter "
        "scatter_add scatter_reduce take take_along_dim put masked_fill masked_scatter masked_select nonzero "
        "nonzero_static argwhere select_scatter slice_scatter diagonal_scatter _unsafe_masked_index "
        "_unsafe_masked_index_put_accumulate"
    ),
    "matmul and linear algebra": (
        "mm bmm addmm addmv addbmm baddbmm addr mv matmul einsum dot vdot inner outer ger kron tensordot "
        "chain_matmul cholesky cholesky_inverse cholesky_solve lu lu_solve lu_unpack triangular_solve pinverse det "
        "logdet matrix_exp svd qr ormqr geqrf inverse linalg_lu_factor cross cdist corrcoef cov"
    ),
    "reductions": (
        "norm logsumexp aminmax max min quantile nanquantile std_mean var_mean dist sum_to_size allclose equal"
    ),
    "elementwise (other)": "clamp lerp addcdiv addcmul where logaddexp2 isin",
    "factories, copies, random": (
        "arange empty empty_like empty_permuted empty_strided eye full full_like linspace logspace new_empty "
        "new_empty_strided new_full new_ones new_zeros ones ones_like zeros zeros_like scalar_tensor rand_like "
        "randint randint_like randn randn_like bernoulli cauchy exponential geometric log_normal multinomial normal "
        "uniform clone contiguous to zero_ resolve_conj resolve_neg item"
    ),
    "dim ops: softmax, scans, sorting": (
        "softmax log_softmax _softmax_backward_data cumsum cumprod cummax cummin logcumsumexp sort argsort msort topk kthvalue median nanmedian mode unique "
        "unique_consecutive searchsorted bucketize histc histogram histogramdd bincount cumulative_trapezoid "
        "trapezoid trapz diff gradient renorm"
    ),
}
_FAMILY_OF = {name: fam for fam, names in _FAMILIES.items() for name in names.split()}


def family(op) -> str:
    """A coarse family for the coverage table: the namespace (``linalg``, ``fft``, ``nn.functional``...),
    the OpInfo class (unary / binary elementwise, reductions), a family by name, else ``other``."""
    name = op.name
    if name.startswith("nn.functional."):
        return "nn.functional"
    if "." in name and not name.startswith("_"):
        return name.split(".")[0]
    kind = type(op).__name__
    by_class = {
        "UnaryUfuncInfo": "elementwise (unary)",
        "BinaryUfuncInfo": "elementwise (binary)",
        "ReductionOpInfo": "reductions",
        "SpectralFuncInfo": "fft",
    }
    return by_class.get(kind) or _FAMILY_OF.get(name.split(".")[0]) or "other"


def uneven_sizes(extent: int, shards: int) -> tuple[int, ...]:
    """Shard sizes in the ratio ``shards : shards-1 : ... : 1`` rounded down, the rest to the last shard.

    10 over 3 is 5/3/2, 2 over 3 is 1/0/1, 1 over 3 is 0/0/1; 10 over 4 is 4/3/2/1, 2 over 4 is 0/0/0/2.
    """
    weights = list(range(shards, 0, -1))
    sizes = [extent * w // sum(weights) for w in weights]
    sizes[-1] += extent - sum(sizes)
    return tuple(sizes)


def placements_for(mesh, where: str, ndim: int):
    """``(Shard(d),)`` on a 1-D mesh, ``(Shard(d), Shard(d))`` (nested) on a 2-D one; ``d`` first or last."""
    d = 0 if where == "first" else ndim - 1
    return tuple(Shard(d) for _ in range(mesh.ndim))


def shard(t: torch.Tensor, mesh, where: str) -> ShardTensor:
    """``t`` (the same on every rank) as a ShardTensor of the sweep's uneven layout; a leaf like ``t``."""
    placements = placements_for(mesh, where, t.ndim)
    d = placements[0].dim
    shards = math.prod(mesh.shape)
    dim_sizes = tuple(uneven_sizes(n, shards) if i == d else None for i, n in enumerate(t.shape))
    spec = ShardTensorSpec.from_sizes(
        mesh, _layout.normalize_placements(placements, mesh.ndim, t.ndim), tuple(t.shape), t.dtype, dim_sizes
    )
    return _from_global(t.detach(), spec).requires_grad_(t.requires_grad)


def _from_global(g: torch.Tensor, spec) -> ShardTensor:
    offsets, shape = spec.local_offsets(spec.coordinate), spec.local_shape_at(spec.coordinate)
    piece = g[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].clone()
    return ShardTensor(piece, spec, requires_grad=False)


def _clone(x):
    if isinstance(x, torch.Tensor):
        c = x.detach().clone()
        return c.requires_grad_(x.requires_grad and (c.is_floating_point() or c.is_complex()))
    return x


def _message(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class _Wrong(Exception):
    def __init__(self, what: str, err: float = float("nan")):
        super().__init__(what)
        self.err = err


def _full(x):
    if isinstance(x, DTensor) and not isinstance(x, ShardTensor):
        return x.full_tensor()
    if isinstance(x, ShardTensor):
        full = x.full_tensor()
        if tuple(full.shape) != tuple(x.shape):
            raise _Wrong(f"full_tensor() shape {tuple(full.shape)} but .shape {tuple(x.shape)}")
        return full
    return x


def _compare(actual, expected, what: str, shape_only: bool = False) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise _Wrong(f"{what}: {type(actual).__name__} instead of a tensor")
        if tuple(actual.shape) != tuple(expected.shape):
            raise _Wrong(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        actual = _full(actual)
        if tuple(actual.shape) != tuple(expected.shape):
            raise _Wrong(f"{what}: full shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        if actual.dtype != expected.dtype:
            raise _Wrong(f"{what}: dtype {actual.dtype} != {expected.dtype}")
        if shape_only:
            return
        a, e = actual.detach(), expected.detach()
        if a.is_floating_point() or a.is_complex():
            if not torch.allclose(a, e, equal_nan=True, **TOL):
                finite = torch.isfinite(a) & torch.isfinite(e)
                err = (a - e).abs()[finite].max().item() if finite.any() else float("inf")
                raise _Wrong(f"{what}: max abs error {err:.3g}", err)
        elif not torch.equal(a, e):
            raise _Wrong(f"{what}: values differ", float((a.double() - e.double()).abs().max().item()))
    elif isinstance(expected, float) and math.isnan(expected):
        if not (isinstance(actual, float) and math.isnan(actual)):
            raise _Wrong(f"{what}: {actual!r} != nan")
    elif isinstance(expected, (int, float, complex)) and not isinstance(expected, bool):
        if (
            not isinstance(actual, (int, float, complex))
            or isinstance(actual, bool)
            or abs(actual - expected) > 1e-7 * (1 + abs(expected))
        ):
            raise _Wrong(f"{what}: {actual!r} != {expected!r}")
    elif actual != expected:
        raise _Wrong(f"{what}: {actual!r} != {expected!r}")


def _cotangent(r: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-4, 5, tuple(r.shape), generator=gen).to(r.dtype)
    if r.is_complex():
        w = w + 1j * torch.randint(-4, 5, tuple(r.shape), generator=gen).to(r.dtype)
    return w


def _in_layout(w: torch.Tensor, o):
    """The cotangent ``w`` in the layout of output ``o`` (a pending sum's gradient is replicated)."""
    if isinstance(o, DTensor) and not isinstance(o, ShardTensor):
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in o.placements)
        return distribute_tensor(w, o.device_mesh, placements)
    if not isinstance(o, ShardTensor):
        return w
    spec = o._spec
    gspec = spec.with_layout(
        tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements), spec.dim_sizes
    )
    return _from_global(w, gspec)


def shard_dtensor(t: torch.Tensor, mesh, where: str) -> DTensor:
    """``t`` as a DTensor of DTensor's own layout (``distribute_tensor``: even chunks); a leaf like ``t``."""
    placements = placements_for(mesh, where, t.ndim)
    return distribute_tensor(t.detach(), mesh, placements).requires_grad_(t.requires_grad)


def _replicated(x, mesh):
    """Another tensor argument of a DTensor run: a replicated DTensor (a leaf like ``x``), since DTensor
    refuses plain tensors mixed with DTensors where the library promotes them (the same semantics)."""
    if isinstance(x, torch.Tensor) and x.layout == torch.strided:
        d = DTensor.from_local(x.detach(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        return d.requires_grad_(x.requires_grad)
    return x


def run_sample(op, sample, mesh, where: str, seed: int, target: str = "shardtensor") -> dict:
    """One sample: ``{"status": pass|error|wrong|skip, "detail": ..., "err": max error}``.

    ``target="dtensor"`` (the full sweep's side-by-side only): the primary input is distributed with
    ``distribute_tensor`` (DTensor's even chunks) and every other tensor argument is a replicated DTensor
    (``DTensor.from_local(..., [Replicate()])``); outputs and gradients are compared via ``full_tensor()``.
    """
    shape_only = op.name in SHAPE_ONLY
    fn = op.op
    ref = pytree.tree_map(_clone, (sample.input, sample.args, sample.kwargs))
    if not _shardable(ref[0]):
        return {"status": "skip", "detail": "no primary tensor of at least one dim"}
    args = pytree.tree_map(_clone, ref)  # before the reference runs: some ops write into their input
    again = pytree.tree_map(_clone, ref)
    torch.manual_seed(seed)
    try:
        ref_out = fn(ref[0], *ref[1], **ref[2])
    except Exception as e:  # out of scope: the sample does not run in one process
        return {"status": "skip", "detail": f"reference raised {_message(e)}"}
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in pytree.tree_leaves((ref, ref_out))):
        return {"status": "skip", "detail": "sparse layout: out of scope"}
    if not shape_only and _random(fn, again, ref_out, seed):
        return {"status": "skip", "detail": "random: values depend on the generator (tests/random)"}
    # the sharded run's arguments: the primary tensor(s) sharded
    cut = shard_dtensor if target == "dtensor" else shard
    if isinstance(args[0], torch.Tensor):
        sharded_primary = cut(args[0], mesh, where) if args[0].ndim >= 1 else args[0]
    else:
        sharded_primary = type(args[0])(
            cut(t, mesh, where) if isinstance(t, torch.Tensor) and t.ndim >= 1 else t for t in args[0]
        )
    args = (sharded_primary, args[1], args[2])
    if target == "dtensor":
        args = pytree.tree_map(lambda x: x if isinstance(x, DTensor) else _replicated(x, mesh), args)
    stage = "forward"
    try:
        torch.manual_seed(seed)
        out = fn(args[0], *args[1], **args[2])
        stage = "comparison"
        ref_leaves, ref_spec = pytree.tree_flatten(ref_out)
        out_leaves, out_spec = pytree.tree_flatten(out)
        if len(ref_leaves) != len(out_leaves):
            raise _Wrong(f"{len(out_leaves)} results instead of {len(ref_leaves)}")
        for k, (o, r) in enumerate(zip(out_leaves, ref_leaves)):
            _compare(o, r, f"output {k}", shape_only)
        # backward: every differentiable output, every input that requires grad
        ref_inputs = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor) and t.requires_grad]
        sh_inputs = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        pairs = [(o, r) for o, r in zip(out_leaves, ref_leaves) if isinstance(r, torch.Tensor) and r.requires_grad]
        if not ref_inputs or not pairs or shape_only:
            return {"status": "pass", "detail": "forward only"}
        ws = [_cotangent(r, seed + 7 * k) for k, (_, r) in enumerate(pairs)]
        try:
            ref_grads = torch.autograd.grad([r for _, r in pairs], ref_inputs, ws, allow_unused=True)
        except Exception as e:
            return {"status": "pass", "detail": f"forward only (reference backward raised {_message(e)})"}
        stage = "backward"
        sh_grads = torch.autograd.grad(
            [o for o, _ in pairs], sh_inputs, [_in_layout(w, o) for w, (o, _) in zip(ws, pairs)], allow_unused=True
        )
        stage = "gradient comparison"
        for i, (g, rg) in enumerate(zip(sh_grads, ref_grads)):
            if rg is None:
                if g is not None and bool((_full(g) != 0).any()):
                    raise _Wrong(f"grad of input {i}: nonzero where the reference has none")
                continue
            if g is None:
                if bool((rg != 0).any()):
                    raise _Wrong(f"grad of input {i}: missing")
                continue
            _compare(g, rg, f"grad of input {i}")
    except _Wrong as w:
        return {"status": "wrong", "detail": f"{stage}: {w}", "err": w.err}
    except Exception as e:
        _stall.raised_alone(e)
        return {"status": "error", "detail": f"{stage}: {_message(e)}"}
    return {"status": "pass", "detail": ""}


def _random(fn, ref, ref_out, seed: int) -> bool:
    """Whether the reference gives other values under another seed (a random op).

    OpInfo runs its random ops (and only those) through ``wrapper_set_seed`` (a fixed seed, 42, inside):
    for this check the wrapper's seed is changed too. Some samples of them are not random (dropout with
    ``p=0``, attention without dropout): those are compared.
    """
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    if "wrapper_set_seed" not in names:
        return False  # only OpInfo's random ops: a run of another op may differ in uninitialised outputs
    scope = fn.__globals__
    original = scope["wrapper_set_seed"]
    scope["wrapper_set_seed"] = _reseeded
    try:
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            again = fn(ref[0], *ref[1], **ref[2])
    finally:
        scope["wrapper_set_seed"] = original
    for a, b in zip(pytree.tree_leaves(ref_out), pytree.tree_leaves(again)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                return True
            a = a.detach()
            same = (
                torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
                if (a.is_floating_point() or a.is_complex())
                else torch.equal(a, b)
            )
            if not same:
                return True
    return False


def _reseeded(op, *args, **kwargs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4321)
        return op(*args, **kwargs)


_STATUS_GROUP: dict = {}


def _status_group():
    """A process group of its own for the outcome exchange (never one the library's collectives use)."""
    key = (dist.get_world_size(), os.getpid())
    if key not in _STATUS_GROUP:
        _STATUS_GROUP.clear()
        _STATUS_GROUP[key] = dist.new_group(backend="gloo")
    return _STATUS_GROUP[key]


def _seed(key: str, index: int) -> int:
    return (zlib.crc32(key.encode()) + 1009 * index) % (2**31)


def run_ops(ctx, names, layout, progress_dir, max_samples=MAX_SAMPLES, target="shardtensor", sample_deadline=None):
    """Run the ops ``names`` (op keys) on the layout; append one JSON line per sample to this rank's progress
    file and return the outcomes. Raises on every rank when the ranks' outcomes diverge (see module doc).

    ``sample_deadline`` (seconds): a rank whose sample (with the outcome exchange) takes longer leaves the
    process (``os._exit``), so a hang costs that long, not the job's deadline; the test process records the
    op as ``hang`` and resumes after it on a fresh pool.
    """
    where = LAYOUTS[layout][2]
    table = op_table()
    group = _status_group()
    path = os.path.join(progress_dir, f"rank{ctx.rank}.jsonl")
    results = []
    with open(path, "a") as log:
        for name in names:
            op = table[name]
            log.write(json.dumps({"op": name, "start": True, "t": round(time.perf_counter(), 3)}) + "\n")
            log.flush()
            torch.manual_seed(_seed(name, 0))
            try:
                samples = list(
                    _first(op.sample_inputs("cpu", torch.float64, requires_grad=op.supports_autograd), max_samples)
                )
            except Exception as e:
                samples, outcome = [], {"op": name, "sample": -1, "status": "skip", "detail": _message(e)}
                log.write(json.dumps(outcome) + "\n")
            for i, sample in enumerate(samples):
                start = time.perf_counter()
                watchdog = None
                if sample_deadline:
                    watchdog = threading.Timer(sample_deadline, _give_up, (log, name, i, sample_deadline))
                    watchdog.daemon = True
                    watchdog.start()
                try:
                    found = run_sample(op, sample, ctx.mesh, where, _seed(name, i), target)
                except Exception as e:  # the harness's own steps (cloning, the reference): out of scope
                    found = {"status": "skip", "detail": f"harness: {_message(e)}"}
                outcome = {"op": name, "sample": i, **found}
                outcome["t"] = round(time.perf_counter() - start, 4)
                if outcome["status"] != "skip":
                    outcome["sample_repr"] = _describe(sample)
                log.write(json.dumps(outcome) + "\n")
                log.flush()
                results.append(outcome)
                kinds = [None] * dist.get_world_size(group)
                dist.all_gather_object(kinds, (outcome["status"], outcome["detail"]), group=group)
                if watchdog is not None:
                    watchdog.cancel()
                if len(set(kinds)) > 1:
                    log.write(json.dumps({"op": name, "sample": i, "diverged": kinds}) + "\n")
                    log.flush()
                    raise RuntimeError(f"ranks' outcomes diverged on {name} sample {i}: {kinds}")
            log.write(json.dumps({"op": name, "done": True}) + "\n")
            log.flush()
    return results


def _give_up(log, name, index, seconds):
    """The per-sample deadline passed (a hang): note it and leave the process (the pool is restarted)."""
    log.write(json.dumps({"op": name, "sample": index, "deadline": seconds}) + "\n")
    log.flush()
    os._exit(17)


def _first(samples, n):
    """The first ``n`` samples whose primary input holds a tensor of at least one dim (the database lists
    0-dim samples first for many reductions: counting those would leave such ops untested)."""
    taken = 0
    for sample in samples:
        if taken >= n:
            return
        if _shardable(sample.input):
            taken += 1
            yield sample


def _shardable(primary) -> bool:
    if isinstance(primary, torch.Tensor):
        return primary.ndim >= 1
    return isinstance(primary, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.ndim >= 1 for t in primary)


def _describe(sample) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"T{tuple(x.shape)}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(one(y) for y in x) + "]"
        return repr(x)[:40]

    parts = [one(sample.input)] + [one(a) for a in sample.args] + [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)[:200]
