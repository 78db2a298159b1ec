"""I/O benchmark: the pipe's per-rank read throughput against bare ``h5py`` ``read_direct``.

    .venv/bin/python benchmarks/io_bench.py                      # defaults: 2 ranks, 8 samples of 2 x 2048^2
    .venv/bin/python benchmarks/io_bench.py --world-size 1 --layouts contiguous chunked gzip --epochs 9

For each HDF5 layout (contiguous, chunks aligned with the rank slabs, and
optionally gzip on the same chunks) every rank reads its slab of every
sample, first with a bare loop of ``Dataset.read_direct`` into preallocated
buffers (the floor the pipe is compared with), then with :class:`DomainPipe`
reading in the caller (``prefetch=0``), in a background thread and in a
reader process (adaptive: reading ahead only while the consumer's step can
hide a read), and in the two background readers with ``adaptive_prefetch=False``
(``-always``). Each measured regime (no step, each step kind) has its own
pipe, as a training run's consumer keeps one regime. Reported per rank and mode:

* ``ratio``: pipe throughput / bare throughput with nothing else to do (1.0 =
  as fast as bare reads; the target is >= 0.9);
* ``cpu``: bare CPU time / the pipe's CPU time (training process and reader
  process together), which does not depend on how busy the machine is;
* with a simulated training step of ``--step-ms`` per batch, the epoch time
  against the serial ``bare read + step`` and the ideal ``max(read, step)``.
  The step sleeps (``sleep``: the GIL is free, like waiting on a GPU), spins
  in Python (``python``: the GIL is held, like launching kernels), or reads
  another HDF5 file (``h5py``: like writing outputs or reading a validation
  set in the training process). The last two are where a reader thread and
  a reader process differ.

All ranks run each measurement at the same time (a barrier before each), as in
training; each figure is the median of three interleaved repetitions, each the
fastest of its share of ``--epochs`` epochs, after a warm-up (see
``benchmarks/_timing.py``; :func:`measure` returns the repetitions, the
standalone report prints their medians). Files live in ``--dir`` and are read
from the page cache, so the figures measure the software path, not the disk.
Results are printed and written as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import h5py
import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datapipes import DomainDecomposition, DomainPipe, HDF5Fields, Split, aligned_chunks  # noqa: E402
from datapipes._buffers import HugePages, private_memory  # noqa: E402
from datapipes.synthetic import heat_equation, write_hdf5  # noqa: E402
from benchmarks._timing import REPETITIONS, fastest, fastest_by, split_rounds  # noqa: E402

VARIABLES = ("u0", "u")
MODES = {"inline": dict(prefetch=0), "thread": dict(prefetch=2, workers="thread"),
         "process": dict(prefetch=2, workers="process"),
         # reading ahead even with nothing to hide behind: what the adaptive default avoids
         "thread-always": dict(prefetch=2, workers="thread", adaptive_prefetch=False),
         "process-always": dict(prefetch=2, workers="process", adaptive_prefetch=False)}


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks (one domain, gloo)")
    parser.add_argument("--size", type=int, default=2048, help="grid edge: samples are size x size float32")
    parser.add_argument("--samples", type=int, default=8, help="samples in each file")
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "chunked"],
                        choices=["contiguous", "chunked", "gzip", "checksummed"])
    parser.add_argument("--epochs", type=int, default=6,
                        help="timed epochs per measurement, split into 3 repetitions (the median of their fastest counts)")
    parser.add_argument("--throughput-epochs", type=int, default=60,
                        help="timed epochs of the runs without a step (bare and each mode), split alike into the 3 "
                             "repetitions: such an epoch takes ~10 ms at P = 2, so a repetition of a few of them is "
                             "at the mercy of one scheduler hiccup")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="simulated training step per batch (default: the bare read time of a batch after an idle step, times the ranks per core)")
    parser.add_argument("--steps", nargs="*", default=list(STEPS), choices=STEPS,
                        help="simulated training steps to run with each mode (none: throughput only)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path("io_bench.json"), help="JSON results")
    return parser.parse_args(argv)


def _write_files(args, directory: Path) -> dict[str, Path]:
    fields = heat_equation(args.samples, (args.size, args.size), seed=0)
    dec = DomainDecomposition((args.size, args.size), (args.world_size,))
    chunks = aligned_chunks(dec, itemsize=4)
    options = {"contiguous": {"checksums": False}, "chunked": {"chunks": chunks, "checksums": False},
               "gzip": {"chunks": chunks, "compression": "gzip", "checksums": False},
               "checksummed": {"chunks": chunks}}  # chunked + Fletcher-32 per chunk, verified on read
    return {layout: write_hdf5(directory / f"{layout}.h5", fields, **options[layout])[0] for layout in args.layouts}


def _bare_epoch(dsets: list[h5py.Dataset], buffers: list[np.ndarray], box, samples, huge=()) -> float:
    """Seconds to read this rank's slab of every sample with read_direct into preallocated buffers.

    ``huge``: the buffers' :class:`~datapipes._buffers.HugePages`, restored after a fork as the pipe restores its
    own after a read (the pipes' reader processes fork this rank), so both sides copy into huge pages."""
    start = time.perf_counter()
    for i in samples:
        for dset, buf in zip(dsets, buffers):
            dset.read_direct(buf, source_sel=(i, *box))
    for pages in huge:  # after the writes, which are what split the pages after a fork
        pages.restore()
    return time.perf_counter() - start


def _read_after_idle(dsets: list[h5py.Dataset], buffers: list[np.ndarray], box, samples, idle_s: float,
                     rounds: int = REPETITIONS) -> np.ndarray:  # fmt: skip
    """Seconds of one batch's bare read when it follows ``idle_s`` of idling, as a prefetching reader meets its
    reads (it waits through the consumer's step, then reads), every rank at once as in training: an array of
    ``rounds`` passes over ``samples`` (one row per pass)."""
    times = np.empty((rounds, len(samples)))
    dist.barrier()
    for round_ in range(rounds):
        for j, i in enumerate(samples):
            time.sleep(idle_s)
            start = time.perf_counter()
            for dset, buf in zip(dsets, buffers):
                dset.read_direct(buf, source_sel=(i, *box))
            times[round_, j] = time.perf_counter() - start
    return times


STEPS = ("sleep", "python", "h5py")


def _step(kind: str, seconds: float, other: h5py.Dataset, buf: np.ndarray) -> None:
    """Busy the training process for ``seconds`` in the way ``kind`` says."""
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if kind == "h5py":
            other.read_direct(buf)


def _pipe_epoch(pipe: DomainPipe, step: tuple | None) -> float:
    start = time.perf_counter()
    for batch in pipe:
        if step is not None:
            _step(*step)
        del batch
    return time.perf_counter() - start


def _steady_step(batches, step: tuple) -> float:
    """Seconds per training step once the first batch is in: the first read overlaps with nothing.

    ``batches`` yields the data (the pipe, or arrays already in memory); each
    is handed to the simulated ``step`` and dropped, as a training loop does.
    """
    iterator = iter(batches)
    first = next(iterator)
    _step(*step)
    del first
    start, n = time.perf_counter(), 0
    for batch in iterator:
        _step(*step)
        del batch
        n += 1
    return (time.perf_counter() - start) / max(n, 1)


def _overlap(pipes: dict, memory: list, kinds, step_s: float, other, epochs: int) -> dict:
    """``{kind: {"memory" or mode: seconds per repetition}}``: steady step time on data in memory and with each
    prefetching pipe.

    ``pipes`` maps ``(mode, kind)`` to the pipe that runs that step kind.
    Interleaved epochs, all ranks starting together, in repetitions as
    :func:`benchmarks._timing.fastest_by` runs them (each keeps its fastest epoch).
    """
    reps, per_rep = split_rounds(epochs)
    best: dict = {kind: {} for kind in kinds}
    for round_ in range(reps * per_rep + 1):  # the first round warms up
        for kind in kinds:
            step = (kind, step_s, other, np.empty(1 << 16))
            sources = {"memory": memory, **{m: p for (m, k), p in pipes.items() if k == kind and m != "inline"}}
            for name, batches in sources.items():
                dist.barrier()
                seconds = _steady_step(batches, step)
                if round_:
                    times = best[kind].setdefault(name, np.full(reps, np.inf))
                    times[(round_ - 1) // per_rep] = min(times[(round_ - 1) // per_rep], seconds)
    return best


def _ranks_per_core(mesh) -> int:
    """How many ranks of this machine share a core when all read at once (at least 1).

    The bare read time is a rank's fastest epoch, in which it rarely had to
    share a core; with more ranks than cores every rank's reader gets only a
    share, so a batch's reads for all ranks take this many times longer. A
    simulated step shorter than that leaves no time to hide the reads in,
    whatever the reader: the cores are busy reading.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size()))  # ranks on this machine
    return max(1, -(-local // cores))


def _cpu_seconds() -> float:
    """CPU time used so far by this process (all threads) and its live children (the reader process).

    Children are read from ``/proc/<pid>/schedstat`` (nanoseconds; Linux), not
    from their tick-counted ``cpu_times``, whose 10 ms steps would swamp an epoch.
    """
    children = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(OSError):
            children += int(Path(f"/proc/{child.pid}/schedstat").read_text().split()[0])
    return time.process_time() + children / 1e9


def measure(mesh, args, paths: dict[str, Path], scratch: str) -> dict:
    """This rank's figures for every layout: bare and pipe epoch times, ratios, simulated steps.

    ``args`` needs ``epochs``, ``step_ms`` and ``steps`` (the simulated step
    kinds to run; none for the plain throughput comparison), optionally
    ``throughput_epochs`` (those of the runs without a step; default
    ``epochs``) and ``step_factor`` (the step lasts that many bare reads of a batch, times
    the ranks per core (see :func:`_ranks_per_core`), when
    ``step_ms`` is None; default 1; a read timed as a prefetching reader
    meets it, right after an idle step, or back to back if that is slower:
    :func:`_read_after_idle`); ``scratch`` is a path prefix for the
    file the ``h5py`` step reads. With steps, each prefetching mode also
    reports ``<kind>_steady_step_ms`` (a step's time once the first batch is
    in) and ``<kind>_step_vs_memory``, that over the same step's on data
    already in memory (``<kind>_steady_step_memory_ms``; 1.0 = reading fully hidden).
    """
    rank = dist.get_rank()
    with h5py.File(f"{scratch}.rank{rank}.h5", "w") as f:  # what the "h5py" step reads
        f["x"] = np.zeros(1 << 16)
    mine = {}
    for layout, path in paths.items():
        source = HDF5Fields(path, VARIABLES)
        box = source.decompose(0, (mesh.size(),), Split())["u"].box(mesh.get_local_rank())
        samples = list(range(len(source)))
        slab_bytes = len(VARIABLES) * int(np.prod([s.stop - s.start for s in box])) * 4 * len(samples)
        shape = tuple(s.stop - s.start for s in box)
        # the pipe's buffers' memory (huge pages, never recycled heap memory: see datapipes/_buffers.py), so the
        # ratio compares the software paths and not where malloc happened to place each side's buffers
        buffers = [private_memory(4 * math.prod(shape)).view(np.float32).reshape(shape) for _ in VARIABLES]
        pipes = {(mode, kind): DomainPipe(source, mesh, shuffle=False, **options)
                 for mode, options in MODES.items() for kind in (None, *args.steps)}
        with h5py.File(path, "r") as f, h5py.File(f"{scratch}.rank{rank}.h5", "r") as other:
            dsets = [f[v] for v in VARIABLES]
            runs = {"bare": partial(_bare_epoch, dsets, buffers, box, samples, [HugePages(b) for b in buffers])}
            back_to_back = fastest(runs, args.epochs)["bare"] / len(samples)  # per repetition
            factor = getattr(args, "step_factor", 1.0) * _ranks_per_core(mesh)
            # the step lasts `factor` reads of a batch as a prefetching reader meets them: after an idle step
            # (here 0.9-1.7x a back-to-back read), or back to back if that is slower
            idle = _read_after_idle(dsets, buffers, box, samples, factor * float(np.median(back_to_back)))
            read = max(float(np.median(back_to_back)), float(np.median(idle)))  # the median of every read after idling
            step_s = (args.step_ms / 1000) if args.step_ms is not None else factor * read
            stepped = {}
            for (mode, kind), pipe in pipes.items():
                if kind is None:
                    runs[mode] = partial(_pipe_epoch, pipe, None)
                else:
                    stepped[f"{mode}+{kind}"] = partial(_pipe_epoch, pipe, (kind, step_s, other["x"], np.empty(1 << 16)))
            clocks = (time.perf_counter, _cpu_seconds)
            # an epoch without a step lasts ~10 ms at P = 2: a repetition keeps the fastest of many (see _args)
            timed = fastest_by(runs, getattr(args, "throughput_epochs", args.epochs), clocks)
            timed.update(fastest_by(stepped, args.epochs, clocks))
            best = {name: wall for name, (wall, _) in timed.items()}
            cpu = {name: used for name, (_, used) in timed.items()}
            memory = [[b.copy() for b in buffers] for _ in samples]  # the data "already in memory"
            kinds = args.steps if len(samples) > 1 else ()  # a steady step needs a batch after the first
            overlap = _overlap({(m, k): p for (m, k), p in pipes.items() if k is not None},
                               memory, kinds, step_s, other["x"], args.epochs)
        for pipe in pipes.values():
            pipe.close()
        bare = best["bare"]
        serial = bare + step_s * len(samples)
        row = {"slab_MiB_per_epoch": slab_bytes / 2**20, "bare_s": bare, "bare_MiB_s": slab_bytes / bare / 2**20,
               "bare_cpu_s": cpu["bare"], "step_ms": step_s * 1000, "read_after_idle_ms": np.median(idle, axis=1) * 1000,
               "read_back_to_back_ms": back_to_back * 1000,
               "ideal_speedup_vs_serial": serial / np.maximum(bare, step_s * len(samples)), "modes": {}}
        for kind in overlap:
            row[f"{kind}_steady_step_memory_ms"] = overlap[kind]["memory"] * 1000
        for mode in MODES:
            row["modes"][mode] = {"epoch_s": best[mode], "ratio": bare / best[mode], "cpu_s": cpu[mode],
                                  "cpu_ratio": cpu["bare"] / cpu[mode]}
            for kind in args.steps:
                row["modes"][mode][f"{kind}_step_epoch_s"] = best[f"{mode}+{kind}"]
                row["modes"][mode][f"{kind}_step_speedup_vs_serial"] = serial / best[f"{mode}+{kind}"]
                if mode in overlap.get(kind, {}):
                    row["modes"][mode][f"{kind}_steady_step_ms"] = overlap[kind][mode] * 1000
                    row["modes"][mode][f"{kind}_step_vs_memory"] = overlap[kind][mode] / overlap[kind]["memory"]
        mine[layout] = row
    return mine


def _rank(rank: int, args, paths: dict[str, Path], store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size,
                           store=dist.FileStore(store, args.world_size), timeout=datetime.timedelta(minutes=10))
    mesh = init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("domain",))
    mine = _medians(measure(mesh, args, paths, store))
    everyone = [None] * args.world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(store + ".json").write_text(json.dumps({str(r): v for r, v in enumerate(everyone)}))
    dist.barrier()
    dist.destroy_process_group()


def _medians(row):
    """``row`` (nested dicts) with each per-repetition array replaced by its median, for JSON and printing."""
    if isinstance(row, dict):
        return {k: _medians(v) for k, v in row.items()}
    return float(np.median(row)) if isinstance(row, np.ndarray) else row


def _report(args, results: dict) -> str:
    lines = [f"{args.world_size} rank(s), {args.samples} samples of {len(VARIABLES)} x {args.size}^2 float32, "
             f"median of 3 repetitions of {args.epochs} epochs in all, files in the page cache"]
    for layout in args.layouts:
        lines.append(f"\n{layout}:")
        steps = " ".join(f"{kind + ' x':>9}" for kind in args.steps)
        lines.append(f"  {'rank':>4} {'mode':>8} {'ratio':>6} {'cpu':>5} {'MiB/s':>8}   step: {steps} {'ideal x':>8}")
        for rank, per in results.items():
            row = per[layout]
            lines.append(f"  {rank:>4} {'bare':>8} {1.0:6.2f} {1.0:5.2f} {row['bare_MiB_s']:8.0f}   "
                         f"({row['step_ms']:.1f} ms/batch)")
            for mode, m in row["modes"].items():
                speedups = " ".join(f"{m[f'{kind}_step_speedup_vs_serial']:9.2f}" for kind in args.steps)
                lines.append(f"  {rank:>4} {mode:>8} {m['ratio']:6.2f} {m['cpu_ratio']:5.2f} "
                             f"{row['bare_MiB_s'] * m['ratio']:8.0f}         {speedups} {row['ideal_speedup_vs_serial']:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _args(argv)
    with tempfile.TemporaryDirectory(prefix="io_bench-") as scratch:
        directory = args.dir or Path(scratch)
        paths = _write_files(args, directory)
        store = os.path.join(scratch, "store")
        mp.start_processes(_rank, args=(args, paths, store), nprocs=args.world_size, start_method="spawn")
        results = json.loads(Path(store + ".json").read_text())
    print(_report(args, results))
    print(f"load average after the run (other processes compete for the cores): {os.getloadavg()}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                                    "ranks": results}, indent=2))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
