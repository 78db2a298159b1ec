"""The rank side of the harness: one long-lived process per rank.

A worker joins the process group once, then runs jobs sent by the test process
until its pipe closes. Everything that is expensive (importing torch, building
the process group, building device meshes, importing test modules) happens once
per worker, not once per test.

The worker's file descriptors 1 and 2 point at a per-rank file that the test
process reads itself, so a rank's output (Python prints, C++ warnings, the
stack dumped by faulthandler) reaches the report even when the rank hangs or
dies without replying.
"""

from __future__ import annotations

import ast
import datetime
import faulthandler
import importlib.util
import os
import random
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _pytest.assertion.rewrite import rewrite_asserts
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = {1: ("domain",), 2: ("ddp", "domain")}


@dataclass(frozen=True)
class Job:
    """What to run on every rank: ``module.name(ctx, **params)`` on a mesh of ``mesh_shape``."""

    module: str
    name: str
    params: dict[str, Any]
    mesh_shape: tuple[int, ...]


@dataclass
class Outcome:
    """How one rank ended a job (or its start-up).

    ``status`` is ``ok``, ``skipped`` or ``raised`` when the rank replied; the
    test process adds ``died`` (the process exited) and ``unfinished`` (no reply
    before the deadline). ``detail`` is the traceback, the skip reason or the
    exit status, ``error`` the exception's first line, ``value`` what the body
    returned (the worker's pid for start-up); ``output`` is what the rank wrote
    to stdout/stderr.
    """

    rank: int
    status: str
    error: str = ""
    detail: str = ""
    value: Any = None
    output: str = ""


@dataclass(frozen=True)
class Context:
    """What a test body gets as ``ctx`` on each rank."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    mesh: DeviceMesh
    mesh_shape: tuple[int, ...]

    def seed(self, n: int = 0) -> None:
        """Seed torch (all devices) and ``random`` with ``n``: the same stream on every rank.

        Every job already starts seeded with 0; call ``seed(ctx.rank)`` for data
        that differs per rank.
        """
        torch.manual_seed(n)
        random.seed(n)


def main(conn, lifeline, rank: int, world_size: int, backend: str, device_type: str, store_path: str,
         output_path: str, collective_timeout: float) -> None:
    """Entry point of a worker process: start up, reply once, then serve jobs until EOF."""
    _detach(lifeline)
    _capture_output(output_path)
    try:
        device = _join_process_group(rank, world_size, backend, device_type, store_path, collective_timeout)
    except BaseException as exc:
        conn.send(Outcome(rank, "raised", _one_line(exc), traceback.format_exc()))
        return
    conn.send(Outcome(rank, "ok", value=os.getpid()))
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        outcome = _run(job, rank, world_size, backend, device, meshes)
        try:
            conn.send(outcome)
        except Exception as exc:  # the body returned something that does not pickle
            conn.send(Outcome(rank, "raised", _one_line(exc),
                              f"could not send the body's return value back:\n{traceback.format_exc()}"))


def _detach(lifeline) -> None:
    """Leave the terminal's process group, and exit as soon as the test process is gone.

    Ctrl-C at the terminal then reaches only pytest, which stops the pools in
    order, and the test process can signal a worker's whole group (the worker
    and anything it started). ``lifeline`` is a pipe whose other end only the
    test process holds: it reads EOF when that process exits in any way (even
    SIGKILL), or stops the pool, and a watcher thread then ends this worker,
    wherever the main thread is stuck.
    """
    os.setpgrp()

    def watch() -> None:
        try:
            lifeline.recv()
        except EOFError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _capture_output(path: str) -> None:
    """Point fds 1 and 2 at ``path``; faulthandler writes stacks there too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    faulthandler.enable()  # a segfault leaves its Python stack in the output
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test process asks hung ranks where they are


def _join_process_group(rank: int, world_size: int, backend: str, device_type: str, store_path: str,
                        collective_timeout: float) -> torch.device:
    torch.set_num_threads(1)  # ranks share 2 cores; more threads only contend
    if device_type == "cuda":  # nccl: one GPU per rank; gloo: ranks share the GPUs there are
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        store=dist.FileStore(store_path, world_size),
        # Second line of defence: the test process normally kills a stuck pool
        # long before a collective gives up on its own.
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    return device


def _run(job: Job, rank: int, world_size: int, backend: str, device: torch.device,
         meshes: dict[tuple[int, ...], DeviceMesh]) -> Outcome:
    os.ftruncate(1, 0)  # fds 1 and 2 share one O_APPEND file: the output now is this job's only
    try:
        if job.mesh_shape not in meshes:
            meshes[job.mesh_shape] = init_device_mesh(
                device.type, job.mesh_shape, mesh_dim_names=MESH_DIM_NAMES[len(job.mesh_shape)]
            )
        ctx = Context(rank, world_size, backend, device, meshes[job.mesh_shape], job.mesh_shape)
        body = getattr(_import_with_assert_rewriting(job.module), job.name)
        body = getattr(body, "__distributed_body__", body)  # a @distributed test ships its undecorated body
        _reset_torch_state()
        outcome = Outcome(rank, "ok", value=body(ctx, **job.params))
    except pytest.skip.Exception as exc:
        outcome = Outcome(rank, "skipped", detail=exc.msg)
    except BaseException as exc:
        shown = exc.__traceback__.tb_next or exc.__traceback__  # from the body on, without this frame
        outcome = Outcome(rank, "raised", _one_line(exc),
                          "".join(traceback.format_exception(type(exc), exc, shown)))
    sys.stdout.flush()
    sys.stderr.flush()
    return outcome


def _import_with_assert_rewriting(name: str) -> ModuleType:
    """Import a test module the way pytest does, so a bare ``assert a == b`` failing on a
    rank reports both values (plain ``import`` would leave only "AssertionError")."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    source = Path(spec.origin).read_bytes()
    tree = ast.parse(source, filename=spec.origin)
    rewrite_asserts(tree, source, spec.origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(tree, spec.origin, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _one_line(exc: BaseException) -> str:
    """``"AssertionError: first line of the message"``, for the report's status lines."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[0]


def _reset_torch_state() -> None:
    """Undo what an earlier test on this worker may have changed, so results do not depend on test order."""
    torch.manual_seed(0)
    random.seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
