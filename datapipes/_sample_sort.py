"""Rows sorted by ``(key, index)`` across ranks: a parallel sample sort with one all-to-all of the rows.

A *row set* is ``(keys, index, payload)``: ``uint64`` sort keys, ``int64``
original row numbers (unique), and a ``uint8`` ``(n, row_bytes)`` payload
holding the row's arrays (:func:`pack`). Ordering by the pair
``(key, index)`` is exactly the order of numpy's stable ``argsort`` of the
keys over the whole input, because a stable sort breaks ties by original
position: so a sort on many ranks, or in chunks on disk, gives the same
permutation as ``np.argsort(keys, kind="stable")`` in one process.

:func:`sample_sort`: every rank sorts its rows, draws regularly spaced
samples, all ranks gather the samples (equal sizes, so a plain all-gather)
and pick the same ``P - 1`` splitters; rows travel once, in one
``all_to_all_single`` of packed bytes, to the rank whose bucket holds them,
which merges them by a local sort. Rank ``r`` then holds the ``r``-th
contiguous range of the global order. Buffers are numpy arrays shared with
the torch tensors the collective uses (``torch.from_numpy``), so memory
stays O(rows per rank) and ``tracemalloc`` sees all of it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["exchange", "lex_bounds", "lex_order", "pack", "sample_sort", "unpack"]

Spec = tuple[np.dtype, tuple[int, ...]]
SAMPLES_PER_RANK = 256  # regular samples per rank: buckets within ~ N/(P * 256) rows of each other


def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``(n, row_bytes)`` uint8: each row's bytes of every array, side by side."""
    n = len(arrays[0])
    columns = [np.ascontiguousarray(a).view(np.uint8).reshape(n, row_bytes(specs([a]))) for a in arrays]
    return np.concatenate(columns, axis=1) if columns else np.empty((n, 0), np.uint8)


def specs(arrays: Sequence[np.ndarray]) -> list[Spec]:
    """What :func:`unpack` needs to rebuild ``arrays``: dtype and shape after the row dim."""
    return [(a.dtype, tuple(a.shape[1:])) for a in arrays]


def row_bytes(spec: Sequence[Spec]) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for dtype, shape in spec)


def unpack(payload: np.ndarray, spec: Sequence[Spec]) -> list[np.ndarray]:
    """Inverse of :func:`pack`."""
    out, at, n = [], 0, len(payload)
    for dtype, shape in spec:
        width = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out.append(np.ascontiguousarray(payload[:, at:at + width]).view(dtype).reshape(n, *shape))
        at += width
    return out


def lex_order(keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Permutation sorting rows by ``(key, index)``."""
    return np.lexsort((index, keys))


def lex_bounds(keys: np.ndarray, index: np.ndarray, split_keys: np.ndarray, split_index: np.ndarray) -> np.ndarray:
    """For rows sorted by ``(key, index)``: the first row ``>= (split_key, split_index)``, per splitter."""
    lo = np.searchsorted(keys, split_keys, side="left")
    hi = np.searchsorted(keys, split_keys, side="right")
    return np.array([a + np.searchsorted(index[a:b], s, side="left") for a, b, s in zip(lo, hi, split_index)],
                    dtype=np.int64)


def regular_samples(keys: np.ndarray, index: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` evenly spaced rows of sorted ``(keys, index)`` (fewer if there are fewer rows)."""
    n = len(keys)
    at = (np.arange(min(count, n), dtype=np.int64) * n) // max(1, min(count, n))
    return keys[at], index[at]


def choose_splitters(keys: np.ndarray, index: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """``buckets - 1`` splitters at even ranks of the (unsorted) samples."""
    order = lex_order(keys, index)
    at = (np.arange(1, buckets, dtype=np.int64) * len(order)) // buckets
    return keys[order[at]], index[order[at]]


def exchange(buffer: np.ndarray, counts: np.ndarray, group) -> tuple[np.ndarray, np.ndarray]:
    """Send ``counts[q]`` consecutive rows of ``buffer`` to rank ``q``.

    Returns the rows received (in sender order) and how many came from each rank.
    """
    world = dist.get_world_size(group)
    send = torch.as_tensor(np.asarray(counts, np.int64))
    recv = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv, send, group=group)
    received = np.empty((int(recv.sum()), *buffer.shape[1:]), buffer.dtype)
    if buffer.ndim == 1 or buffer.shape[1]:
        dist.all_to_all_single(torch.from_numpy(received), torch.from_numpy(np.ascontiguousarray(buffer)),
                               recv.tolist(), send.tolist(), group=group)
    return received, recv.numpy()


def sample_sort(rows: list, group, splitters: tuple[np.ndarray, np.ndarray] | None = None):
    """This rank's bucket of the rows of all ranks sorted by ``(key, index)``: ``(keys, index, payload)``.

    Collective over ``group``. ``rows`` is ``[keys, index, payload]``; the
    call empties the list, so that when the caller keeps no other reference
    its arrays are freed as soon as they are copied into the send buffer:
    at most two copies of this rank's rows are alive at any time.
    ``splitters`` (``P - 1`` pairs, ascending) fix the buckets; by default
    they are drawn from regular samples of every rank's rows. Only the keys
    are sorted before the exchange; rows are copied in blocks.
    """
    keys, index, payload = rows
    rows.clear()
    world = dist.get_world_size(group)
    order = lex_order(keys, index)
    if splitters is None:
        sk, si = regular_samples(keys[order], index[order], SAMPLES_PER_RANK)
        local = np.full((SAMPLES_PER_RANK, 3), -1, np.int64)  # key bits, index, valid
        local[: len(sk), 0], local[: len(sk), 1], local[: len(sk), 2] = sk.view(np.int64), si, 1
        gathered = torch.empty((world * SAMPLES_PER_RANK, 3), dtype=torch.int64)
        dist.all_gather_single(gathered, torch.from_numpy(local), group=group)
        samples = gathered.numpy()
        samples = samples[samples[:, 2] == 1]
        splitters = choose_splitters(samples[:, 0].view(np.uint64), samples[:, 1], world)
    counts = np.diff(np.concatenate([[0], lex_bounds(keys[order], index[order], *splitters), [len(keys)]]))
    send = _gather_rows(keys, index, payload, order)
    del keys, index, payload, order
    received, _ = exchange(send, counts, group)
    del send
    keys = np.ascontiguousarray(received[:, :8]).view(np.uint64).reshape(-1)
    index = np.ascontiguousarray(received[:, 8:16]).view(np.int64).reshape(-1)
    order = lex_order(keys, index)
    payload = np.empty((len(order), received.shape[1] - 16), np.uint8)
    for start in range(0, len(order), _BLOCK):
        payload[start:start + _BLOCK] = received[order[start:start + _BLOCK], 16:]
    return keys[order], index[order], payload


_BLOCK = 1 << 16  # rows copied per step when gathering rows (bounds the temporary)


def _gather_rows(keys: np.ndarray, index: np.ndarray, payload: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``(n, 16 + row_bytes)`` uint8: key, index and payload of rows ``order``, in that order."""
    rows = np.empty((len(order), 16 + payload.shape[1]), np.uint8)
    rows[:, :8] = keys[order].view(np.uint8).reshape(-1, 8)
    rows[:, 8:16] = index[order].view(np.uint8).reshape(-1, 8)
    for start in range(0, len(order), _BLOCK):
        rows[start:start + _BLOCK, 16:] = payload[order[start:start + _BLOCK]]
    return rows


def exclusive_offsets(count: int, group) -> tuple[int, int, np.ndarray]:
    """``(start, total, all_counts)``: where this rank's ``count`` rows start in rank order."""
    world = dist.get_world_size(group)
    counts = torch.empty(world, dtype=torch.int64)
    dist.all_gather_single(counts, torch.tensor([count], dtype=torch.int64), group=group)
    counts = counts.numpy()
    return int(counts[: dist.get_rank(group)].sum()), int(counts.sum()), counts
