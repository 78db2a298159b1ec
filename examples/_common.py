"""What the examples share: mesh and device flags, the training loop, rank-0 progress and log, plots.

An example supplies its data, its model and a loss; everything else — the
``("ddp", "domain")`` mesh, DDP or FSDP2, the progress bar, the log file,
checkpoints holding the datapipe's position, resuming (also on another
layout), and the figures — lives here once. The minimal examples use only
:func:`on_ranks`, which runs a function under ``torchrun`` or, from plain
``python``, on ranks started by :func:`physicsnemo_dp.launch`.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

import _flags
import _output_lock
from datapipes import check_all_ranks
from physicsnemo_dp import ShardTensor, launch
from physicsnemo_dp._torch_compat import default_store
from physicsnemo_dp.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    begin_branch,
    load_checkpoint,
    save_checkpoint,
)
from physicsnemo_dp.distributed import MeshContext, parallelize_model
from physicsnemo_dp.launch import process_state

__all__ = ["training_parser", "build_context", "check_batch", "prepare_output", "finish", "main", "RunLog", "fit",
           "global_mean", "cosine_schedule", "build_training", "plain_replica", "plot_loss", "plot_fields", "plot_points",
           "open_run", "close_run", "on_ranks", "NonFiniteLossError", "StepWatchdog"]


# --------------------------------------------------------------------------- #
# Flags and the mesh
# --------------------------------------------------------------------------- #
class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset ones (their help says what unset means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


#: ``--amp``: the autocast dtype of the training step (None: off).
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def training_parser(doc: str, *, steps: int, batch_size: int, lr: float, out: str) -> argparse.ArgumentParser:
    """A parser with the flags every training example takes; the example adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=_Help)
    run = parser.add_argument_group("mesh and device")
    run.add_argument("--domain-size", type=_flags.integer(1), default=None,
                     help="ranks that split one sample (default: 2 when the world size is even, else 1)")
    run.add_argument("--ddp-size", type=_flags.integer(1), default=None,
                     help="ranks that see different samples (default: world size / domain size)")
    run.add_argument("--strategy", choices=["ddp", "fsdp2", "none"], default="ddp",
                     help="data-parallel wrapper on the ddp axis")
    run.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                     help="cuda: NCCL and one GPU per rank (LOCAL_RANK); cpu: gloo")
    run.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                     help="collective timeout of the process group, and the longest a training step (with its "
                          "data read and checkpoint write) may take before the watchdog reports the ranks that did "
                          "not arrive and ends the job, whatever they are doing")
    run.add_argument("--stall-floor", type=_seconds, default=STALL_FLOOR, metavar="SECONDS",
                     help=f"the watchdog's adaptive bound, on by default: after the first {STALL_WARMUP} steps "
                          f"(compile, warm-up), a step lasting more than {STALL_FACTOR:g} x the slowest of the last "
                          f"{STALL_RECENT} (a checkpoint write: of the checkpoint writes; data reading not counted), "
                          "but at least this long and at most --timeout, makes the ranks look at each other: a "
                          "stopped or dead rank ends the job, naming the rank and the step; a slow rank is waited "
                          "for up to --timeout. The bound is logged once set")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=_flags.integer(1), default=steps, help="optimizer steps in total (a resumed run continues to it)")
    train.add_argument("--batch-size", type=_flags.integer(1), default=batch_size, help="samples per step, split over the ddp ranks")
    train.add_argument("--lr", type=_flags.real(0, inclusive=False), default=lr, help="peak learning rate (cosine decay over --steps)")
    train.add_argument("--seed", type=_flags.integer(0, _flags.SEED_MAX), default=0, help="seed of the weights and of the sample order")
    train.add_argument("--amp", choices=list(AMP_DTYPES), default="off",
                       help="mixed precision of the training step: forward and loss under torch.autocast on the "
                            "mesh's device in bfloat16 or float16 (float16 with a torch.amp.GradScaler); the weights, "
                            "gradients and optimizer state stay float32, the test evaluation runs in float32")
    train.add_argument("--compile", nargs="?", const="inductor", default=None, choices=["inductor", "aot_eager"],
                       help="torch.compile the model (a bare --compile: Inductor; aot_eager traces without generating "
                            "code, for checking a model compiles): the library's Python runs only while tracing, "
                            "so a step costs about what plain torch's compiled step costs; the first steps compile "
                            "(tens of seconds to minutes on a CPU). A model with a compile_regions() method "
                            "(ring attention) compiles its parts around the attention, which runs eagerly. "
                            "See docs/performance.md")
    train.add_argument("--prefetch", type=_flags.integer(0), default=2, help="batches the datapipe reads ahead (0: read in the loop)")
    train.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                       help="a NaN/inf global loss: stop (every rank exits naming the step and the ranks whose data "
                            "gave it; nothing is saved) or skip the step (no optimizer step)")
    train.add_argument("--max-skips", type=_flags.integer(0), default=10,
                       help="with --on-nonfinite skip: stop after this many consecutive skipped steps")
    files = parser.add_argument_group("output")
    files.add_argument("--out", type=_flags.output_folder, default=out, help="folder for the log, checkpoints, plots and data")
    files.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|auto|FOLDER",
                       help="latest (the default of a bare --resume): the newest loadable checkpoint in "
                            "OUT/checkpoints, failing if there is none; auto: that, or start fresh if there is "
                            "none; FOLDER: exactly that checkpoint folder")
    files.add_argument("--checkpoint-every", type=_flags.integer(1), default=25, help="steps between checkpoints (and one at the end)")
    files.add_argument("--quiet", action="store_true", help="no progress bar (messages and the log file remain)")
    return parser


_MAX_SECONDS = 7 * 24 * 3600  # a week: longer is a typo (and inf or 1e300 overflow the process group's timedelta)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= _MAX_SECONDS:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds, more than 0 and at most {_MAX_SECONDS} (a week), got {text!r}")
    return value


def build_context(args: argparse.Namespace) -> MeshContext:
    """Join the process group (torchrun, or alone) and build the ``(ddp, domain)`` mesh the flags ask for."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    domain, ddp = args.domain_size, args.ddp_size
    if domain is None and ddp is None:
        domain = 2 if int(os.environ.get("WORLD_SIZE", "1")) % 2 == 0 else 1
    return MeshContext.build(
        domain_size=domain, ddp_size=ddp, strategy=None if args.strategy == "none" else args.strategy,
        device_type=args.device, backend="nccl" if args.device == "cuda" else "gloo", timeout=args.timeout,
    )


def check_batch(args: argparse.Namespace, context: MeshContext) -> int:
    """Samples per ddp rank per step; the global batch must split evenly (DDP averages equal shares)."""
    if args.batch_size % context.ddp_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the ddp size {context.ddp_size}")
    return args.batch_size // context.ddp_size


def prepare_output(args: argparse.Namespace) -> Path:
    """Create ``--out``; a fresh run (no ``--resume``) drops the checkpoints of an earlier run there.

    Rank 0 creates it and checks that it can write there; its verdict is
    shared (:func:`check_all_ranks`), so a folder that cannot be made stops
    every rank with rank 0's message. Called by :func:`open_run` once the run
    holds the folder's lock, so it never drops the checkpoints of a run still
    writing them.
    """
    out = Path(args.out).resolve()
    error = None
    if dist.get_rank() == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
            if args.resume is None:
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
        except OSError as err:
            error = SystemExit(f"--out {args.out}: cannot write there ({err}); pass a folder this user can write to")
    check_all_ranks(error)
    return out


@contextmanager
def _owning_output(out: Path) -> Iterator[str | None]:
    """Hold ``out/run.lock`` for the block (collective); yields the note about a stale lock taken over, or None.

    Rank 0 takes the lock (:mod:`_output_lock`) and every rank gets its
    verdict, so a folder held by another run stops every rank with the same
    message naming the holder, before anything in it is touched. The lock is
    released when the block ends, also when it raises.
    """
    held, refusal = None, None
    if dist.get_rank() == 0:
        try:
            held = _output_lock.acquire(out)
        except _output_lock.OutputBusyError as err:
            refusal = str(err)
        except OSError as err:
            refusal = f"--out {out}: cannot create its lock file: {err}"
    verdict = [refusal, None if held is None else held.note]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise SystemExit(verdict[0])
    try:
        yield verdict[1]
    finally:
        if held is not None:
            _output_lock.release(held)


def finish(out: Path) -> None:
    """Leave the process group; rank 0 names the output folder."""
    if dist.get_rank() == 0:
        print(f"output folder: {out}", flush=True)
    dist.destroy_process_group()


def main(run: Callable[[list[str] | None], dict], argv: list[str] | None = None) -> int:
    """A training example's command line: ``run(argv)``, then :func:`finish`; returns the exit status 0.

    Only the command line leaves the process group: the tests call ``run``
    on their own ranks and keep the group for the next run.
    """
    finish(Path(run(argv)["out"]))
    return 0


# --------------------------------------------------------------------------- #
# Progress and log
# --------------------------------------------------------------------------- #
class RunLog:
    """Rank 0's progress bar (step, loss, samples/s) and ``train.log``; a no-op on other ranks.

    The log is appended to, so a resumed run continues the file; each run
    starts with its arguments.
    """

    def __init__(self, out: Path, title: str, args: argparse.Namespace):
        self.enabled = dist.get_rank() == 0
        self.title, self.quiet = title, args.quiet
        self._file = open(out / "train.log", "a", buffering=1) if self.enabled else None
        if self.enabled:
            self._file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {title} {vars(args)}\n")
        self._bar = None
        self._clock = None

    def info(self, message: str) -> None:
        """Print (above the bar, if any) and log ``message``."""
        if not self.enabled:
            return
        self._file.write(f"{time.strftime('%H:%M:%S')} {message}\n")
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def start(self, first_step: int, total_steps: int) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, desc=self.title, unit="step",
                             disable=self.quiet, dynamic_ncols=True, file=sys.stdout)
        self._clock = (time.perf_counter(), first_step)

    def step(self, step: int, loss: float, samples: int) -> None:
        """Record ``step``'s loss; samples/s is averaged since the first step of this run."""
        if not self.enabled:
            return
        t0, s0 = self._clock
        rate = samples * (step - s0) / max(time.perf_counter() - t0, 1e-9)
        self._file.write(f"{time.strftime('%H:%M:%S')} step {step} loss {loss:.6g} samples/s {rate:.2f}\n")
        self._bar.set_postfix(loss=f"{loss:.4g}", samples_s=f"{rate:.1f}", refresh=False)
        self._bar.update(1)

    def stop(self) -> None:
        """Close the progress bar (later messages print as plain lines)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.stop()
        if self._file is not None:
            self._file.close()


# --------------------------------------------------------------------------- #
# The training loop
# --------------------------------------------------------------------------- #
class NonFiniteLossError(RuntimeError):
    """The global loss was NaN or infinite (raised on every rank alike, before anything is saved)."""


def global_mean(value, context: MeshContext) -> float:
    """A per-ddp-rank mean (ShardTensor or tensor) averaged over the ddp ranks: the global batch's mean."""
    return _mean_and_nonfinite(value, context)[0]


def _mean_and_nonfinite(value, context: MeshContext) -> tuple[float, list[int]]:
    """The global mean of ``value`` and the ddp ranks whose ``value`` is NaN/inf, from one all-reduce.

    The logged loss is all-reduced over the ddp ranks anyway; a one-hot
    "not finite" flag per ddp rank rides along in the same tensor, so every
    rank learns which ddp ranks diverged without another collective. The
    domain ranks of a ddp rank hold the same (replicated) loss, so every rank
    of the world gets the same answer.
    """
    if isinstance(value, ShardTensor):
        value = value.full_tensor()
    mine, ddp_size = float(value.detach().reshape(())), context.ddp_size
    if ddp_size == 1:
        return mine, [] if math.isfinite(mine) else [0]
    packed = [mine] + [0.0] * ddp_size
    packed[1 + context.ddp_rank] = float(not math.isfinite(mine))
    packed = torch.tensor(packed, dtype=torch.float64, device=value.device)
    dist.all_reduce(packed, group=context.ddp_mesh.get_group())
    total, *flags = packed.tolist()
    return total / ddp_size, [r for r, flag in enumerate(flags) if flag]


def _endless(pipe) -> Iterator:
    """The pipe's batches across epochs, from its current position."""
    while True:
        yield from pipe


def _restore_position(pipe, saved: dict) -> None:
    """Continue the sample order where the checkpoint left it, also on another (ddp, domain) layout.

    Ddp rank ``r`` reads every ``ddp_size``-th sample of the shared order, so
    step ``k`` consumes the same samples on any layout with the same global
    batch (``ddp_size * batch_size``): the position carries over unchanged.
    """
    mine = pipe.state_dict()
    if saved["ddp_size"] * saved["batch_size"] != mine["ddp_size"] * mine["batch_size"]:
        raise SystemExit(
            f"the checkpoint was taken with a global batch of {saved['ddp_size'] * saved['batch_size']} samples, "
            f"this run has {mine['ddp_size'] * mine['batch_size']}: resume with the same --batch-size"
        )
    pipe.load_state_dict({**saved, "ddp_size": mine["ddp_size"], "batch_size": mine["batch_size"]})


#: Flags of :func:`training_parser` a resumed run may change: applied, and logged as changed. Every other flag —
#: the shared ``--seed`` and ``--batch-size``, any flag added later, and an example's own flags unless it passes
#: them to :func:`fit` as ``may_change`` — is structural: it shapes the model, the data or the sample order, so
#: a checkpoint taken with another value is refused, naming the difference.
MAY_CHANGE_ON_RESUME = frozenset({
    "steps", "lr", "timeout", "prefetch", "on_nonfinite", "max_skips", "checkpoint_every", "quiet", "out",
    "domain_size", "ddp_size", "strategy", "device", "amp", "compile",
})
_NOT_COMPARED = frozenset({"resume"})


def _settings(args: argparse.Namespace) -> dict:
    """The parsed flags as JSON values: what a checkpoint records of the run that wrote it (``extra["args"]``)."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in vars(args).items()}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _compare_settings(recorded: dict, args: argparse.Namespace, may_change) -> tuple[list, list, list]:
    """``(structural differences, allowed changes, flags recorded on one side only)`` as ``(dest, old, new)``."""
    now = _settings(args)
    allowed = MAY_CHANGE_ON_RESUME | set(may_change)
    structural, changed, one_sided = [], [], []
    for dest in sorted((set(recorded) | set(now)) - _NOT_COMPARED):
        if dest not in recorded or dest not in now:
            one_sided.append((dest, recorded.get(dest, "not recorded"), now.get(dest, "no such flag now")))
        elif recorded[dest] != now[dest]:
            (changed if dest in allowed else structural).append((dest, recorded[dest], now[dest]))
    return structural, changed, one_sided


def _retarget_schedule(optimizer, scheduler, lr: float) -> None:
    """Make the restored optimizer and LR schedule follow peak ``lr`` and this run's schedule from here on.

    Loading restores the saved peak (the scheduler's ``base_lrs``, the
    groups' ``initial_lr``) and the saved step's rate; a new ``--lr`` (or a new
    ``--steps``, which the cosine schedule's factor reads) must replace all
    three, or the next ``scheduler.step()`` would return to the old peak.
    The rate at the restored step is the schedule's own factor times the new
    peak (any other scheduler: the restored rate scaled by new/old peak).
    """
    closed_form = isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)  # rate = peak * factor(step)
    for i, (group, base) in enumerate(zip(optimizer.param_groups, scheduler.base_lrs)):
        if closed_form:
            group["lr"] = lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
        else:
            group["lr"] = group["lr"] * (lr / base) if base else lr
        group["initial_lr"] = lr
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)


def _resume(args: argparse.Namespace, context: MeshContext, root: Path, model, optimizer, scheduler, log: RunLog,
            may_change=()):
    """``--resume``: the Restored checkpoint, or None to start at step 0; the same decision on every rank.

    ``latest`` fails when nothing under ``root`` loads (a run that silently
    restarts from step 0 would overwrite the good checkpoints it failed to
    read); ``auto`` starts fresh then; a folder must load. The reason every
    candidate was skipped (the checkpoint module's warnings) is in the message.

    The flags the checkpoint recorded are compared with this run's before
    anything is loaded: a structural difference (see
    :data:`MAY_CHANGE_ON_RESUME`) stops every rank with one message listing
    each ``old → new``; the flags that may change are applied (a new
    ``--lr`` or ``--steps`` retargets the restored schedule) and logged.
    """
    if args.resume is None:
        return None
    source = root if args.resume in ("latest", "auto") else Path(args.resume)
    refusal, compared = [], []

    def check_settings(path: Path, extra: dict) -> None:
        if "args" not in extra:
            return
        structural, changed, one_sided = _compare_settings(extra["args"], args, may_change)
        compared[:] = [changed, one_sided]
        if structural:
            refusal.append(
                f"--resume {args.resume}: checkpoint {path} was written with other settings of the model or data:\n"
                + "".join(f"  {_flag(d)} {old} → {new}\n" for d, old, new in structural)
                + "resume with the checkpoint's values, or start a new run (without --resume, or with another --out)")
            raise CheckpointError(refusal[-1])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            restored, error = load_checkpoint(source, model, optimizer, scheduler, check_extra=check_settings), None
        except CheckpointError as err:
            restored, error = None, err
    for w in caught:  # shown as usual, and named in the error below
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    check_all_ranks(None if refusal else error)  # an explicit folder that fails on any rank fails on every rank
    if refusal:  # every rank compared the same record with the same flags
        raise SystemExit(refusal[0])
    loaded = torch.tensor([restored is not None, restored is None], dtype=torch.int32, device=context.device)
    dist.all_reduce(loaded)
    loaded = loaded.cpu()
    if loaded.min().item() > 0:  # some ranks loaded, others found nothing: never train on a mix
        raise CheckpointError(f"--resume {args.resume}: {loaded[0].item()} rank(s) loaded a checkpoint from "
                              f"{source}, {loaded[1].item()} found none; is {source} on a filesystem every rank sees?")
    if restored is not None:
        if not compared:
            log.info(f"checkpoint {restored.path} records no settings: this run's flags were not compared with it")
        else:
            changed, one_sided = compared
            for dest, old, new in changed:
                log.info(f"{_flag(dest)} changed {old} → {new} on resume")
            for dest, old, new in one_sided:
                log.info(f"{_flag(dest)}: {old} in the checkpoint, {new} now (not compared)")
            if any(dest in ("lr", "steps") for dest, _, _ in changed):
                _retarget_schedule(optimizer, scheduler, args.lr)
        return restored
    skipped = "".join(f"\n  skipped: {w.message}" for w in caught if issubclass(w.category, CheckpointWarning))
    if args.resume == "auto":
        log.info(f"--resume auto: no loadable checkpoint in {source}, starting from step 0{skipped}")
        return None
    raise SystemExit(f"--resume {args.resume}: no loadable checkpoint in {source}{skipped or ' (none there)'}; "
                     "pass --resume auto to start fresh when there is none")


def _autocast(args: argparse.Namespace, context: MeshContext):
    """``--amp``: ``torch.autocast`` on the mesh's device type in the chosen dtype (disabled for ``off``)."""
    dtype = AMP_DTYPES[args.amp]
    return torch.autocast(context.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _grad_scaler(args: argparse.Namespace, context: MeshContext, model):
    """``--amp fp16``: a ``torch.amp.GradScaler`` on the mesh's device type (None otherwise).

    Refused, on every rank alike before anything is trained, for a model with
    complex parameters (e.g. an FNO's spectral weights): torch's unscale kernel
    (``_amp_foreach_non_finite_check_and_unscale_``) has no complex version.
    """
    if args.amp != "fp16":
        return None
    complex_ = [name for name, p in model.named_parameters() if p.is_complex()]
    if complex_:
        shown = ", ".join(complex_[:3]) + (f" and {len(complex_) - 3} more" if len(complex_) > 3 else "")
        raise SystemExit(f"--amp fp16: the model has complex parameters ({shown}), whose gradients "
                         "torch.amp.GradScaler cannot unscale (no complex kernel in torch); use --amp bf16, "
                         "which needs no GradScaler, or --amp off")
    return torch.amp.GradScaler(context.device.type)


def _nonfinite_report(step: int, loss: float, bad: list[int], batch, context: MeshContext, action: str) -> str:
    """Which step, and which ranks' data gave the non-finite loss (every rank returns the same text).

    Only on this rare path does each rank look for NaN/inf in its own piece
    of the batch; the pieces' verdicts are gathered so that the message tells
    NaN data (and on which (ddp, domain) rank) from divergence.
    """
    mine = None
    if context.ddp_rank in bad:
        nonfinite = None  # a batch that is not a dict of tensors is not inspected
        if isinstance(batch, Mapping):
            pieces = {k: (v.to_local() if isinstance(v, ShardTensor) else v) for k, v in batch.items()}
            nonfinite = sorted(k for k, v in pieces.items()
                               if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all())
        mine = (dist.get_rank(), context.ddp_rank, context.domain_rank, getattr(batch, "samples", None), nonfinite)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    lines = []
    for rank, ddp, domain, samples, nonfinite in (g for g in gathered if g is not None):
        what = ("its data was not inspected" if nonfinite is None else
                f"non-finite values in {nonfinite}" if nonfinite else "its data is finite (divergence?)")
        at = "" if samples is None else f", samples {list(samples)}"
        lines.append(f"  rank {rank} (ddp {ddp}, domain {domain}{at}): {what}")
    return (f"step {step}: the loss is not finite ({loss}) on ddp rank(s) {bad} (--on-nonfinite {action})\n"
            + "\n".join(lines))


def fit(context: MeshContext, model, optimizer, scheduler, pipe, loss_fn: Callable, args: argparse.Namespace,
        out: Path, log: RunLog, *, may_change=()) -> list[float]:
    """Train to ``args.steps`` (resuming if asked) and return the global-batch loss of every step.

    ``loss_fn(model, batch)`` returns this ddp rank's mean loss. A checkpoint
    (model, optimizer, scheduler, RNG, the pipe's position, the losses so far
    and the parsed flags) is written every ``--checkpoint-every`` steps and at
    the end. ``may_change`` names the example's own flags (dests) that a
    resumed run may change; its other flags are structural (:func:`_resume`).

    The run's checkpoints form a branch (:func:`physicsnemo_dp.checkpoint.begin_branch`)
    descending from the checkpoint it resumed from: folders of
    ``OUT/checkpoints`` that are not its ancestors (the later steps of a
    rewind, checkpoints that did not load under ``--resume auto``) are moved
    to ``OUT/checkpoints/superseded/<branch>/`` and logged, so a later
    ``--resume`` continues this run. The last log line names the checkpoint
    this run wrote last.

    What stops a run, on every rank alike: a data error on any rank
    (:func:`datapipes.check_all_ranks`, one flag all-reduced per step before
    the forward's first collective); a non-finite global loss
    (``--on-nonfinite``: checked before the optimizer step, so the weights
    and every checkpoint stay finite); a stopped or dead rank, once a step
    lasts longer than the watchdog's adaptive bound, and any step that does
    not finish within ``--timeout`` seconds (:class:`StepWatchdog`).

    ``--amp bf16|fp16`` runs ``loss_fn`` under ``torch.autocast`` on the
    mesh's device type (:func:`_autocast`); the backward, the weights and the
    optimizer stay float32. With fp16 a ``torch.amp.GradScaler`` scales the
    loss: a step whose gradients overflow is skipped on every rank alike (the
    gradients it reads are all-reduced over the domain and ddp ranks first,
    DTensor all-reduces its inf check under FSDP2), logged, and the scale
    backs off; the scaler's state is saved with the checkpoints and restored
    on resume. ``--amp`` may change on resume (:data:`MAY_CHANGE_ON_RESUME`).
    """
    root = out / "checkpoints"
    step, losses, skips = 0, [], 0
    autocast = _autocast(args, context)
    scaler = _grad_scaler(args, context, model)
    restored = _resume(args, context, root, model, optimizer, scheduler, log, may_change)
    if restored is not None:
        step, losses = restored.step, list(restored.extra["losses"])
        if scaler is not None and "grad_scaler" in restored.extra:  # an fp16 run resumed: the scale it reached
            scaler.load_state_dict(restored.extra["grad_scaler"])
            log.info(f"--amp fp16: the loss scale {scaler.get_scale():g} of the checkpoint was restored")
        _restore_position(pipe, restored.extra["pipe"])
        saved = restored.extra.get("layout")
        log.info(f"resumed from {restored.path} at step {step} (saved on layout {saved}, "
                 f"now ({context.ddp_size}, {context.domain_size}))")
    branch = begin_branch(root, restored)
    if branch.set_aside:
        why = (f"not on the line of {restored.path.name} (later steps, another branch, or an unreadable manifest)"
               if restored is not None else "from before this fresh start")
        log.info(f"{len(branch.set_aside)} checkpoint folder(s) {why} moved unchanged to {branch.aside}: "
                 f"{', '.join(branch.set_aside)}")
    newest = None if restored is None else restored.path  # the newest checkpoint of this run's line
    log.start(step, args.steps)
    batches = _endless(pipe)
    watchdog = StepWatchdog(args.timeout, log, floor=args.stall_floor)
    try:
        while step < args.steps:
            watchdog.at(step + 1, READING)
            try:
                batch, error = next(batches), None
            except Exception as err:  # only this rank knows: tell the others before they block
                batch, error = None, err
            watchdog.at(step + 1, "agreeing on the data")
            check_all_ranks(error)
            watchdog.at(step + 1, "forward and backward")
            with autocast:
                loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            (loss if scaler is None else scaler.scale(loss)).backward()
            watchdog.at(step + 1, "loss")
            value, bad = _mean_and_nonfinite(loss, context)
            if bad:
                report = _nonfinite_report(step + 1, value, bad, batch, context, args.on_nonfinite)
                skips += 1
                if args.on_nonfinite == "stop" or skips > args.max_skips:
                    limit = "" if args.on_nonfinite == "stop" else f"\n{skips} consecutive steps skipped (--max-skips)"
                    raise NonFiniteLossError(f"{report}{limit}\nnothing was saved for this step; the newest "
                                             f"checkpoint is {newest}")
                optimizer.zero_grad(set_to_none=True)  # the step's gradients are dropped
                log.info(f"{report}\nskipped ({skips} in a row, at most {args.max_skips})")
                continue
            skips = 0
            watchdog.at(step + 1, "optimizer step")
            if scaler is None:
                optimizer.step()
            else:
                scale = scaler.get_scale()
                scaler.step(optimizer)  # skipped when a gradient is inf/NaN: every rank finds the same
                scaler.update()
                if scaler.get_scale() < scale:
                    log.info(f"step {step + 1}: --amp fp16 gradients overflowed at loss scale {scale:g}; the "
                             f"optimizer step was skipped, the scale is now {scaler.get_scale():g}")
            scheduler.step()
            step += 1
            losses.append(value)
            log.step(step, losses[-1], args.batch_size)
            if step % args.checkpoint_every == 0 or step == args.steps:
                watchdog.at(step, CHECKPOINTING)
                extra = {"pipe": pipe.state_dict(), "losses": losses, "layout": [context.ddp_size, context.domain_size],
                         "args": _settings(args)}
                if scaler is not None:
                    extra["grad_scaler"] = scaler.state_dict()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", CheckpointWarning)
                    newest = save_checkpoint(root, step, model, optimizer, scheduler, extra=extra,
                                             lineage=branch.lineage)
                for w in caught:  # e.g. a corrupt checkpoint that pruning left in place: shown and logged
                    log.info(f"warning: {w.message}")
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except BaseException as err:
        watchdog.failed(step + 1, err)
        raise
    finally:
        watchdog.stop()
        batches.close()
    log.stop()
    if losses:
        log.info(f"final loss {losses[-1]:.6g} after {step} steps; checkpoint {newest}")
    return losses


_RUNS = itertools.count()  # one watchdog key space per fit() in this process (the same count on every rank)

#: The phases of a step that the watchdog's adaptive bound measures apart (the others are the step's computation).
READING, CHECKPOINTING = "reading data", "writing a checkpoint"
STALL_FACTOR = 5.0  # the adaptive bound is this many times the slowest recent step (or checkpoint write),
STALL_WARMUP = 2  # not counting the first steps of a run (compile, warm-up, reader start-up),
STALL_RECENT = 20  # over this many recent ones,
STALL_FLOOR = 60.0  # and at least this long (--stall-floor); at most --timeout


class _StallBound:
    """The watchdog's adaptive bound from measured durations: arithmetic only (no clock, no I/O).

    Two kinds of span are measured apart: a step's computation (from taking
    its batch to its optimizer step; reading the batch is not counted: a
    slow read is I/O of that rank, and the first reads start the readers) and
    a checkpoint write (much longer than a step, and rare). The first
    ``warmup`` steps are not counted (compile, allocator and kernel warm-up).
    The bound of a kind is ``factor`` times the slowest of its last
    ``recent`` spans, at least ``floor`` and at most ``timeout``; until a
    kind has been measured its bound is None and only ``timeout`` applies.
    """

    def __init__(self, timeout: float, floor: float, factor: float, warmup: int, recent: int):
        self.timeout, self.floor, self.factor, self.warmup = timeout, floor, factor, warmup
        self._spans = {"step": collections.deque(maxlen=recent), "checkpoint": collections.deque(maxlen=recent)}
        self._warmed = 0

    def record(self, kind: str, seconds: float) -> bool:
        """Count a finished span of ``kind``; True when it gave that kind its first bound."""
        if kind == "step" and self._warmed < self.warmup:
            self._warmed += 1
            return False
        spans = self._spans[kind]
        first = not spans
        spans.append(seconds)
        return first

    def bound(self, kind: str) -> float | None:
        spans = self._spans.get(kind)
        return min(self.timeout, max(self.floor, self.factor * max(spans))) if spans else None

    def describe(self, kind: str) -> str:
        spans = self._spans[kind]
        what = "step" if kind == "step" else "checkpoint write"
        return (f"{self.factor:g} x the slowest of the last {len(spans)} {what}(s), {max(spans):.3g} s; "
                f"at least --stall-floor {self.floor:g} s, at most --timeout {self.timeout:g} s")


class _Span(NamedTuple):
    """What the training thread is in: ``kind`` ("reading", "step", "checkpoint", "other") of ``step``."""

    kind: str
    step: int
    start: float  # time.monotonic()
    bound: float | None  # the adaptive bound for it (None: only --timeout)


class _Verdict(NamedTuple):
    state: str  # as printed: "STOPPED (SIGSTOP)", "EXITED", "NOT RESPONDING", "did not arrive", "waiting", ...
    culprit: bool  # ends the job
    kill: bool = False  # stopped (or not responding under --timeout) on this host: SIGKILL it


def _process_space() -> str:
    """Where a pid names the same process: the host, its boot, and the pid namespace.

    The pid namespace alone is the same on every Linux host; the hostname
    alone is shared by containers on the host's network, each with its own
    pids. Where ``/proc`` is absent, the hostname.
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "/".join(parts)


class StepWatchdog:
    """A daemon thread per rank that ends a job whose step hangs, naming the step and the ranks that did not arrive.

    Without it, a rank that stops (SIGSTOP, a deadlock, a hung filesystem)
    leaves the others waiting in a collective until the process group's
    timeout, which then names neither the step nor the rank. The training
    thread only records where it is (``at(step, phase)``: a few attribute
    assignments, no I/O); the watchdog thread publishes that position with a
    heartbeat counter to the process group's store every ``poll`` seconds.

    Two bounds. The adaptive one (:class:`_StallBound`, on by default, logged
    once set): when this rank's step computation or checkpoint write has
    lasted longer than a few times the slowest recent one (at least
    ``floor``), the rank reads every rank's position twice, ``3 * poll``
    apart, and ends the job only if a rank is stopped (process state ``T``)
    or has exited, or, where its process cannot be seen (another host, no
    ``/proc``), its heartbeat has not moved for a whole further bound. Those
    are facts about processes, not judgements of slowness, so the ranks need
    not agree on the bound: the first rank to look reports and ends the job,
    and a rank that is merely slow (its process runs) is waited for, with one
    line in the log. The first steps of a run (compile, warm-up) have no
    adaptive bound: a rank stopped in them is found by ``--timeout``. Reading
    a batch is not measured (a slow read is not a stall), but a rank stopped
    while reading is found by the ranks waiting for it. The hard bound,
    ``timeout``: a step (with its checkpoint) that lasts that long ends the
    job whatever the ranks are doing; the ranks that did not arrive are
    named.

    Ending the job: the report goes to stderr (and ``train.log`` on rank 0);
    stopped ranks on this host are SIGKILLed (a stopped process ignores the
    launcher's SIGTERM, which would keep the job alive for torchrun's 30 s
    grace), and this rank exits with status 1 so the launcher tears the job
    down.
    """

    def __init__(self, timeout: float, log: RunLog | None = None, poll: float | None = None,
                 floor: float = STALL_FLOOR):
        self.timeout = float(timeout)
        self.poll = poll if poll is not None else min(1.0, self.timeout / 10)
        self.bounds = _StallBound(self.timeout, float(floor), STALL_FACTOR, STALL_WARMUP, STALL_RECENT)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._log = log
        self._store = default_store()
        self._prefix = f"pdp_watchdog/{next(_RUNS)}/"
        self._space = _process_space()
        self._where = (0, "starting")
        self._started = time.monotonic()  # when the current attempt at step self._where[0] began: --timeout's clock
        self._span = _Span("other", 0, self._started, None)
        self._recheck: tuple = (None, math.inf, {})  # (span, when, beats): a slow span is looked at again then
        self._beat = 0
        self._halted = False
        self._wake = threading.Event()  # set by a new step or by stop(): publish now
        self._reporter = threading.Lock()  # one report per rank, from whichever thread ends the job first
        self._publish()
        self._thread = threading.Thread(target=self._watch, name="pdp-step-watchdog", daemon=True)
        self._thread.start()

    def at(self, step: int, phase: str) -> None:
        """The training thread is now in ``step`` (1-based), doing ``phase`` (READING, CHECKPOINTING or other)."""
        now = time.monotonic()
        kind = "reading" if phase == READING else "checkpoint" if phase == CHECKPOINTING else "step"
        span, new_step = self._span, step != self._where[0]
        if kind != span.kind or step != span.step:
            if span.kind in ("step", "checkpoint") and self.bounds.record(span.kind, now - span.start):
                self._say(f"watchdog: a {'step' if span.kind == 'step' else 'checkpoint write'} lasting over "
                          f"{self.bounds.bound(span.kind):.3g} s ({self.bounds.describe(span.kind)}) makes the ranks "
                          "look for a stopped or dead rank, which then ends the job")
            if kind == "reading":
                self._started = now
            self._span = _Span(kind, step, now, self.bounds.bound(kind) if kind != "reading" else None)
        self._where = (step, phase)
        if new_step:
            self._wake.set()

    def failed(self, step: int, error: BaseException) -> None:
        """The training thread raised: a collective that timed out is a stall (report it); else publish the error.

        A collective times out ``timeout`` seconds after it started, so at
        least that long after its step started: the report is the same
        whether this thread or the watchdog's sees the stall first.
        """
        if time.monotonic() - self._started >= self.timeout - self.poll:
            self._stall(self._where[0])
        self._span = _Span("other", step, time.monotonic(), None)
        self._where = (step, f"failed with {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self._publish()

    def stop(self) -> None:
        self._halted = True
        self._wake.set()
        self._thread.join()

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log.info(message)

    def _publish(self) -> None:
        self._beat += 1
        step, phase = self._where
        self._store.set(f"{self._prefix}{self.rank}", json.dumps(
            {"step": step, "phase": phase, "beat": self._beat, "host": socket.gethostname(), "space": self._space,
             "pid": os.getpid()}))

    def _positions(self) -> dict[int, dict]:
        keys = {r: f"{self._prefix}{r}" for r in range(self.world)}
        return {r: json.loads(self._store.get(k)) for r, k in keys.items() if self._store.check([k])}

    def _two_looks(self) -> tuple[dict, dict]:
        """Every rank's position, twice, ``3 * poll`` apart; this rank keeps beating meanwhile."""
        first = self._positions()
        for _ in range(3):  # keep beating while the other ranks' looks read this one
            time.sleep(self.poll)
            self._publish()
        return first, self._positions()

    def _check_at(self, span: _Span) -> float:
        if span.bound is None:
            return math.inf
        again, when, _ = self._recheck
        return when if again is span else span.start + span.bound

    def _watch(self) -> None:
        while not self._halted:
            span, now = self._span, time.monotonic()
            check_at = self._check_at(span)
            self._wake.wait(max(0.0, min(self.poll, self._started + self.timeout - now, check_at - now)))
            self._wake.clear()
            if self._halted:
                return
            self._publish()
            now = time.monotonic()
            if now - self._started >= self.timeout:
                self._stall(self._where[0])
            elif span is self._span and now >= check_at:
                self._look(span)

    def _look(self, span: _Span) -> None:
        """The adaptive bound passed: end the job if a rank is stopped or dead, else note the slow step once."""
        first, last = self._two_looks()
        if self._span is not span:  # this rank moved on: the step was slow, nothing stalled
            return
        earlier = self._recheck[2] if self._recheck[0] is span else {}
        verdicts = self._verdicts(span.step, first, last, hard=False, earlier=earlier)
        culprits = [r for r, v in verdicts.items() if v.culprit]
        what = "step" if span.kind == "step" else "checkpoint write"
        lasted = time.monotonic() - span.start
        if culprits:
            states = {"STOPPED (SIGSTOP)": "is stopped (SIGSTOP)", "EXITED": "has exited",
                      "NOT RESPONDING": "is not responding (its heartbeat stopped)"}
            why = "; ".join(f"rank {r} {states[verdicts[r].state]}" for r in culprits)
            self._end(span.step, f"[rank {self.rank}] step {span.step}: {why}. The {what} has lasted {lasted:.0f} s, past the "
                      f"watchdog's bound of {span.bound:.3g} s ({self.bounds.describe(span.kind)}); ranks that did "
                      f"not arrive: {culprits}", verdicts, last)
        if self._recheck[0] is not span:
            self._say(f"watchdog: step {span.step}'s {what} has lasted {lasted:.0f} s, past its bound of "
                      f"{span.bound:.3g} s, but no rank is stopped or dead: waiting for them (at most --timeout "
                      f"{self.timeout:g} s)\n" + self._table(verdicts, last))
        self._recheck = (span, time.monotonic() + span.bound, {r: p["beat"] for r, p in last.items()})

    def _stall(self, step: int) -> None:
        """``--timeout`` passed: report who did not arrive at ``step`` and end the job (never returns)."""
        first, last = self._two_looks()
        verdicts = self._verdicts(step, first, last, hard=True)
        culprits = [r for r, v in verdicts.items() if v.culprit]
        self._end(step, f"[rank {self.rank}] step {step} did not finish within --timeout {self.timeout:g} s; ranks that did "
                  f"not arrive: {culprits or 'none (every rank is alive and at this step: a collective mismatch?)'}",
                  verdicts, last)

    def _verdicts(self, step: int, first: dict, last: dict, hard: bool, earlier: dict | None = None
                  ) -> dict[int, _Verdict]:
        """What each rank is doing, and whether it ends the job (``hard``: under ``--timeout``, any rank behind).

        A rank's process is looked at where it can be (same host, boot and pid
        namespace; ``/proc``): stopped or exited ends the job. Elsewhere only
        its heartbeat tells whether it runs, and a heartbeat also stops while
        C code holds the GIL (a long read): under the adaptive bound such a
        rank is not responding only if its heartbeat is where it was at the
        ``earlier`` look, one bound ago.
        """
        verdicts = {}
        for r in range(self.world):
            p = last.get(r)
            if r == self.rank:
                verdicts[r] = _Verdict("waiting", False)
                continue
            if p is None:
                verdicts[r] = _Verdict("NOT RESPONDING", hard)
                continue
            frozen = first.get(r, {}).get("beat") == p["beat"]
            here = p.get("space") == self._space
            process = process_state(p["pid"]) if here else None
            if process == "stopped":
                verdicts[r] = _Verdict("STOPPED (SIGSTOP)", True, kill=True)
            elif process == "gone":
                verdicts[r] = _Verdict("EXITED", True)
            elif frozen and process is None:
                gone_quiet = hard or (earlier or {}).get(r) == p["beat"]
                verdicts[r] = _Verdict("NOT RESPONDING" if gone_quiet else "heartbeat stopped (looking again later)",
                                       gone_quiet, kill=hard and here)
            elif p["step"] < step:
                verdicts[r] = _Verdict("did not arrive", hard)
            else:
                verdicts[r] = _Verdict("waiting" if not frozen else "alive, heartbeat stopped (C code holding the GIL?)",
                                       hard and frozen)
        return verdicts

    def _table(self, verdicts: dict[int, _Verdict], last: dict) -> str:
        lines = []
        for r, verdict in verdicts.items():
            p = last.get(r)
            where = "never reported" if p is None else f"step {p['step']}, {p['phase']}"
            lines.append(f"  rank {r}: {verdict.state} ({where})")
        return "\n".join(lines)

    def _end(self, step: int, headline: str, verdicts: dict[int, _Verdict], last: dict) -> None:
        """Report (the first rank of the job to get here), SIGKILL the stopped ranks on this host, exit 1.

        Several ranks can find the stall at once. The first to end the job
        prints the report; a rank that looked while it was exiting would
        otherwise blame it ("has exited"), so the ranks agree through an
        atomic counter in the store: the others say who reports. Every rank
        still kills the stopped ranks it can see: a reporter on another host
        cannot. Never returns.
        """
        if not self._reporter.acquire(blocking=False):  # the other thread is reporting and will exit
            while True:
                time.sleep(60)
        report = f"{headline}\n{self._table(verdicts, last)}"
        try:
            first = self._store.add(f"{self._prefix}ending", 1) == 1
            if first:
                self._store.set(f"{self._prefix}report", report)
        except Exception:  # noqa: BLE001 - the store's host (rank 0 outside torchrun) is gone: the job is ending
            first = False
        if first:
            print(report, file=sys.stderr, flush=True)
            self._say(report)
        else:
            note = f"[rank {self.rank}] step {step}: another rank found the stall first and is ending the job"
            print(note, file=sys.stderr, flush=True)
            if self._log is not None and self._log.enabled:  # its report for train.log, which is rank 0's
                try:
                    self._store.wait([f"{self._prefix}report"], datetime.timedelta(seconds=5))
                    self._say(f"{note}:\n{self._store.get(f'{self._prefix}report').decode()}")
                except Exception:  # noqa: BLE001 - it exited before it could say
                    self._say(note)
        for r, verdict in verdicts.items():
            if verdict.kill:
                try:
                    os.kill(last[r]["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        sys.stdout.flush()
        os._exit(1)


class DataProgress:
    """Progress of rank 0's data generation: one line per 10 % of the samples (and the last), with the time so far.

    ``done(k)`` after the k-th of ``total`` samples prints
    ``  train: 4/16 meshes (25 %), 3.1 s`` when k crosses the next tenth;
    ``finish()`` prints the total time. Data generation takes tens of seconds
    before the first step, so the run says what it is doing meanwhile.
    """

    def __init__(self, total: int, what: str):
        self.total, self.what, self.start, self.shown = total, what, time.perf_counter(), 0

    def done(self, k: int) -> None:
        tenth = (10 * k) // max(self.total, 1)
        if tenth > self.shown or k == self.total:
            self.shown = tenth
            print(f"  {k}/{self.total} {self.what} ({100 * k // max(self.total, 1)} %), "
                  f"{time.perf_counter() - self.start:.1f} s", flush=True)  # fmt: skip

    def finish(self) -> None:
        print(f"  {self.what}: done in {time.perf_counter() - self.start:.1f} s", flush=True)


def cosine_schedule(optimizer, steps: int, warmup: int = 5):
    """Linear warm-up, then cosine decay to 5 % of the peak over ``steps``."""

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        progress = min((k - warmup) / max(steps - warmup, 1), 1.0)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_training(args: argparse.Namespace, context: MeshContext, make_model: Callable[[], torch.nn.Module],
                   optimizer_class: type[torch.optim.Optimizer]) -> tuple:
    """``(model, optimizer, scheduler)``, everything a checkpoint restores, on any layout.

    The model is made right after seeding with ``--seed``, so every layout
    (and one process) starts from the same weights, and parallelized
    (synchronized from rank 0, then DDP / FSDP2 on the ddp axis) before the
    optimizer is built over the parameters that training will update.
    """
    torch.manual_seed(args.seed)
    model = parallelize_model(make_model().to(context.device), context)
    if getattr(args, "compile", None):
        compile_model(model, args.compile)
    optimizer = optimizer_class(model.parameters(), lr=args.lr)
    return model, optimizer, cosine_schedule(optimizer, args.steps)


def compile_model(model: torch.nn.Module, backend: str = "inductor") -> None:
    """``--compile``: compile ``model`` in place (its ``state_dict`` and checkpoints keep their keys).

    Under DDP the wrapped module is compiled (DDP's hooks stay outside the
    graph; FSDP2 shards in place, so its model is the module itself). A model
    with a ``compile_regions()`` method compiles its own parts: ring attention
    (a sequence-sharded ``scaled_dot_product_attention``) runs eagerly, so a
    transformer compiles the layers around it and calls the attention between them.
    """
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if hasattr(inner, "compile_regions"):
        inner.compile_regions(backend)
    else:
        compile_forward(inner, backend)


def compile_forward(module: torch.nn.Module, backend: str = "inductor", fullgraph: bool = False) -> None:
    """Compile ``module.forward`` in place: parameter names (``state_dict``) stay as they are.

    Not ``module.compile()``: torch 2.13 compiles the module's ``_call_impl``
    then, and tracing it from there Dynamo steps into ShardTensor's
    ``__torch_function__`` and breaks the graph on every sharded input
    (``torch.compile(module)``, which renames the parameters, does not).
    ``dynamic=False``: modules of one class share ``forward``'s code, and a
    second shape would otherwise make Dynamo retrace with symbolic sizes,
    which a ShardTensor's layout (plain ints) cannot hold.
    """
    module.forward = torch.compile(module.forward, backend=backend, fullgraph=fullgraph, dynamic=False)


def plain_replica(model: torch.nn.Module, make_model: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A plain one-process copy of a parallelized ``model`` (bare, DDP or FSDP2): its full weights in ``make_model()``.

    Collective (FSDP2 all-gathers its shards); every rank gets the copy, in
    eval mode. For comparisons with one process that must not communicate,
    e.g. a sample recomputed on plain tensors on rank 0 alone.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    replica = make_model()
    replica.load_state_dict(state)
    return replica.eval()


# --------------------------------------------------------------------------- #
# Plots (rank 0)
# --------------------------------------------------------------------------- #
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_loss(path: Path, losses: list[float], title: str, test_loss: float | None = None) -> Path:
    """The loss per step, log scale (and the final test loss as a point)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(range(1, len(losses) + 1), losses, label="training")
    if test_loss is not None:
        ax.semilogy([len(losses)], [test_loss], "o", color="C3", label=f"test ({test_loss:.3g})")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, path)


def save_figure(fig, path: Path, title: str | None = None) -> Path:
    """Lay ``fig`` out, write it to ``path`` (PNG) and free it; ``title`` above all panels."""
    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def field_panel(fig, ax, image, name: str) -> None:
    """A field panel's frame: its name, no ticks, a colour bar."""
    ax.set_title(name, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)


def plot_fields(path: Path, panels: dict, title: str, row_splits=(), same_scale=()) -> Path:
    """2-D fields side by side (``{name: array}``); dashed lines mark the rows where ranks' shards meet.

    Panels named in ``same_scale`` share one colour scale (truth and prediction).
    """
    plt = _pyplot()
    limits = _limits({n: panels[n] for n in same_scale})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6))
    for ax, (name, field) in zip(axes, panels.items()):
        vmin, vmax = limits if name in same_scale else (None, None)
        image = ax.imshow(field, origin="upper", cmap="viridis", vmin=vmin, vmax=vmax)
        for row in row_splits:
            ax.axhline(row - 0.5, color="w", linestyle="--", linewidth=0.8)
        field_panel(fig, ax, image, name)
    return save_figure(fig, path, title)


def plot_points(path: Path, points, panels: dict, owner, title: str, same_scale=(), slab=(0.35, 0.65)) -> Path:
    """Per-point values (``{name: values}``) on the points of a z-slab, then which rank held each point.

    Panels named in ``same_scale`` share one colour scale.
    """
    from physicsnemo_dp.debug.viz import plot_point_partition

    plt = _pyplot()
    points = torch.as_tensor(points)
    keep = (points[:, 2] > slab[0]) & (points[:, 2] < slab[1])
    xy = points[keep, :2]
    values = {name: torch.as_tensor(v)[keep] for name, v in panels.items()}
    limits = _limits({n: values[n] for n in same_scale})
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.8 * (len(panels) + 1), 3.6))
    for ax, (name, v) in zip(axes, values.items()):
        vmin, vmax = limits if name in same_scale else (None, None)
        scatter = ax.scatter(xy[:, 0], xy[:, 1], c=v, s=6, cmap="viridis", vmin=vmin, vmax=vmax)
        ax.set_aspect("equal")
        ax.set_title(name, fontsize=9)
        fig.colorbar(scatter, ax=ax, fraction=0.046, pad=0.04)
    plot_point_partition(points.numpy(), torch.as_tensor(owner).numpy(), ax=axes[-1],
                         title="owning rank (Hilbert-curve ranges)")
    return save_figure(fig, path, title)


def _limits(arrays: dict) -> tuple:
    """One (min, max) over all ``arrays`` (``(None, None)`` for none): a shared colour scale."""
    if not arrays:
        return None, None
    values = [torch.as_tensor(a) for a in arrays.values()]
    return min(float(v.min()) for v in values), max(float(v.max()) for v in values)


# --------------------------------------------------------------------------- #
# A training example's run: opened and closed the same way in every example
# --------------------------------------------------------------------------- #
@contextmanager
def open_run(args: argparse.Namespace, context: MeshContext | None, name: str,
             setup: str) -> Iterator[tuple[MeshContext, Path, RunLog]]:
    """``with open_run(...) as (context, out, log):`` the run's mesh, output folder and log; the run owns ``--out``.

    For the whole block the run holds ``OUT/run.lock`` (:func:`_owning_output`):
    a second run on the same folder is refused on every rank, naming the
    holder; the lock and the log are released when the block ends, also when
    it raises. ``context`` is passed by callers that already hold a mesh (the
    tests); without it the mesh comes from the flags. Every example's log
    starts with the same mesh line, so any run's layout can be read off its
    log (and the torchrun tests look for it); ``setup`` describes the
    example's data.
    """
    context = context or build_context(args)
    _flags.check_layout(args, context)
    with _owning_output(Path(args.out).resolve()) as taken_over:
        out = prepare_output(args)
        log = RunLog(out, name, args)
        try:
            if taken_over is not None:
                log.info(taken_over)
            log.info(f"mesh (ddp={context.ddp_size}, domain={context.domain_size}) on {context.device}, "
                     f"strategy={args.strategy}, {setup}, global batch {args.batch_size}"
                     + ("" if args.amp == "off" else f", --amp {args.amp} (autocast on {context.device.type})"))
            yield context, out, log
        finally:
            log.close()


def close_run(context: MeshContext, args: argparse.Namespace, out: Path, log: RunLog, *, title: str,
              losses: list[float], test_loss: float, plot_prediction: Callable[[Path], Path], pipes: tuple,
              model, optimizer) -> dict:
    """Rank 0 draws ``loss.png`` and ``prediction.png`` and logs where; every rank closes the log and ``pipes``.

    ``title`` names the model (the loss plot adds the layout);
    ``plot_prediction(path)`` draws the example's own picture of a test
    sample, and is called on rank 0 only, so the other ranks build no figure.
    Returns the run's result, the same keys for every example: the losses, the
    test loss, the output folder, the plots (empty off rank 0), the model and
    its optimizer (for callers that continue from them).
    """
    files = {}
    if dist.get_rank() == 0:
        layout = f"mesh (ddp={context.ddp_size}, domain={context.domain_size}), {args.strategy}"
        files["loss"] = plot_loss(out / "loss.png", losses, f"{title}, {layout}", test_loss=test_loss)
        files["prediction"] = plot_prediction(out / "prediction.png")
        for name, path in files.items():
            log.info(f"{name} plot: {path}")
    log.close()
    for pipe in pipes:
        pipe.close()
    return {"losses": losses, "test_loss": test_loss, "out": out, "files": files, "model": model,
            "optimizer": optimizer}


# --------------------------------------------------------------------------- #
# The minimal examples: torchrun, or ranks started here
# --------------------------------------------------------------------------- #
def on_ranks(fn: Callable, nprocs: int = 4, show: str | None = None):
    """Run ``fn(mesh)`` on every rank: under torchrun on its ranks, else on ``nprocs`` launched ones.

    Returns rank 0's result (on rank 0; None elsewhere), printed after
    ``show`` if given. ``--device cuda`` on the command line selects NCCL and
    one GPU per rank. The mesh is 1-D, named ``"domain"``.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nprocs", type=_flags.integer(1), default=nprocs, help="ranks to start without torchrun")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "WORLD_SIZE" not in os.environ:
        result = launch(fn, nprocs=args.nprocs, backend=backend)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        try:
            result = fn(init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("domain",)))
        finally:
            rank = dist.get_rank()
            dist.destroy_process_group()
        if rank != 0:
            return None
    if show is not None:
        # one write: under torchrun the ranks share stdout, and print(a, b) writes its pieces one by one,
        # so another rank's line could land inside this one
        sys.stdout.write(f"{show} {result}\n")
        sys.stdout.flush()
    return result
