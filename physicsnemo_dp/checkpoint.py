"""Distributed checkpoints that survive crashes and load into other (ddp, domain) layouts.

Built on ``torch.distributed.checkpoint`` (DCP): each rank writes only its own
state, replicated tensors are written once, and sharded FSDP2 parameters are
resharded on load. What a checkpoint holds:

* the model (plain, DDP or FSDP2 — through DCP's ``get_model_state_dict``, so
  the ``module.`` prefix of DDP and FSDP2's DTensors are handled),
* the optimizer and, optionally, an LR scheduler,
* every rank's RNG states (torch CPU/accelerator, Python, NumPy) under its own
  key, so a resume on the same layout continues bit for bit,
* the step and a JSON-able ``extra`` dict (e.g. the datapipe's position).

Crash safety: a save writes into a hidden temporary folder, then rank 0 writes
a manifest (every file's size) and renames the folder to ``step_<n>`` — a
rename is atomic, so a ``step_<n>`` folder is always complete. Loading picks
the newest folder whose manifest matches the files on disk; a save killed
mid-way leaves only a temporary folder that the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "Restored"]

_MANIFEST = "manifest.json"
_PREFIX = "step_"


@dataclass
class Restored:
    """What :func:`load_checkpoint` hands back besides the loaded modules."""

    path: Path
    step: int
    extra: dict
    rng_restored: bool


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _manifest_of(folder: Path) -> dict:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != _MANIFEST)
    return {str(p.relative_to(folder)): p.stat().st_size for p in files}


def _is_complete(folder: Path) -> bool:
    manifest = folder / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("files") == _manifest_of(folder)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """Newest complete ``step_<n>`` folder under ``root`` (incomplete ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()),
        key=lambda p: int(p.name[len(_PREFIX):]),
        reverse=True,
    )
    return next((p for p in steps if _is_complete(p)), None)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    extra: dict | None = None,
    keep: int = 2,
) -> Path:
    """Save a checkpoint of ``step`` under ``root`` (collective: every rank calls it).

    ``extra`` must be the same JSON-able dict on every rank. The ``keep``
    newest complete checkpoints are kept. Returns the checkpoint folder.
    """
    root = Path(root)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{_PREFIX}{step:08d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f".tmp-{_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state = {"model": get_model_state_dict(model), f"rng.rank{_rank()}": _rng_state()}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        meta = {
            "step": int(step),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "extra": extra or {},
            "files": _manifest_of(tmp),
        }
        (tmp / _MANIFEST).write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        complete = [p for p in sorted(root.glob(f"{_PREFIX}*")) if _is_complete(p)]
        for old in complete[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    root_or_path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    restore_rng: bool = True,
) -> Restored | None:
    """Load the newest complete checkpoint under ``root_or_path`` (or that folder itself).

    Works when the (ddp, domain) layout differs from the one that saved it:
    replicated state is read by every rank, FSDP2 shards are resharded by DCP.
    RNG states are restored when the world size is the one that saved them
    (each rank gets its own); on another world size they are left alone.
    Returns None when there is no complete checkpoint.
    """
    path = Path(root_or_path)
    if not (path / _MANIFEST).is_file():
        path = latest_checkpoint(path)
        if path is None:
            return None
    elif not _is_complete(path):
        raise RuntimeError(f"checkpoint {path} is incomplete or corrupted (its files do not match its manifest)")
    meta = json.loads((path / _MANIFEST).read_text())
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    rng_key = f"rng.rank{_rank()}"
    world = dist.get_world_size() if dist.is_initialized() else 1
    same_world = meta.get("world_size") == world  # on another layout, rank r's saved RNG is another rank's
    has_rng = restore_rng and same_world and any(k == rng_key or k.startswith(rng_key + ".") for k in keys)
    if has_rng:
        state[rng_key] = _rng_state()
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if has_rng:
        _set_rng_state(state[rng_key])
    return Restored(path=path, step=int(meta["step"]), extra=meta.get("extra", {}), rng_restored=has_rng)
