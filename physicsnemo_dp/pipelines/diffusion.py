"""``DiffusionPipeline``: named networks and the non-network parts of a diffusion model, under one MeshContext.

A regression-plus-diffusion model (CorrDiff / StormCast style downscaling) is
several networks — a ``"regression"`` network predicting the mean, a
``"denoiser"`` generating the residual — plus parts that are not networks:
the noise schedule and the sampler's settings. The pipeline holds them
together and follows the topology-ownership rule of
:class:`~physicsnemo_dp.distributed.ModelParallelizer`:

* the caller resolves **one** :class:`~physicsnemo_dp.distributed.MeshContext`;
  :meth:`DiffusionPipeline.from_components` (or :meth:`~DiffusionPipeline.from_checkpoint`)
  runs every selected component through ``parallelize_model`` with that same
  context and returns the pipeline itself; there is no per-component policy
  map (``tools/lint_parallelizer_contract.py`` rule PC004 refuses one);
* ``frozen`` components stay plain modules, replicated (rank 0's weights on
  every rank), in eval mode, with ``requires_grad=False``: nothing trains
  them and no data-parallel wrapper is built around them;
* without a MeshContext nothing is changed: the pipeline runs in one process.

Saving and loading go through :mod:`physicsnemo_dp.checkpoint` — one verified,
hashed checkpoint per component under ``root/<name>/step_<n>``, the schedule
and sampler settings in each checkpoint's JSON ``extra`` — so a loader can
load just the components it needs (``components_to_load``), on any layout,
without running code from the files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..distributed import MeshContext, parallelize_model
from ..sync import sync_module_over_mesh
from .edm import EDMSchedule, HeunSampler, edm_loss

__all__ = ["DiffusionPipeline", "DENOISER", "REGRESSION"]

#: The component :meth:`DiffusionPipeline.sample` and :meth:`~DiffusionPipeline.loss` denoise with.
DENOISER = "denoiser"
#: The optional component whose prediction is the mean the denoiser's residual is added to.
REGRESSION = "regression"
_CONFIG = "diffusion_pipeline"


def _names(value, argument: str, known: Iterable[str]) -> tuple[str, ...]:
    """``value`` as a tuple of known component names (a clear error naming ``argument`` otherwise)."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"{argument} must be a list of component names, got {value!r}")
    names, known = tuple(value), tuple(known)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{argument} must be a list of component names, got {value!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{argument} names {unknown}, which are not components of the pipeline {list(known)}")
    return names


def _replicate(module: nn.Module, mesh_context: MeshContext) -> None:
    """Rank 0's plain weights on every rank of each axis of size > 1 (a component kept out of the wrappers)."""
    if not any(True for _ in module.parameters()) and not any(True for _ in module.buffers()):
        return
    for axis in ("domain", "ddp"):
        if mesh_context.mesh[axis].size() > 1:
            sync_module_over_mesh(module, mesh_context.mesh[axis])


class DiffusionPipeline:
    """Named network components, an :class:`EDMSchedule` and a :class:`HeunSampler`.

    Build it with :meth:`from_components` or :meth:`from_checkpoint`.
    ``pipeline["denoiser"]`` is a component (parallelized: possibly a DDP
    wrapper); :attr:`components`, :attr:`frozen`, :attr:`parallelized`,
    :attr:`schedule`, :attr:`sampler` and :attr:`mesh_context` describe it.
    """

    def __init__(self, components: Mapping[str, nn.Module], *, schedule: EDMSchedule, sampler: HeunSampler,
                 mesh_context: MeshContext | None, parallelized: tuple[str, ...], frozen: tuple[str, ...]):  # fmt: skip
        self._components = dict(components)
        self.schedule, self.sampler, self.mesh_context = schedule, sampler, mesh_context
        self.parallelized, self.frozen = parallelized, frozen

    # ------------------------------------------------------------ construction
    @classmethod
    def from_components(
        cls,
        components: Mapping[str, nn.Module],
        *,
        mesh_context: MeshContext | None = None,
        components_to_parallelize: Iterable[str] | None = None,
        frozen: Iterable[str] = (),
        schedule: EDMSchedule | None = None,
        sampler: HeunSampler | None = None,
    ) -> "DiffusionPipeline":
        """The pipeline of ``components`` (name -> module), each selected one parallelized for ``mesh_context``.

        ``components_to_parallelize`` defaults to every component not in
        ``frozen``. With a ``mesh_context``, each selected component goes
        through ``parallelize_model(module, mesh_context)`` — its sidecar, the
        context's strategy, checkpointing, precision and trainability — and
        replaces the module in the pipeline; every other component is
        replicated (rank 0's weights broadcast over both axes). Frozen
        components get ``requires_grad=False`` and eval mode, with or
        without a context. Move modules to ``mesh_context.device`` first, and
        build the optimizer afterwards (over :meth:`trainable_parameters`).

        Raises:
            TypeError: ``components`` is not a mapping of names to modules, or
                a name list is a string / not names; ``mesh_context`` is not a
                MeshContext.
            ValueError: no components; a name in ``frozen`` or
                ``components_to_parallelize`` that is not a component; a
                component both frozen and selected for parallelization.
            CapabilityError: a selected component cannot be parallelized as the
                context asks (raised by ``parallelize_model``, like its other errors).
        """
        if not isinstance(components, Mapping) or not components:
            raise ValueError(f"components must be a non-empty mapping of names to nn.Modules, got {components!r}")
        bad = [n for n, m in components.items() if not isinstance(n, str) or not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"components must map names (str) to nn.Modules; {bad} do not")
        if mesh_context is not None and not isinstance(mesh_context, MeshContext):
            raise TypeError(
                f"mesh_context must be a MeshContext or None, got {type(mesh_context).__name__}; build one with "
                "MeshContext.build(...) or MeshContext.from_mesh(mesh)"
            )
        frozen = _names(frozen, "frozen", components)
        if components_to_parallelize is None:
            selected = tuple(n for n in components if n not in frozen)
        else:
            selected = _names(components_to_parallelize, "components_to_parallelize", components)
        both = [n for n in selected if n in frozen]
        if both:
            raise ValueError(
                f"components {both} are both frozen and in components_to_parallelize; a frozen component stays "
                "replicated and untrained, so leave it out of components_to_parallelize"
            )
        modules = dict(components)
        for name in frozen:
            modules[name].requires_grad_(False)
            modules[name].eval()
        if mesh_context is not None:
            for name, module in modules.items():
                if name in selected:
                    modules[name] = parallelize_model(module, mesh_context)
                else:
                    _replicate(module, mesh_context)
        return cls(modules, schedule=schedule or EDMSchedule(), sampler=sampler or HeunSampler(),
                   mesh_context=mesh_context, parallelized=selected if mesh_context is not None else (),
                   frozen=frozen)  # fmt: skip

    @classmethod
    def from_checkpoint(
        cls,
        root: str | os.PathLike,
        components: Mapping[str, nn.Module],
        *,
        mesh_context: MeshContext | None = None,
        components_to_load: Iterable[str] | None = None,
        components_to_parallelize: Iterable[str] | None = None,
        frozen: Iterable[str] = (),
        step: int | None = None,
    ) -> "DiffusionPipeline":
        """Load a pipeline saved by :meth:`save` into freshly built ``components`` (name -> module).

        A checkpoint holds tensors and JSON only (no code), so the caller
        builds each component's architecture. ``components_to_load`` (default:
        every component saved) selects which are built, parallelized as in
        :meth:`from_components` with the one ``mesh_context``, and loaded —
        after parallelizing, so FSDP2 shards load their part and a layout other
        than the saving one works. The schedule and sampler come from the
        checkpoint. ``step`` picks ``step_<n>``; by default the newest verified one.
        Collective when a process group exists (every rank calls it).

        Raises:
            CheckpointError: no pipeline under ``root``, a component's
                checkpoint missing or failing verification, components whose
                checkpoints disagree on the schedule/sampler, weights that do
                not fit the module.
            ValueError / TypeError: as :meth:`from_components`, and a name in
                ``components_to_load`` that was not saved or not given.
        """
        root = Path(root)
        saved = cls._saved_config(root)
        names = _names(saved["components"] if components_to_load is None else components_to_load,
                       "components_to_load", saved["components"])  # fmt: skip
        missing = [n for n in names if n not in components]
        if missing:
            raise ValueError(f"components_to_load names {missing}, but components has no module for them; "
                             f"pass a freshly built module for each of {list(names)}")
        pipeline = cls.from_components(
            {n: components[n] for n in names}, mesh_context=mesh_context,
            components_to_parallelize=components_to_parallelize, frozen=frozen,
            schedule=EDMSchedule(**saved["schedule"]), sampler=HeunSampler(**saved["sampler"]),
        )  # fmt: skip
        for name in names:
            folder = root / name if step is None else root / name / f"step_{step:08d}"
            restored = load_checkpoint(folder, pipeline[name], restore_rng=False)
            if restored is None:
                raise CheckpointError(f"pipeline {root}: component {name!r} has no loadable checkpoint in {folder}")
            if restored.extra.get(_CONFIG) != saved:
                raise CheckpointError(
                    f"pipeline {root}: the checkpoint of component {name!r} ({restored.path}) was saved with another "
                    f"schedule/sampler than the rest ({restored.extra.get(_CONFIG)} vs {saved})"
                )
        return pipeline

    @staticmethod
    def _saved_config(root: Path) -> dict:
        """The pipeline description indexed in ``root/pipeline.json``: read by rank 0, the same verdict everywhere.

        Rank 0 broadcasts the document or its error, so a missing or malformed
        index raises the same CheckpointError on every rank (none is left in
        the collectives of parallelizing). Each component's hashed checkpoint
        carries the same description, which the loader then compares.
        """
        box = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            index = root / "pipeline.json"
            try:
                config = json.loads(index.read_text())
                if not (isinstance(config, dict) and isinstance(config.get("components"), list)
                        and isinstance(config.get("schedule"), dict) and isinstance(config.get("sampler"), dict)):
                    raise ValueError("expected components, schedule and sampler")
                box = [config]
            except FileNotFoundError:
                box = [f"pipeline {root}: no pipeline.json (not a folder written by DiffusionPipeline.save)"]
            except (OSError, ValueError) as err:
                box = [f"pipeline {root}: pipeline.json is malformed ({err})"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise CheckpointError(box[0])
        return box[0]

    # --------------------------------------------------------------- access
    @property
    def components(self) -> Mapping[str, nn.Module]:
        """Name -> module (a parallelized component is its wrapper, e.g. DDP)."""
        return dict(self._components)

    def __getitem__(self, name: str) -> nn.Module:
        if name not in self._components:
            raise KeyError(f"the pipeline has no component {name!r}; it has {list(self._components)}")
        return self._components[name]

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters of the components that are not frozen and require grad: what an optimizer updates."""
        return [p for n, m in self._components.items() if n not in self.frozen for p in m.parameters()
                if p.requires_grad]  # fmt: skip

    def config(self) -> dict:
        """The JSON-able description stored with a checkpoint: component names, schedule, sampler."""
        return {"components": list(self._components), "schedule": self.schedule.to_dict(),
                "sampler": self.sampler.to_dict()}  # fmt: skip

    # ----------------------------------------------------------- diffusion
    def _mean(self, condition: torch.Tensor | None):
        if REGRESSION not in self._components:
            return None
        with torch.no_grad():
            return self._components[REGRESSION](condition)

    def loss(self, target: torch.Tensor, condition: torch.Tensor | None = None, *,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """The EDM loss of the denoiser on ``target`` (minus the regression's mean, if there is a regression).

        The regression's mean is computed without gradient: it is trained
        beforehand (and usually ``frozen``), as in regression-plus-diffusion
        downscaling; only the denoiser learns from this loss.
        """
        mean = self._mean(condition)
        residual = target if mean is None else target - mean
        return edm_loss(self[DENOISER], residual, condition, schedule=self.schedule, generator=generator)

    @torch.no_grad()
    def sample(self, latents: torch.Tensor, condition: torch.Tensor | None = None, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """A sample from standard-normal ``latents`` (plus the regression's mean, if there is a regression).

        Draw ``latents`` sharded, e.g. ``physicsnemo_dp.random.randn_like(template,
        generator=g)`` on a ShardTensor template (O(local)): the sample is then
        the same for every decomposition, and for the plain template in one process.
        """
        residual = self.sampler.sample(self[DENOISER], latents, condition, schedule=self.schedule, generator=generator)
        mean = self._mean(condition)
        return residual if mean is None else mean + residual

    # ------------------------------------------------------------- saving
    def save(self, root: str | os.PathLike, step: int = 0, keep: int = 2) -> Path:
        """Save every component as a verified checkpoint under ``root/<name>`` (collective).

        Each component's checkpoint (:func:`physicsnemo_dp.checkpoint.save_checkpoint`:
        SHA-256 per file, JSON non-tensor state) carries the pipeline
        description in its ``extra``; ``root/pipeline.json`` indexes them.
        Returns ``root``.
        """
        root = Path(root)
        config = self.config()
        for name, module in self._components.items():
            save_checkpoint(root / name, step, module, extra={_CONFIG: config}, keep=keep)
        if not dist.is_initialized() or dist.get_rank() == 0:
            tmp = root / ".pipeline.json.tmp"
            tmp.write_text(json.dumps(config, indent=1))
            os.replace(tmp, root / "pipeline.json")
        if dist.is_initialized():
            dist.barrier()
        return root
