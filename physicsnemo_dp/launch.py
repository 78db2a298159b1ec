"""Start several ranks from a script or a notebook and run one function on each.

Domain parallelism needs several processes; a notebook or a plain script is
one. :func:`launch` starts ``nprocs`` ranks, gives each a process group and a
device mesh, runs ``fn(mesh, *args, **kwargs)`` on every rank and returns rank
0's result (or every rank's). Ranks' printed output is streamed back with a
``[rank r]`` prefix, so it shows up in the notebook cell.

A failing rank never leaves the caller hanging: its traceback is raised as
:class:`RankError` once the other ranks finish or a short grace period
passes (they may be blocked in a collective the failed rank never reached),
after which every rank process is terminated. A global ``timeout`` bounds the
whole run.

Functions are shipped with ``cloudpickle`` so that functions defined in a
notebook cell work; ranks start from a fork server that has already imported
torch, so only the first launch pays for the import.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

__all__ = ["launch", "RankError"]

_GRACE_SECONDS = 10.0


class RankError(RuntimeError):
    """A rank raised (or died); the message holds its traceback."""

    def __init__(self, rank: int, detail: str, others: str = "") -> None:
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}{others}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stream(io.TextIOBase):
    """File-like object that forwards whole lines to the parent with a rank prefix."""

    def __init__(self, queue, rank: int, kind: str) -> None:
        self._queue, self._rank, self._kind, self._buf = queue, rank, kind, ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._queue.put(("out", self._rank, self._kind, line))
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self._queue.put(("out", self._rank, self._kind, self._buf))
            self._buf = ""


def _to_cpu(value):
    import torch
    from torch.utils._pytree import tree_map

    def move(x):
        if isinstance(x, torch.Tensor):
            from .shard_tensor import ShardTensor

            if isinstance(x, ShardTensor):
                raise TypeError("return x.full_tensor() or x.to_local() from a launched function, not a ShardTensor")
            return x.detach().cpu()
        return x

    return tree_map(move, value)


def _rank_main(rank, world, port, backend, mesh_shape, mesh_names, payload, queue, timeout_s):
    import cloudpickle
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out, err = _Stream(queue, rank, "stdout"), _Stream(queue, rank, "stderr")
    sys.stdout, sys.stderr = out, err
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        device_type = "cpu" if backend == "gloo" else "cuda"
        if device_type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:  # one thread pool per core, not per rank: ranks share the CPU
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        mesh = init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=tuple(mesh_names))
        result = _to_cpu(fn(mesh, *args, **kwargs))
        queue.put(("result", rank, cloudpickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        queue.put(("error", rank, traceback.format_exc()))
    finally:
        out.flush()
        err.flush()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the process is ending anyway
            pass


def _default_backend(nprocs: int) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def launch(
    fn: Callable[..., Any],
    nprocs: int = 4,
    *,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    backend: str | None = None,
    timeout: float = 600.0,
    return_all: bool = False,
    echo: bool = True,
):
    """Run ``fn(mesh, *args, **kwargs)`` on ``nprocs`` ranks and return rank 0's result.

    Args:
        fn: the function each rank runs; its first argument is the DeviceMesh.
        nprocs: number of ranks.
        mesh_shape: mesh shape (default ``(nprocs,)``); its product must be ``nprocs``.
        mesh_dim_names: default ``("domain",)`` for 1-D and ``("ddp", "domain")`` for 2-D meshes.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank); default picks
            nccl when enough GPUs are visible, else gloo.
        timeout: seconds for the whole run before every rank is stopped.
        return_all: return the list of every rank's result instead of rank 0's.
        echo: print ranks' output (prefixed with ``[rank r]``) as it arrives.

    Raises:
        RankError: a rank raised or died; the message carries its traceback.
        TimeoutError: the run did not finish within ``timeout``.
    """
    import cloudpickle

    mesh_shape = tuple(mesh_shape) if mesh_shape is not None else (nprocs,)
    if mesh_dim_names is None:
        mesh_dim_names = ("domain",) if len(mesh_shape) == 1 else ("ddp", "domain") if len(mesh_shape) == 2 else None
    if mesh_dim_names is None or len(mesh_dim_names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names must name each of the {len(mesh_shape)} mesh dims")
    size = 1
    for n in mesh_shape:
        size *= n
    if size != nprocs:
        raise ValueError(f"mesh_shape {mesh_shape} has {size} ranks but nprocs={nprocs}")
    backend = backend or _default_backend(nprocs)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "physicsnemo_dp"])
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, nprocs, port, backend, mesh_shape, mesh_dim_names, payload, queue, timeout),
            daemon=False,  # ranks may start their own workers (e.g. a datapipe reader); we kill them in finally
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, queue, timeout, return_all, echo)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def _collect(procs, queue, timeout, return_all, echo):
    import cloudpickle

    nprocs = len(procs)
    results: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    failure_deadline = float("inf")
    deadline = time.monotonic() + timeout
    lock = threading.Lock()
    while len(results) < nprocs:
        now = time.monotonic()
        if now > failure_deadline:
            break
        if now > deadline:
            missing = [r for r in range(nprocs) if r not in results]
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s; all ranks were stopped")
        try:
            kind, rank, *rest = queue.get(timeout=0.2)
        except Exception:  # queue.Empty
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and r not in results]
            if dead and failure is None and queue.empty():
                r = dead[0]
                failure = (
                    r,
                    f"process exited with code {procs[r].exitcode} without reporting a result. If it "
                    "died before running your function and you launch from a script, guard the call "
                    "with `if __name__ == '__main__':` (new processes re-import the main module).",
                )
                failure_deadline = time.monotonic() + _GRACE_SECONDS
            continue
        if kind == "out":
            if echo:
                stream = sys.stdout if rest[0] == "stdout" else sys.stderr
                with lock:
                    print(f"[rank {rank}] {rest[1]}", file=stream, flush=True)
        elif kind == "result":
            results[rank] = cloudpickle.loads(rest[0])
        elif kind == "error" and failure is None:
            failure = (rank, rest[0])
            failure_deadline = time.monotonic() + _GRACE_SECONDS
    if failure is not None:
        pending = [r for r in range(nprocs) if r not in results and r != failure[0]]
        others = (
            f"\n(ranks {pending} had not finished {_GRACE_SECONDS:.0f} s later — probably waiting "
            "in a collective the failed rank never reached — and were stopped)"
            if pending
            else ""
        )
        raise RankError(failure[0], failure[1], others)
    return [results[r] for r in range(nprocs)] if return_all else results[0]

