"""I/O: the datapipe's per-rank read throughput against bare ``h5py`` ``read_direct`` (target >= 0.9).

The measurement is :func:`benchmarks.io_bench.measure` (see that module, which
also runs standalone with more options): every rank reads its slab of every
sample of a contiguous and a chunked HDF5 file (chunks aligned with the rank
slabs), first with a bare ``read_direct`` loop into preallocated buffers, then
through :class:`datapipes.DomainPipe` without prefetch (``inline``) and with
prefetch in a reader thread and in a reader process (the default
``adaptive_prefetch``: it reads in the caller while the consumer leaves no time
to hide a read behind, as in the throughput runs), and once more with
``adaptive_prefetch=False`` (rows "prefetch always", without targets: the cost
of reading ahead with nothing to overlap). Files are read from the
page cache after a warm-up epoch: the figures measure the software path, not
the disk. Ratio = pipe throughput / bare throughput, averaged over ranks, by
two clocks: wall time, and CPU time of the rank and its reader process
together (which does not depend on how busy the machine is).

Files are written by rank 0 to a temporary directory that every rank must see
(one machine; on several nodes point ``TMPDIR`` at a shared file system), and
flushed (``os.sync``) before any timing: the kernel otherwise writes the
512 MiB back to disk while the first layout is measured, which took its
pipe / bare ratios down by about 0.1 at P = 1 (0.88 -> 0.92-0.97 for the
contiguous file, the one measured first, in the same conditions).

Every figure is the median of three interleaved repetitions (see
``benchmarks/_timing.py``): ``epochs`` is split among them.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from . import io_bench
from ._record import Result, over_ranks

SUITE = "io"
_LAYOUTS = ("contiguous", "chunked")
_MODES = {"inline": "no prefetch", "thread": "prefetch, reader thread", "process": "prefetch, reader process",
          "thread-always": "prefetch always, reader thread", "process-always": "prefetch always, reader process"}
#: The simulated training step lasts this many bare reads of a batch: a step that
#: computes longer than a read takes, so that prefetching can hide the read entirely.
#: The read is timed as a prefetching reader meets it, after an idle step: here that
#: takes 1.4-1.7x a read back to back (reported), even for a bare reader thread, so a
#: step of twice the back-to-back read leaves ~20 % slack instead of the 100 % meant.
_STEP_FACTOR = 2.0


def sizes(tiny: bool, scale: float) -> dict:
    if tiny:
        return dict(size=32, samples=2, epochs=1, throughput_epochs=1)
    # an epoch without a step takes 10-25 ms here: a repetition keeps the fastest of 20 of them
    return dict(size=int(2048 * scale), samples=8, epochs=9, throughput_epochs=60)


def _files(P: int, size: int, samples: int) -> tuple[Path, dict[str, Path]]:
    """Rank 0 writes the files; every rank gets the directory and the paths."""
    shared = [None]
    if dist.get_rank() == 0:
        directory = Path(tempfile.mkdtemp(prefix="io_suite-"))
        layout = argparse.Namespace(world_size=P, size=size, samples=samples, layouts=list(_LAYOUTS))
        shared = [(directory, io_bench._write_files(layout, directory))]
        os.sync()  # the files' writeback to disk must not run during the measurement (see the module docstring)
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


@contextlib.contextmanager
def _children_allowed():
    """Let this rank start processes (the pipe's reader process) although launch() made it daemonic.

    multiprocessing refuses children of daemonic processes; the reader is
    itself daemonic and closed with its pipe, so nothing outlives the rank.
    """
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def run(mesh, size: int, samples: int, epochs: int, throughput_epochs: int, compare_dtensor: bool = False
        ) -> list[Result]:  # fmt: skip
    P = mesh.size()
    directory, paths = _files(P, size, samples)
    try:
        args = argparse.Namespace(epochs=epochs, throughput_epochs=throughput_epochs, step_ms=None, steps=("sleep",),
                                  step_factor=_STEP_FACTOR)  # fmt: skip
        with _children_allowed():
            rows = io_bench.measure(mesh, args, paths, str(directory / "scratch"))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    results = []
    for layout, row in rows.items():
        slab = row["slab_MiB_per_epoch"]
        results.append(Result(SUITE, f"{layout}: a batch's bare read after an idle step / back to back", P,
                              over_ranks(row["read_after_idle_ms"]), over_ranks(row["read_back_to_back_ms"]), "ms"))
        for mode, label in _MODES.items():
            m = row["modes"][mode]
            forced = mode.endswith("-always")  # shown for comparison: the default is adaptive
            clocks = (("wall", m["epoch_s"], row["bare_s"]), ("CPU", m["cpu_s"], row["bare_cpu_s"]))
            for clock, pipe_s, bare_s in clocks:
                unit = "MiB/s" if clock == "wall" else "MiB per CPU s"
                results.append(Result(SUITE, f"{layout}, {label}, {clock}: pipe / bare read_direct", P,
                                      over_ranks(slab / pipe_s) / P, over_ranks(slab / bare_s) / P, unit,
                                      None if forced else (">=", 0.9)))  # fmt: skip
            if "sleep_steady_step_ms" in m and not forced:  # the slowest rank's step, as training waits for it
                results.append(Result(SUITE, f"{layout}, {label}, step time with the pipe / data in memory", P,
                                      over_ranks(m["sleep_steady_step_ms"], "max"),
                                      over_ranks(row["sleep_steady_step_memory_ms"], "max"), "ms",
                                      ("<=", 1.05)))  # fmt: skip
    return results
