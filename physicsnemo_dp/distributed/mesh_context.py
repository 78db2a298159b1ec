"""``MeshContext``: the one resolved runtime input of model parallelization.

A training script decides *how* to run once — mesh shape, data-parallel
strategy, activation checkpointing, mixed precision, frozen parameters — and
hands that single object to :func:`~physicsnemo_dp.distributed.parallelize_model`.
Model code never parses distributed configuration or builds meshes itself.

The mesh always has the two axes ``("ddp", "domain")``:

* ``"ddp"``: ranks that see *different samples*; they hold replicas (DDP) or
  FSDP2 shards of the weights and average gradients.
* ``"domain"``: ranks that split *one sample*; inputs are ShardTensors on
  :attr:`MeshContext.domain_mesh` and weights are identical plain tensors
  whose gradients promotion sums over the axis.

Either axis may have size 1, so one code path covers pure data parallelism,
pure domain parallelism and a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from .config import ActivationCheckpointing, FSDP2Config, Strategy, Trainability, resolve_strategy

__all__ = ["MeshContext", "AXES"]

#: The mesh axis names, outermost first.
AXES = ("ddp", "domain")


def _check_size(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def resolve_sizes(world_size: int, domain_size: int | None, ddp_size: int | None) -> tuple[int, int]:
    """``(ddp_size, domain_size)`` whose product is ``world_size``, inferring the one not given."""
    _check_size("domain_size", domain_size)
    _check_size("ddp_size", ddp_size)
    if domain_size is None and ddp_size is None:
        raise ValueError("give domain_size or ddp_size (or both); the other is inferred from the world size")
    given, name = (domain_size, "domain_size") if ddp_size is None else (ddp_size, "ddp_size")
    if domain_size is None or ddp_size is None:
        if world_size % given:
            raise ValueError(f"{name}={given} does not divide the world size {world_size}")
        other = world_size // given
        domain_size, ddp_size = (given, other) if name == "domain_size" else (other, given)
    if ddp_size * domain_size != world_size:
        raise ValueError(
            f"ddp_size={ddp_size} x domain_size={domain_size} = {ddp_size * domain_size} "
            f"ranks, but the world size is {world_size}"
        )
    return ddp_size, domain_size


def _ensure_process_group(backend: str | None, device_type: str, timeout: timedelta | None = None) -> None:
    """Join the default process group: from torchrun's environment, or alone (world size 1).

    A script started with plain ``python`` has no ``WORLD_SIZE``; it gets a
    single-rank group on an in-memory store, so the same script runs with and
    without ``torchrun``. ``timeout`` bounds every collective (None: torch's default).
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _normalize_checkpointing(value) -> ActivationCheckpointing | None:
    if value is True:
        return ActivationCheckpointing()
    if value is None or value is False or isinstance(value, ActivationCheckpointing):
        return value or None
    raise TypeError(f"activation_checkpointing must be an ActivationCheckpointing, a bool or None, got {value!r}")


@dataclass(frozen=True)
class MeshContext:
    """A ``("ddp", "domain")`` device mesh plus the policies that say how to parallelize on it.

    Build it with :meth:`build` (from the world size) or :meth:`from_mesh` (an
    existing mesh). Every rank must build it with the same arguments.

    Attributes:
        mesh: 2-D DeviceMesh with dim names ``("ddp", "domain")``.
        strategy: :class:`DDPConfig`, :class:`FSDP2Config` or None (no
            data-parallel wrapper; weights are still synchronized).
        activation_checkpointing: :class:`ActivationCheckpointing` or None
            (``True`` is accepted for the default policy).
        mixed_precision: an FSDP2 ``MixedPrecisionPolicy`` or None (fp32).
            Only FSDP2 applies it, so it needs ``strategy=FSDP2Config``.
        trainability: which parameters are frozen.
        gradient_bucket_mb: the gradients that weights promoted over
            ``"domain"`` receive are summed in buckets of at most this many
            MiB, one all-reduce per bucket, in reverse order like DDP's
            buckets (:func:`physicsnemo_dp.bucket_gradients`); None sums them
            per layer call. Default 25, DDP's default. Not applied under
            FSDP2 (the promoted weights are its unsharded copies) nor when
            ``"domain"`` has one rank (nothing to sum).
    """

    mesh: DeviceMesh
    strategy: Strategy = None
    activation_checkpointing: ActivationCheckpointing | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    trainability: Trainability = field(default_factory=Trainability)
    gradient_bucket_mb: float | None = 25.0

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(self.mesh).__name__}")
        names = tuple(self.mesh.mesh_dim_names or ())
        if names != AXES:
            raise ValueError(
                f"the mesh must have dim names {AXES} (outermost first), got {names or 'no names'} "
                f"of shape {tuple(self.mesh.shape)}; build it with "
                f'init_device_mesh(device, (ddp_size, domain_size), mesh_dim_names={AXES}) '
                "or use MeshContext.build"
            )
        object.__setattr__(self, "strategy", resolve_strategy(self.strategy))
        object.__setattr__(self, "activation_checkpointing", _normalize_checkpointing(self.activation_checkpointing))
        if self.mixed_precision is not None:
            if not isinstance(self.mixed_precision, MixedPrecisionPolicy):
                raise TypeError(
                    "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                    f"got {type(self.mixed_precision).__name__}"
                )
            if not isinstance(self.strategy, FSDP2Config):
                raise ValueError(
                    "mixed_precision is applied by FSDP2; use strategy=FSDP2Config() with it, or run "
                    "the DDP training step under torch.autocast"
                )
        if not isinstance(self.trainability, Trainability):
            raise TypeError(f"trainability must be a Trainability, got {type(self.trainability).__name__}")
        cap = self.gradient_bucket_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(
                f"gradient_bucket_mb must be a positive number of MiB or None (one all-reduce per layer call), "
                f"got {cap!r}"
            )

    # ------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        domain_size: int | None = None,
        ddp_size: int | None = None,
        *,
        strategy=None,
        device_type: str | None = None,
        backend: str | None = None,
        timeout: float | timedelta | None = None,
        **policies,
    ) -> "MeshContext":
        """Build the mesh for the current world and wrap it.

        The size not given is inferred: ``build(domain_size=2)`` on 8 ranks
        gives a (4, 2) mesh. Joins the default process group first if needed
        (torchrun's environment, or a single-rank group without one).
        ``policies`` are the remaining fields (``activation_checkpointing``,
        ``mixed_precision``, ``trainability``, ``gradient_bucket_mb``). ``timeout`` (seconds or a
        timedelta) is the process group's collective timeout when this call
        creates the group: a rank that stops makes the others fail after it
        instead of waiting forever (ignored when the group already exists).

        Raises:
            TypeError: a size that is not an int.
            ValueError: no size given, a size < 1, sizes that do not multiply
                to the world size, an unknown strategy.
        """
        strategy = resolve_strategy(strategy)  # fail before any process group exists
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if device_type == "cuda":  # before NCCL initializes: one GPU per local rank
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            if timeout <= 0:
                raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
            timeout = timedelta(seconds=timeout)
        _ensure_process_group(backend, device_type, timeout)
        sizes = resolve_sizes(dist.get_world_size(), domain_size, ddp_size)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=AXES)
        return cls(mesh, strategy, **policies)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, *, strategy=None, **policies) -> "MeshContext":
        """Wrap an existing ``("ddp", "domain")`` mesh (see the class for ``policies``)."""
        return cls(mesh, strategy, **policies)

    # ---------------------------------------------------------------- views
    @property
    def ddp_mesh(self) -> DeviceMesh:
        """1-D submesh of the ranks that share this rank's domain coordinate."""
        return self.mesh["ddp"]

    @property
    def domain_mesh(self) -> DeviceMesh:
        """1-D submesh over which one sample is split: put inputs (ShardTensors) on it."""
        return self.mesh["domain"]

    @property
    def ddp_size(self) -> int:
        return self.mesh.size(0)

    @property
    def domain_size(self) -> int:
        return self.mesh.size(1)

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def ddp_rank(self) -> int:
        """This rank's coordinate on ``"ddp"``: which subset of the samples it sees."""
        return self.mesh.get_coordinate()[self.mesh.mesh_dim_names.index("ddp")]

    @property
    def domain_rank(self) -> int:
        """This rank's coordinate on ``"domain"``: which piece of each sample it holds."""
        return self.mesh.get_coordinate()[self.mesh.mesh_dim_names.index("domain")]

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)
