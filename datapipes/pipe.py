"""``DomainPipe``: batches of ShardTensors, each rank reading only its own piece.

What a rank does per batch, and why no communication is needed:

1. The ddp rank picks its samples from the shared-seed order
   (:class:`~datapipes.sampler.SampleOrder`); every domain rank of the ddp
   group computes the same list.
2. The source's decomposition (:class:`~datapipes.decomposition.DomainDecomposition`)
   gives this rank's box (plus halo) and every other rank's shape.
3. A reader (in-process, thread, or a forked process) reads the box of every
   variable of every sample straight into a pooled buffer and applies the
   transforms there (:mod:`datapipes.prefetch`), ``prefetch`` batches ahead
   while the consumer's step leaves time to hide a read behind, in the caller
   when it does not (:mod:`datapipes._pacing`).
4. The buffer is wrapped without a copy, moved to the device, and each
   variable becomes ``ShardTensor.from_local(..., sharding_shapes=...)`` with
   the shapes from step 2: no collective is issued. The layout of a batch
   (buffer arrays, pieces, ShardTensor specs) is the same for every batch of
   a decomposition, so it is built once and later batches reuse the spec
   (see ``DomainPipe._layout``): wrapped as it is (``_built``), or through
   ``ShardTensor.from_spec`` under the checking mode.
5. A batch read ahead is prepared and built off the training thread: the
   reader thread (or the reader process's relay thread) acquires the buffer
   and builds the task before the read (the training thread only queues the
   read, with its reference to the consumer's previous batch, which that
   thread lets go of: see ``_Read``), and after the read hands out the
   buffer and wraps the ShardTensors with the cached specs as they are (no
   checks, so no collective ever runs there). The
   training thread takes the finished batch; under
   :func:`physicsnemo_dp.debug.checks` it builds it again through
   ``from_spec``, whose collective verification runs on the training thread
   as for any batch. A layout's first batch, batches read in the caller and
   batches moved to another device are built on the training thread.
   Why: right after a training step the caches are cold, and this work cost
   0.3-0.4 ms of the training thread's CPU per batch there (~30 us warm);
   preparing the next read and tearing down the previous batch cost
   another 40-50 us, which the reader's thread does (``next()`` costs the
   training thread 33-46 us instead of 75-104; P = 2, reader process, after
   a 3.8 ms sleep).

Output layout: each batch is a :class:`Batch`, a dict from variable name to a
ShardTensor of shape ``(batch, *sample shape)`` on the *domain* mesh (the
sub-mesh without the ddp dim), sharded on the sample dims the decomposition
splits. Each ddp group holds different samples, as DDP expects.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from functools import lru_cache
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_dp import ShardTensor, ShardTensorSpec
from physicsnemo_dp.debug import checks_enabled

from ._axes import MeshAxes
from ._buffers import BufferPool, layout_arrays
from ._pacing import ReadAhead
from .decomposition import DomainDecomposition
from .errors import DataPipeError
from .prefetch import ReadTask, make_reader, timed_fill
from .sampler import SampleOrder
from .source import Source, Split

__all__ = ["Batch", "DomainPipe"]


class Batch(dict):
    """Variable name -> ShardTensor ``(batch, *sample shape)``, plus this rank's extras.

    Attributes:
        samples: dataset indices of the batch's samples, in batch order.
        padded: variable -> this rank's local tensor *with* its halo (a plain
            tensor; the ShardTensor's local data is a view of its interior).
        halo: variable -> ``(before, after)`` halo cells per sample dim.
    """

    def __init__(self, samples: tuple[int, ...]):
        super().__init__()
        self.samples = samples
        self.padded: dict[str, torch.Tensor] = {}
        self.halo: dict[str, tuple[tuple[int, int], ...]] = {}


class DomainPipe:
    """Iterate a source's samples as ShardTensors split over the domain mesh.

    Args:
        source: a :class:`~datapipes.source.Source` (HDF5, xarray, mesh).
        mesh: a 1-D domain mesh, or a mesh with a ``ddp_dim`` dim (samples)
            and one or two domain dims (see :class:`~datapipes._axes.MeshAxes`).
        batch_size: samples per batch *per ddp rank*.
        shuffle: a new permutation of the samples every epoch (see :mod:`datapipes.sampler`).
        seed: seed of that permutation, the same on every rank.
        drop_last: drop the tail of the order so every ddp rank gets whole batches.
        split_dims: the array dim each domain mesh dim splits (see
            :class:`~datapipes.decomposition.DomainDecomposition`); meshes
            always split their point dim.
        halo: extra cells read on each side of a rank's box.
        sizes: explicit shard sizes per mesh dim (default: the split rule).
        transforms: callables ``f(tensors)`` run by the reader on each batch's
            halo-padded local tensors, in place (e.g. :class:`~datapipes.statistics.Normalize`).
        prefetch: batches read in the background while the consumer holds the
            current one; 0 reads in the caller.
        workers: ``"process"`` (default; one forked reader per rank, not
            serialized by h5py's lock) or ``"thread"``.
        adaptive_prefetch: read ahead only while the consumer keeps each batch
            long enough for a read to hide behind (at least a quarter of a
            read's time), and read in the caller while it asks again at once,
            where reading ahead could hide nothing and only costs its hand-off
            (see :mod:`datapipes._pacing`). False reads ahead always. Files
            the training process opens this way are closed before it forks
            (another pipe's reader, ``DataLoader`` workers): no child
            inherits an open file (:mod:`datapipes._fork_guard`).
        device: where batches go (default: the mesh's device type).
        validate: raise :class:`~datapipes.errors.InvalidValuesError` on NaN/inf.
        ddp_dim: name of the mesh dim that splits samples.

    Batches view pooled buffers; a buffer is reused only after every tensor of
    its batch is gone, so keeping a batch is safe (it just costs memory).
    """

    def __init__(self, source: Source, mesh: DeviceMesh, *, batch_size: int = 1, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, split_dims: Sequence[int] | None = None,
                 halo: int | Sequence[int] = 0, sizes=None, transforms: Sequence[Callable] = (),
                 prefetch: int = 2, workers: str = "process", adaptive_prefetch: bool = True, device=None,
                 validate: bool = False, ddp_dim: str = "ddp"):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if workers not in ("process", "thread"):
            raise ValueError(f'workers must be "process" or "thread", got {workers!r}')
        self.source = source
        self.axes = MeshAxes.from_mesh(mesh, ddp_dim)
        ndim = len(self.axes.domain_shape)
        self.split = Split(
            None if split_dims is None else tuple(split_dims),
            halo if isinstance(halo, int) else tuple(halo),
            _freeze_sizes(sizes, ndim),
        )
        self.order = SampleOrder(len(source), batch_size, self.axes.ddp_size, self.axes.ddp_rank,
                                 shuffle, seed, drop_last)
        self.prefetch = int(prefetch)
        self.workers = "inline" if prefetch == 0 else workers
        self.transforms = tuple(transforms)
        self.validate = validate
        self.device = torch.device(device if device is not None else self.axes.domain_mesh.device_type)
        self.bytes_read = 0  # bytes this rank requested from the source, all epochs
        self._epoch = 0
        self._position = 0  # batches of the current epoch already yielded
        self._seq = 0
        self._pace = ReadAhead(enabled=adaptive_prefetch)
        # in flight, plus the batch the consumer holds and the one it has just dropped
        self._pool = BufferPool(shared=self.workers == "process", max_idle=self.prefetch + 2)
        # reads in the caller: the batch being read and the one the consumer holds. Private memory
        # (huge pages) even when the reader process needs shared memory: see datapipes._pacing.
        self._own_pool = BufferPool(shared=False, max_idle=2) if self._pool.shared else self._pool
        self._reader: list = [None]  # started by the first iteration; a list so the finalizer sees it
        self._label = ""  # this rank in validation errors, set by the first iteration
        self._closer = weakref.finalize(self, _close, (self._pool, self._own_pool), self._reader)
        self._layouts: dict[tuple, _Layout] = {}  # see _layout
        self.decompose(0)  # a bad split fails here, not in the first batch

    # ----------------------------------------------------------- layout
    def decompose(self, index: int) -> dict[str, DomainDecomposition]:
        """Decomposition of every variable of sample ``index`` over the domain mesh."""
        return self.source.decompose(index, self.axes.domain_shape, self.split)

    def local_coords(self, halo: bool = False) -> dict[str, np.ndarray]:
        """Coordinates of this rank's cells (grid sources that store coordinates)."""
        dec = next(iter(self.decompose(0).values()))
        return self.source.coords(dec.box(self.axes.domain_coord, halo))

    # ------------------------------------------------------------ epochs
    def __len__(self) -> int:
        return self.order.num_batches()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def reading_ahead(self) -> bool:
        """Whether the next batches are read in the background (else in the caller, when asked)."""
        return self.workers != "inline" and self._pace.ahead

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order. Switching epochs restarts at the first batch; the same epoch keeps its position."""
        if epoch != self._epoch:
            self._epoch, self._position = int(epoch), 0

    def state_dict(self) -> dict:
        """Position to resume from: the epoch and the batches already yielded in it."""
        o = self.order
        return {"epoch": self._epoch, "position": self._position, "num_samples": o.num_samples,
                "batch_size": o.batch_size, "ddp_size": o.ddp_size, "shuffle": o.shuffle,
                "seed": o.seed, "drop_last": o.drop_last}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue exactly where ``state`` was taken (the same order settings are required)."""
        mine = self.state_dict()
        differ = {k: (state.get(k), mine[k]) for k in mine if k not in ("epoch", "position") and state.get(k) != mine[k]}
        if differ:
            raise ValueError(f"state_dict was taken with other order settings (saved, now): {differ}")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"position {state['position']} is outside an epoch of {len(self)} batches")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self._epoch, self._position
        batches = self.order.batches(epoch)
        reader = self._start_reader()
        inflight: deque = deque()
        submitted = start
        previous = None  # the consumer's last batch, until a read submitted to the reader takes it (see _Read)
        try:
            for k in range(start, len(batches)):
                ahead = self.reading_ahead
                if not ahead or not inflight:
                    previous = None  # a read in the caller reuses its buffer (if the consumer let go of it)
                if ahead and not inflight:  # the first batch, or the first after reads in the caller
                    inflight.append(self._submit(reader, batches[submitted]))
                    submitted += 1
                if inflight:  # in order: reads in the caller start only once none is in flight
                    read = inflight.popleft()
                    try:
                        nbytes, seconds, ready = reader.result()
                    except BaseException:
                        read.release()
                        raise
                    task, buffer, layout, pool = read.task, read.buffer, read.layout, self._pool
                    del read
                else:
                    task, buffer, layout = self._task(batches[submitted], self._own_pool)
                    submitted += 1
                    pool = self._own_pool
                    try:
                        nbytes, seconds = timed_fill(self.source, task, buffer.memory, self.transforms,
                                                     self.validate, self._label)
                    except BaseException:
                        pool.release(buffer)
                        raise
                    ready = None  # the caller wraps it
                self.bytes_read += nbytes
                self._pace.observe_read(seconds)
                batch = self._handed(task, pool.hand_out(buffer, task.arrays) if ready is None else ready, layout)
                # the next reads start now, once this batch is ready: they overlap with the consumer's step,
                # and waking the reader does not delay the hand-out
                while ahead and submitted < len(batches) and len(inflight) < self.prefetch:
                    inflight.append(self._submit(reader, batches[submitted], previous))
                    previous = None
                    submitted += 1
                previous = None  # no read took it: if the consumer let go of it, it is torn down here
                self._position = k + 1
                handed = time.perf_counter()
                yield batch
                previous = batch  # the frame must not keep it beyond the next read's submission: see _Read
                del batch
                self._pace.observe_gap(time.perf_counter() - handed)
                if ahead != self.reading_ahead and self._own_pool is not self._pool:
                    (self._own_pool if self.reading_ahead else self._pool).trim()  # the idle buffers of the mode left
            self._epoch, self._position = epoch + 1, 0
        finally:
            self._drain(reader, inflight)

    def close(self) -> None:
        """Stop the reader and free idle buffers (also done when the pipe is garbage-collected)."""
        self._closer()

    def __enter__(self) -> "DomainPipe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------- internals
    def _start_reader(self):
        """The background reader (started once; None for ``prefetch=0``)."""
        if not self._closer.alive:
            raise RuntimeError("this DomainPipe is closed")
        if not self._label:
            self._label = self._rank_label()
        if self._reader[0] is None and self.workers != "inline":
            self._reader[0] = make_reader(self.workers, self.source, self.transforms, self.validate, self._label)
        return self._reader[0]

    def _rank_label(self) -> str:
        """This rank as validation errors name it: global rank, then its ddp and domain coordinates."""
        rank = f"rank {dist.get_rank()}" if dist.is_initialized() else "rank 0"
        return f"{rank} (ddp {self.axes.ddp_rank}, domain {','.join(map(str, self.axes.domain_coord))})"

    def _submit(self, reader, samples: tuple[int, ...], drop=None) -> "_Read":
        """Hand the read of ``samples`` to the background reader, which prepares it on its own thread
        (and lets go of ``drop`` there first, see :class:`_Read`)."""
        read = _Read(self, samples, drop)
        reader.submit(read)
        return read

    def _task(self, samples: tuple[int, ...], pool: BufferPool, detach: tuple[str, ...] = ()):
        """The read of ``samples``: its task, a buffer from ``pool`` and the batch layout."""
        decs = [self.decompose(i) for i in samples]
        layout = self._layout(decs)
        buffer = pool.acquire(layout.nbytes)
        self._seq += 1
        task = ReadTask(self._seq, buffer.name, layout.arrays, tuple(samples), layout.boxes(decs), detach)
        return task, buffer, layout

    def _layout(self, decs: list[dict[str, DomainDecomposition]]) -> "_Layout":
        """The batch's buffer layout and per-variable pieces, cached while the decomposition stays the same.

        Why cache: the layout depends only on this rank's pieces and the batch
        size, and rebuilding it (array specs, pieces, ShardTensor specs) cost
        as much per batch as reading a few hundred KiB. The key is the identity of
        the decomposition objects (a grid source returns the same ones for
        every sample; the cached layout holds them, so their ids stay valid);
        sources that build new decompositions per sample (meshes) miss and get
        a fresh layout, as before.
        """
        first = decs[0]
        key = (len(decs), *((name, id(d)) for name, d in first.items()))
        layout = self._layouts.get(key)
        if layout is not None and all(d is first[name] for dec in decs[1:] for name, d in dec.items()):
            return layout
        for dec in decs[1:]:
            for name, d in dec.items():
                if d is not first[name] and (d.global_shape, d.sizes) != (first[name].global_shape, first[name].sizes):
                    raise DataPipeError(
                        f"batch_size={len(decs)} needs samples whose variables split alike: "
                        f"{d.label} splits as {d.sizes}, but {first[name].label} as {first[name].sizes}; "
                        "use batch_size=1 for samples of different shapes"
                    )
        layout = _Layout(first, len(decs), self.axes.domain_coord, self.source)
        if len(self._layouts) >= 64:  # decompositions that change per sample: keep the cache bounded
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def _wrap(self, task: ReadTask, arrays: dict[str, np.ndarray], layout: "_Layout", checking: bool) -> Batch:
        """The batch over ``arrays``: with the layout's known specs as they are (see :meth:`_prebuild`), or
        under the checking mode (``checking``), for a layout's first batch or another device, through
        ``_Layout.shard``."""
        if self.device.type == "cpu" and not checking:
            wraps = layout.wraps(self.axes.domain_mesh)
            if wraps is not None:
                return _built(task, arrays, wraps)
        batch = Batch(task.samples)
        mesh = self.axes.domain_mesh
        for name, piece in layout.pieces.items():
            padded = torch.from_numpy(arrays[name])
            if padded.device != self.device:
                padded = padded.to(self.device, non_blocking=True)
            batch[name] = layout.shard(name, padded[piece.interior], mesh)
            batch.padded[name] = padded
            batch.halo[name] = piece.halo
        return batch

    def _prebuild(self, task: ReadTask, buffer, layout: "_Layout") -> tuple[dict[str, np.ndarray], Batch | None]:
        """Run by the background reader's thread after the read: hand out the buffer and build the batch there.

        Each variable's ShardTensor wraps its interior with the layout's cached
        spec directly (``ShardTensor._of_local``: a few us against ~20 for
        ``from_spec``'s checks right after a step), as the spec was made by
        ``from_local`` for exactly this box, dtype and mesh (:func:`_built`;
        batches read in the caller are built the same way when the checking
        mode is off).
        Returns the buffer's arrays (they hold the buffer: it returns to the
        pool when they and the batch are gone) and the batch, or None when the
        training thread must build it (see :meth:`_handed`): the layout's first
        batch, whose spec comes from ``ShardTensor.from_local``, batches moved
        to another device, and any error, which the training thread meets again
        and raises. Never raises.
        """
        arrays = self._pool.hand_out(buffer, task.arrays)
        wraps = layout.wraps(self.axes.domain_mesh) if self.device.type == "cpu" else None
        if wraps is None:
            return arrays, None
        try:  # no collective may run here: under checks() the training thread builds it again (see _handed)
            return arrays, _built(task, arrays, wraps)
        except Exception:
            return arrays, None

    def _handed(self, task: ReadTask, ready, layout: "_Layout") -> Batch:
        """The batch to hand to the consumer, on the training thread.

        ``ready`` is the buffer's arrays, or ``(arrays, batch)`` from
        :meth:`_prebuild`. A batch built in the background is taken as it is;
        under the checking mode (:func:`physicsnemo_dp.debug.checks`) it is
        built again here through ``ShardTensor.from_spec``, whose collective
        verification must run on this thread, so the checks verify exactly what
        they verify for a batch read in the caller.
        """
        arrays, batch = ready if isinstance(ready, tuple) else (ready, None)
        checking = checks_enabled()
        if batch is None or checking:
            return self._wrap(task, arrays, layout, checking)
        return batch

    def _drain(self, reader, inflight: deque) -> None:
        """Wait for reads still in flight (an iteration stopped early) and recycle their buffers."""
        while inflight:
            read = inflight.popleft()
            try:
                reader.result()  # a batch read: its buffer returns to the pool once its arrays are dropped here
            except Exception:  # the consumer stopped: an unused batch's error is moot; its buffer was not handed out
                read.release()


def _built(task: ReadTask, arrays: dict[str, np.ndarray], wraps: tuple[tuple, ...]) -> Batch:
    """The batch over ``arrays`` with the layout's known specs (``_Layout.wraps``), wrapped as they are: the
    layout's own spec for the layout's own box, so ``from_spec``'s checks could only pass."""
    batch = Batch(task.samples)
    for name, interior, halo, spec in wraps:
        padded = torch.from_numpy(arrays[name])
        batch[name] = ShardTensor._of_local(padded if interior is None else padded[interior], spec)
        batch.padded[name] = padded
        batch.halo[name] = halo
    return batch


class _Read:
    """A read handed to the background reader: prepared (buffer, layout, task) and finished on its thread.

    The training thread only creates this and puts it on the reader's queue;
    the reader's thread (the reader process's relay thread) calls it, which
    acquires the buffer and builds the task, and after the read calls
    :meth:`finish` (the pipe's :meth:`DomainPipe._prebuild`). Why: preparing a
    read cost the training thread ~45 us of CPU per batch right after a step
    (70 us with cold caches), next to ~5 us for the queue.

    ``drop`` is the pipe's reference to the consumer's previous batch: the
    reader's thread lets go of it before it acquires the buffer, so when the
    consumer has already dropped that batch it is torn down there (not in the
    training thread's ``next()``) and its buffer is the one this read reuses.
    A batch the consumer still holds is not affected (its buffer stays in use).
    """

    __slots__ = ("pipe", "samples", "drop", "task", "buffer", "layout")

    def __init__(self, pipe: DomainPipe, samples: tuple[int, ...], drop=None):
        self.pipe, self.samples, self.drop = pipe, samples, drop
        self.task = self.buffer = self.layout = None

    def __call__(self):
        self.drop = None
        pipe = self.pipe
        self.task, self.buffer, self.layout = pipe._task(self.samples, pipe._pool, pipe._pool.take_freed_names())
        return self.task, self.buffer.memory, self.finish

    def finish(self):
        return self.pipe._prebuild(self.task, self.buffer, self.layout)

    def release(self) -> None:
        """Return the buffer of a read whose batch was never handed out (a read that failed, or was dropped)."""
        if self.buffer is not None:
            self.pipe._pool.release(self.buffer)
            self.buffer = None


class _Piece:
    """One rank's share of a variable's decomposition, precomputed once for every batch that uses it."""

    def __init__(self, dec: DomainDecomposition, coord: tuple[int, ...]):
        self.box = dec.box(coord, halo=True)  # read box in the sample, halo included
        self.shape = dec.local_shape(coord, halo=True)
        self.interior = (slice(None), *dec.interior(coord))  # the ShardTensor's part of the buffer
        self.halo = dec.halo_widths(coord)
        self.placements = dec.placements(1)
        self._dec, self._coord = dec, coord
        self._sharding: dict[int, dict] = {}

    def sharding_shapes(self, rows: int) -> dict:
        """``sharding_shapes`` for a local batch of ``rows`` samples."""
        if rows not in self._sharding:
            self._sharding[rows] = self._dec.sharding_shapes(self._coord, leading=(rows,))
        return self._sharding[rows]


_piece = lru_cache(maxsize=4096)(_Piece)


class _Layout:
    """What every batch of ``rows`` samples with the same decompositions shares: pieces, buffer layout, specs."""

    def __init__(self, decs: dict[str, DomainDecomposition], rows: int, coord: tuple[int, ...], source: Source):
        self.decs = decs  # kept alive: the pipe's cache key holds their ids
        self.rows = rows
        self.pieces = {name: _piece(d, coord) for name, d in decs.items()}
        self.arrays, self.nbytes = layout_arrays(
            {name: ((rows, *p.shape), source.dtype(name)) for name, p in self.pieces.items()}
        )
        self._coord = coord
        self._boxes = {name: p.box for name, p in self.pieces.items()}
        self._specs: dict[str, ShardTensorSpec] = {}
        self._wraps: tuple | None = None  # (mesh, wraps()): see wraps

    def boxes(self, decs: list[dict[str, DomainDecomposition]]) -> tuple[dict, ...]:
        """Per sample, variable -> read box (one shared dict when the samples share the decompositions)."""
        if all(d is self.decs[name] for dec in decs for name, d in dec.items()):
            return (self._boxes,) * len(decs)
        return tuple({name: _piece(d, self._coord).box for name, d in dec.items()} for dec in decs)

    def shard(self, name: str, local: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:
        """``local`` as the variable's ShardTensor.

        The first batch goes through ``ShardTensor.from_local`` (which checks
        the shapes against the mesh and raises its errors); its spec is then
        reused through ``ShardTensor.from_spec``, since every later batch of
        this layout has the same local shape, dtype, device and mesh: a few us
        instead of from_local's validation.
        """
        spec = self._specs.get(name)
        if spec is not None and spec.mesh is mesh and local.dtype == spec.tensor_meta.dtype:
            return ShardTensor.from_spec(local, spec)
        piece = self.pieces[name]
        out = ShardTensor.from_local(local, mesh, piece.placements, sharding_shapes=piece.sharding_shapes(self.rows))
        self._specs[name] = out.spec
        self._wraps = None
        return out

    def wraps(self, mesh: DeviceMesh) -> tuple[tuple, ...] | None:
        """Per variable ``(name, interior, halo, spec)`` once every spec is known on ``mesh`` (a batch of this
        layout was built once through :meth:`shard`), else None: what building a batch needs besides the data."""
        if self._wraps is None or self._wraps[0] is not mesh:
            if len(self._specs) != len(self.pieces) or any(spec.mesh is not mesh for spec in self._specs.values()):
                return None
            # no halo: the ShardTensor wraps the buffer's tensor itself (indexing a tensor costs ~1.5 us)
            self._wraps = (mesh, tuple((name, p.interior if any(map(any, p.halo)) else None, p.halo, self._specs[name])
                                       for name, p in self.pieces.items()))
        return self._wraps[1]


def _close(pools: tuple[BufferPool, ...], reader: list) -> None:
    if reader[0] is not None:
        reader[0].close()
    for pool in pools:
        pool.close()


def _freeze_sizes(sizes, ndim: int):
    """Hashable per-mesh-dim sizes (``None`` entries keep the split rule)."""
    if sizes is None:
        return None
    if isinstance(sizes, Mapping):
        sizes = [sizes.get(m) for m in range(ndim)]
    return tuple(None if s is None else tuple(int(x) for x in s) for s in sizes)
