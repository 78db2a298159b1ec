"""Rows sorted by ``(key, index)`` in one process under a memory budget: sorted runs spilled to HDF5.

The same bucket idea as the parallel sample sort (:mod:`datapipes._sample_sort`),
with *runs on disk* in place of ranks and *buckets processed one after the
other* in place of ranks' buckets:

1. each chunk of input rows (small enough for the budget) is sorted by
   ``(key, index)`` and written as a run to a temporary HDF5 file, with
   regularly spaced samples kept in memory;
2. splitters drawn from all samples cut the key space into buckets of about
   one chunk each; every run's bucket boundaries are found by a binary
   search between its two neighbouring samples (a short read);
3. bucket by bucket, the slices of every run are read, merged by a local
   sort and handed to ``emit`` in global order.

Every row is written once and read once; memory holds one chunk or one
bucket, plus the samples. Ordering by ``(key, index)`` equals a stable
argsort of the keys over the whole input (see :mod:`datapipes._sample_sort`).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import h5py
import numpy as np

from ._sample_sort import choose_splitters, lex_bounds, lex_order, regular_samples

__all__ = ["external_sort"]

_SAMPLES_PER_BUCKET = 16  # per run and per expected bucket: bucket sizes within ~1/16 of a run of the target


def external_sort(chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], max_rows: int,
                  emit: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None], *, directory=None,
                  bar=None) -> int:
    """Sort the rows of ``chunks`` (each ``(keys, index, payload)``) and ``emit(start, keys, index, payload)``
    them in order, in buckets of about ``max_rows`` rows. Returns the number of rows."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".datapipes-sort-") as tmp, \
            h5py.File(Path(tmp) / "runs.h5", "w") as f:
        runs, samples, total = [], [], 0
        for keys, index, payload in chunks:
            order = lex_order(keys, index)
            name = f"run{len(runs)}"
            group = f.create_group(name)
            keys, index = keys[order], index[order]
            group["keys"], group["index"], group["payload"] = keys, index, payload[order]
            runs.append(group)
            total += len(keys)
            samples.append(_samples(keys, index, max_rows))
            if bar is not None:
                bar.update(len(keys))
            del keys, index, payload, order
        if not runs:
            return 0
        buckets = max(1, math.ceil(total / max(1, max_rows)))
        keys = np.concatenate([s[1] for s in samples])
        index = np.concatenate([s[2] for s in samples])
        split_keys, split_index = choose_splitters(keys, index, buckets)
        bounds = [_run_bounds(run, sample, split_keys, split_index) for run, sample in zip(runs, samples)]
        start = 0
        for b in range(buckets):
            pieces = [(run, bound[b], bound[b + 1]) for run, bound in zip(runs, bounds) if bound[b + 1] > bound[b]]
            if not pieces:
                continue
            keys = np.concatenate([run["keys"][a:z] for run, a, z in pieces])
            index = np.concatenate([run["index"][a:z] for run, a, z in pieces])
            payload = np.concatenate([run["payload"][a:z] for run, a, z in pieces])
            order = lex_order(keys, index)
            emit(start, keys[order], index[order], payload[order])
            start += len(order)
            del keys, index, payload, order
        return total


def _samples(keys: np.ndarray, index: np.ndarray, max_rows: int):
    """Positions and values of regular samples of a run: every ``max_rows / 16`` rows at most."""
    count = max(1, math.ceil(len(keys) * _SAMPLES_PER_BUCKET / max(1, max_rows)))
    positions = (np.arange(min(count, len(keys)), dtype=np.int64) * len(keys)) // max(1, min(count, len(keys)))
    sk, si = regular_samples(keys, index, count)
    return positions, sk, si


def _run_bounds(run: h5py.Group, sample, split_keys: np.ndarray, split_index: np.ndarray) -> list[int]:
    """Bucket boundaries in one run: locate each splitter between two samples, then search that slice."""
    positions, sk, si = sample
    n = run["keys"].shape[0]
    after = lex_bounds(sk, si, split_keys, split_index)  # first sample >= splitter
    out = [0]
    for j, k in enumerate(after):
        lo = int(positions[k - 1]) if k > 0 else 0
        hi = int(positions[k]) if k < len(positions) else n
        keys, index = run["keys"][lo:hi], run["index"][lo:hi]
        out.append(lo + int(lex_bounds(keys, index, split_keys[j:j + 1], split_index[j:j + 1])[0]))
    out.append(n)
    return out
