"""Checkpoints: bit-identical resume, crash safety, integrity (hashes), no code run on load, finite saves."""

import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from physicsnemo_dp.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    begin_branch,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests._harness import distributed


def _shared_dir(name: str) -> Path:
    """A folder every rank agrees on (rank 0 empties it)."""
    path = Path(f"/tmp/pdp-ckpt-tests/{name}-{os.getppid()}")
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(model, opt, sched, steps, data_seed):
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6)  # draws from the (checkpointed) RNG
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _setup():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_resume_is_bit_identical(ctx):
    root = _shared_dir("resume")
    torch.manual_seed(100 + ctx.rank)
    model, opt, sched = _setup()
    _train(model, opt, sched, 3, 0)
    save_checkpoint(root, 3, model, opt, sched, extra={"epoch": 1, "sample": 24})
    reference = _train(model, opt, sched, 4, 0)

    torch.manual_seed(999)  # a fresh process would start elsewhere
    model2, opt2, sched2 = _setup()
    restored = load_checkpoint(root, model2, opt2, sched2)
    assert restored.step == 3 and restored.extra == {"epoch": 1, "sample": 24} and restored.rng_restored
    assert _train(model2, opt2, sched2, 4, 0) == reference  # bit for bit


@distributed(world_sizes=(2,), mesh_2d=False)
def test_killed_save_keeps_the_previous_checkpoint(ctx):
    root = _shared_dir("killed")
    model, opt, sched = _setup()
    save_checkpoint(root, 1, model, opt, sched)
    victim = sorted(p.name for p in (root / "step_00000001").iterdir() if p.suffix == ".distcp")[0]
    if ctx.rank == 0:
        # what a save killed mid-way leaves: a temporary folder, and a step folder whose
        # files do not match a manifest (e.g. a truncated file)
        (root / ".tmp-step_00000002").mkdir()
        (root / ".tmp-step_00000002" / "__0_0.distcp").write_bytes(b"partial")
        broken = root / "step_00000003"
        shutil.copytree(root / "step_00000001", broken)
        (broken / victim).write_bytes((broken / victim).read_bytes()[:10])
    dist.barrier()
    reason = f"step_00000003: size mismatch of file {victim}"
    with pytest.warns(CheckpointWarning, match=reason):
        assert latest_checkpoint(root).name == "step_00000001"
    with pytest.warns(CheckpointWarning, match=reason):
        restored = load_checkpoint(root, *_setup())
    assert restored.step == 1
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(root / "step_00000003", *_setup())
    save_checkpoint(root, 4, model, opt, sched)  # the next save cleans the leftovers
    assert not list(root.glob(".tmp-*"))


@distributed(world_sizes=(2, 3), mesh_2d=False)
def test_keep_limits_the_number_of_checkpoints(ctx):
    root = _shared_dir("keep")
    model, opt, sched = _setup()
    for step in range(4):
        save_checkpoint(root, step, model, opt, sched, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]


def _flip_a_bit(folder: Path) -> None:
    """Rank 0 changes one bit of ``folder``'s largest data file (its size stays: only the hash tells)."""
    if dist.get_rank() == 0:
        victim = max((p for p in folder.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    dist.barrier()


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


@distributed(world_sizes=(2,), mesh_2d=False)
def test_pruning_counts_only_verified_checkpoints_and_never_deletes_a_corrupt_one(ctx):
    root = _shared_dir("prune-verified")
    model, opt, sched = _setup()
    save_checkpoint(root, 1, model, opt, sched, keep=2)
    save_checkpoint(root, 2, model, opt, sched, keep=2)
    _flip_a_bit(root / "step_00000002")
    with pytest.warns(CheckpointWarning, match="step_00000002: hash mismatch .*; left in place and not counted"):
        save_checkpoint(root, 3, model, opt, sched, keep=2)
    assert _steps(root) == ["step_00000001", "step_00000002", "step_00000003"]  # 1 is the second good one
    with pytest.warns(CheckpointWarning, match="step_00000002: hash mismatch"):
        save_checkpoint(root, 4, model, opt, sched, keep=2)
    assert _steps(root) == ["step_00000002", "step_00000003", "step_00000004"]  # the corrupt one stays


@distributed(world_sizes=(2,), mesh_2d=False)
def test_a_branch_sets_aside_what_is_not_its_ancestor_and_prunes_only_its_line(ctx):
    root = _shared_dir("branches")
    model, opt, sched = _setup()
    first = begin_branch(root)
    assert first.set_aside == () and len(first.lineage) == 1 and first.lineage[0][1] == 0
    for step in (1, 2, 3):
        save_checkpoint(root, step, model, opt, sched, keep=0, lineage=first.lineage)
    restored = load_checkpoint(root / "step_00000002", *_setup())
    assert restored.lineage == first.lineage
    rewind = begin_branch(root, restored)  # from step 2 while step 3 exists
    assert rewind.lineage[:1] == first.lineage and rewind.lineage[1][1] == 2
    assert rewind.set_aside == ("step_00000003",) and rewind.aside == root / "superseded" / rewind.lineage[1][0]
    assert (rewind.aside / "step_00000003" / "manifest.json").is_file()  # moved whole, not deleted
    assert latest_checkpoint(root) == root / "step_00000002"
    # a folder of another line (here: the old branch's step 3 put back under another step) is never pruned,
    # never counted and never overwritten by this branch
    if ctx.rank == 0:
        os.replace(rewind.aside / "step_00000003", root / "step_00000009")
    dist.barrier()
    save_checkpoint(root, 3, model, opt, sched, keep=1, lineage=rewind.lineage)
    assert _steps(root) == ["step_00000003", "step_00000009"]  # its ancestors 1 and 2 pruned, step 9 left
    with pytest.raises(CheckpointError, match="step_00000009 not written: a folder of that name is there and is "
                                              "not this branch's"):
        save_checkpoint(root, 9, model, opt, sched, lineage=rewind.lineage)
    assert load_checkpoint(root / "step_00000003", *_setup()).lineage == rewind.lineage


@distributed(world_sizes=(2,), mesh_2d=False)
def test_check_extra_refuses_before_anything_is_loaded(ctx):
    root = _shared_dir("check-extra")
    model, opt, sched = _setup()
    save_checkpoint(root, 1, model, opt, sched, extra={"width": 16})
    target = _setup()
    with torch.no_grad():
        for p in target[0].parameters():
            p.zero_()
    before = _weights(target[0])

    def refuse(path, extra):
        raise ValueError(f"width {extra['width']} is not 8")

    with pytest.raises(CheckpointError, match="ValueError: width 16 is not 8") as raised:
        load_checkpoint(root, *target, check_extra=refuse)
    _same_on_every_rank(str(raised.value))
    assert all(torch.equal(a, b) for a, b in zip(_weights(target[0]), before))


def test_load_from_an_empty_folder_returns_none(tmp_path):
    assert load_checkpoint(tmp_path, _model()) is None


# --------------------------------------------------------------------------- #
# Helpers for corrupting and forging checkpoints
# --------------------------------------------------------------------------- #
def _same_on_every_rank(text: str) -> None:
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    assert len(set(texts)) == 1, texts


def _forge_manifest(folder: Path) -> None:
    """Rewrite the manifest to match the files as they now are, as someone who can write the folder can."""
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {p.name: p for p in folder.iterdir() if p.name != "manifest.json"}
    if "format" in manifest:
        manifest["files"] = {n: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                             for n, p in files.items()}
        body = {k: v for k, v in manifest.items() if k != "sha256"}
        manifest["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    else:
        manifest["files"] = {n: p.stat().st_size for n, p in files.items()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _save_format1(folder: Path, state: dict, step: int = 1, extra: dict | None = None) -> None:
    """A checkpoint as the older version wrote it: non-tensor state pickled by DCP, a manifest of sizes only."""
    dcp.save(state, checkpoint_id=str(folder))
    if dist.get_rank() == 0:
        sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
        manifest = {"step": step, "world_size": dist.get_world_size(), "extra": extra or {}, "files": sizes}
        (folder / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()


class _Plant:
    """Unpickling this creates ``marker``: what a malicious checkpoint would do (run code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _weights(model) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()]


# --------------------------------------------------------------------------- #
# Item 9: content hashes
# --------------------------------------------------------------------------- #
@distributed(world_sizes=(1, 2, 3), mesh_2d=False)
def test_a_bit_flip_is_found_named_and_skipped(ctx):
    root = _shared_dir("bitflip")
    model, opt, sched = _setup()
    save_checkpoint(root, 1, model, opt, sched)
    expected = _weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(root, 2, model, opt, sched)
    step2 = root / "step_00000002"
    victim = f"__{ctx.world_size - 1}_0.distcp"  # the last rank's data file: same size, one bit changed
    names = sorted(json.loads((step2 / "manifest.json").read_text())["files"])
    hasher = names.index(victim) % ctx.world_size  # the rank that hashes it, alone
    if ctx.rank == 0:
        data = bytearray((step2 / victim).read_bytes())
        data[len(data) // 2] ^= 0x10
        (step2 / victim).write_bytes(bytes(data))
    dist.barrier()
    reason = f"step_00000002: hash mismatch of file {victim} .*seen by rank {hasher}"
    with pytest.raises(CheckpointError, match=reason) as raised:
        load_checkpoint(step2, *_setup())
    _same_on_every_rank(str(raised.value))
    with pytest.warns(CheckpointWarning, match=reason):
        assert latest_checkpoint(root) == root / "step_00000001"
    model2, opt2, sched2 = _setup()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    with pytest.warns(CheckpointWarning, match=reason):
        restored = load_checkpoint(root, model2, opt2, sched2)
    assert restored.step == 1 and restored.verified
    assert all(torch.equal(a, b) for a, b in zip(_weights(model2), expected))


@distributed(world_sizes=(2,), mesh_2d=False)
def test_unreadable_or_missing_manifests_are_skipped_with_a_reason(ctx):
    root = _shared_dir("manifests")
    model, opt, sched = _setup()
    save_checkpoint(root, 1, model, opt, sched, keep=3)
    save_checkpoint(root, 2, model, opt, sched, keep=3)
    save_checkpoint(root, 3, model, opt, sched, keep=3)
    if ctx.rank == 0:
        (root / "step_00000003" / "manifest.json").write_bytes(b"\x80\x81garbage")  # UnicodeDecodeError
        (root / "step_00000002" / "manifest.json").unlink()
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_checkpoint(root, *_setup()).step == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(messages) == 2
    assert "step_00000003: file manifest.json: UnicodeDecodeError" in messages[0]
    assert "step_00000002: no manifest.json" in messages[1]
    if ctx.rank == 0:
        (root / "step_00000001" / "state.json").write_text("{}")  # the last one corrupt too: nothing loadable
    dist.barrier()
    with pytest.warns(CheckpointWarning, match="step_00000001: size mismatch of file state.json"):
        assert load_checkpoint(root, *_setup()) is None
    with pytest.raises(CheckpointError, match="step_00000002: no manifest.json"):
        load_checkpoint(root / "step_00000002", *_setup())  # an explicit folder: an error, not None


# --------------------------------------------------------------------------- #
# Item 10: loading runs no code from the checkpoint
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("manifest", ["forged", "untouched"])
@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_a_malicious_metadata_pickle_runs_nothing(ctx, manifest):
    root = _shared_dir("evil-metadata")
    marker = root / "pwned"
    model, opt, sched = _setup()
    folder = save_checkpoint(root, 1, model, opt, sched)
    if ctx.rank == 0:
        evil = pickle.dumps(_Plant(str(marker)))  # padded to the same size: only the hash can tell
        (folder / ".metadata").write_bytes(evil.ljust((folder / ".metadata").stat().st_size, b"\0"))
        if manifest == "forged":
            _forge_manifest(folder)
    dist.barrier()
    reason = "open is not part of DCP's metadata; refused" if manifest == "forged" else "hash mismatch of file .metadata"
    with pytest.raises(CheckpointError, match=f"step_00000001: .*{reason}"):
        load_checkpoint(folder, *_setup())
    assert not marker.exists()


@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_a_malicious_pickle_in_data_or_state_files_runs_nothing(ctx):
    root = _shared_dir("evil-data")
    marker = root / "pwned"
    model, opt, sched = _setup()
    folder = save_checkpoint(root, 1, model, opt, sched)
    evil = pickle.dumps(_Plant(str(marker)))
    victim = "__0_0.distcp"
    if ctx.rank == 0:  # the data file: a pickle where DCP expects torch.save's zip of a tensor
        size = (folder / victim).stat().st_size
        (folder / victim).write_bytes(evil + b"\0" * (size - len(evil)))
        _forge_manifest(folder)
    dist.barrier()
    with pytest.raises(CheckpointError, match=f"step_00000001: loading failed .*rank.*: file {victim}: ") as raised:
        load_checkpoint(folder, *_setup())
    _same_on_every_rank(str(raised.value))
    assert not marker.exists()
    folder = save_checkpoint(root, 2, model, opt, sched)
    if ctx.rank == 0:  # the non-tensor state (scheduler, optimizer hyper-parameters, extra)
        (folder / "state.json").write_bytes(evil)
        _forge_manifest(folder)
    dist.barrier()
    with pytest.raises(CheckpointError, match="step_00000002: file state.json: UnicodeDecodeError"):
        load_checkpoint(folder, *_setup())
    assert not marker.exists()


@distributed(world_sizes=(1, 2), mesh_2d=False)
def test_an_older_checkpoint_with_a_pickled_object_runs_nothing(ctx):
    """The older format stored the scheduler as pickles in DCP's data files: read ``weights_only``."""
    root = _shared_dir("evil-format1")
    marker = root / "pwned"
    model, opt, sched = _setup()
    _save_format1(root / "step_00000001", {"model": get_model_state_dict(model),
                                           "scheduler": {**sched.state_dict(), "last_epoch": _Plant(str(marker))}})
    with pytest.warns(CheckpointWarning, match="older format .*unverified"):
        with pytest.raises(CheckpointError, match=r"step_00000001: loading failed .*file __\d_0.distcp: Unpickling"):
            load_checkpoint(root / "step_00000001", _model(), None, sched)
    assert not marker.exists()


@distributed(world_sizes=(2,), mesh_2d=False)
def test_an_older_checkpoint_still_loads_unverified(ctx):
    root = _shared_dir("format1")
    model, opt, sched = _setup()
    _train(model, opt, sched, 2, 0)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
             "scheduler": sched.state_dict()}
    _save_format1(root / "step_00000002", state, step=2, extra={"epoch": 3})
    model2, opt2, sched2 = _setup()
    with pytest.warns(CheckpointWarning, match="step_00000002 has a manifest of the older format"):
        restored = load_checkpoint(root, model2, opt2, sched2)
    assert (restored.step, restored.extra, restored.verified, restored.rng_restored) == (2, {"epoch": 3}, False, False)
    assert sched2.state_dict() == sched.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(_weights(model2), _weights(model)))
    assert str(opt2.state_dict()) == str(opt.state_dict())


@distributed(world_sizes=(2,), mesh_2d=False)
def test_nothing_saved_is_a_pickle(ctx):
    """Only tensors go through DCP; the rest is JSON (state.json, rng.rank<r>.json)."""
    root = _shared_dir("no-pickles")
    model, opt, sched = _setup()
    _train(model, opt, sched, 1, 0)
    folder = save_checkpoint(root, 1, model, opt, sched, extra={"epoch": (1, 2)})
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()  # our own file: plain pickle is fine here
    assert not [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
    state = json.loads((folder / "state.json").read_text())
    assert state["state"]["scheduler"]["last_epoch"] == 1 and state["extra"] == {"epoch": [1, 2]}
    assert {f"rng.rank{r}.json" for r in range(ctx.world_size)} <= {p.name for p in folder.iterdir()}
    assert load_checkpoint(folder, _model()).step == 1  # the model alone, from a checkpoint with more


def test_pickled_objects_in_data_files_are_refused_or_read_weights_only(tmp_path):
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from physicsnemo_dp.checkpoint import _Planner

    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save(_Plant(str(marker)), buffer)
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("x"), torch.Size([0]), MetadataIndex("x"),
                    torch.Size([0]), torch.Size([0]))
    with pytest.raises(CheckpointError, match="'x' is stored as a pickled object"):
        _Planner(allow_bytes=False).load_bytes(item, io.BytesIO(buffer.getvalue()))
    planner = _Planner(allow_bytes=True)
    planner.state_dict = {}
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(item, io.BytesIO(buffer.getvalue()))
    assert not marker.exists()


# --------------------------------------------------------------------------- #
# Item 12: never a non-finite state
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("where", ["model", "optimizer"])
@distributed(world_sizes=(1, 2, 3), mesh_2d=False)
def test_a_non_finite_state_is_not_saved(ctx, where):
    root = _shared_dir("finite")
    model, opt, sched = _setup()
    _train(model, opt, sched, 1, 0)
    culprit = ctx.world_size - 1  # one rank only
    if ctx.rank == culprit:
        with torch.no_grad():
            model[0].bias[0] = 3e38  # finite, though the fused check's 2-norm overflows: still saved
    save_checkpoint(root, 1, model, opt, sched)
    name = "model.2.bias" if where == "model" else "optimizer.state.0.weight.exp_avg"
    if ctx.rank == culprit:
        with torch.no_grad():
            (model[2].bias if where == "model" else opt.state[model[0].weight]["exp_avg"])[0] = float("nan")
    with pytest.raises(CheckpointError, match=f"step_00000002 not written: non-finite values in {name} on rank {culprit};"):
        save_checkpoint(root, 2, model, opt, sched)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # nothing written, the previous kept
    assert save_checkpoint(root, 2, model, opt, sched, check_finite=False).is_dir()  # opt-out
