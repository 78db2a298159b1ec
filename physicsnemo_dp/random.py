"""Random numbers that do not depend on the decomposition: seeding, named streams, sharded factories.

Every random op on a ShardTensor (``torch.randn_like(x)``, ``x.normal_()``,
``F.dropout(x)``, ...) and the factories here give each element a value that
depends only on (a key drawn from torch's generator, the element's global
index): the same tensor for every world size, mesh shape and uneven split
(bitwise on one device type), computed in O(local) memory without
communication. Details and the exact recipe: ``docs/random.md``.

* :func:`randn`, :func:`rand`, :func:`randint` build a ShardTensor directly
  from a global shape, mesh and placements; without a mesh they return the
  whole tensor as a plain tensor with the same values (the one-process
  reference, e.g. for a sampler that must match its sharded run).
* :func:`randn_like`, :func:`rand_like` do the same for an existing tensor,
  plain or sharded.
* :func:`stream` is a named, seeded stream: a context manager that routes
  every draw on its device (plain and sharded) to it, or a generator to pass
  as ``generator=``.
* :func:`manual_seed` seeds every device like ``torch.manual_seed`` and, given
  a mesh, verifies that every rank passed the same seed.

Each draw takes one key from torch's generator (or ``generator=``), which
advances it by the same amount on every rank, so ``torch.manual_seed``,
``torch.random.fork_rng``, ``physicsnemo_dp.checkpoint`` (which saves torch's
generator states) and activation-checkpoint recomputation all govern these
draws, and plain draws afterwards stay in sync across ranks.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from . import _philox, collectives
from .errors import PlacementError
from .rules.random import distribution_values, draw_key
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec

__all__ = ["Stream", "manual_seed", "rand", "rand_like", "randint", "randn", "randn_like", "stream"]


# --------------------------------------------------------------------------- #
# Seeding and streams
# --------------------------------------------------------------------------- #
def manual_seed(seed: int, mesh: DeviceMesh | None = None) -> None:
    """Seed torch's generators on every device (``torch.manual_seed``).

    Decomposition-invariant draws need every rank's generator in the same
    state. With ``mesh`` given, the ranks also compare their seeds (one small
    all-gather) and all raise the same :class:`~physicsnemo_dp.PlacementError`
    if they differ, instead of silently drawing shards from different keys.
    """
    seed = int(seed)
    if mesh is not None:
        rows = collectives.gather_ints([seed], mesh)
        seeds = sorted({row[0] for row in rows})
        if len(seeds) > 1:
            raise PlacementError(
                f"manual_seed: ranks passed different seeds {seeds}; pass the same seed on every rank "
                "(derive per-rank randomness from physicsnemo_dp.random.stream(name, seed) instead)"
            )
    torch.manual_seed(seed)


def _stream_seed(name: str, seed: int) -> int:
    """A 63-bit seed from (name, seed), stable across processes and Python versions (unlike ``hash``)."""
    digest = hashlib.sha256(f"{name}\0{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class Stream:
    """A named random stream: its own generator, seeded from ``(name, seed)``.

    Independent of torch's default generator, so drawing from it leaves the
    global stream (and thus weight init, data shuffling) untouched, and two
    streams with different names are independent. Use it as

    * ``generator=`` of any draw: ``torch.randn_like(x, generator=s.generator)``,
      ``physicsnemo_dp.random.randn(shape, mesh, placements, generator=s.generator)``;
    * a context manager: inside ``with s:`` the default generator of the
      stream's device *is* the stream (its state is swapped in and back out,
      like ``fork_rng``), so code that does not take a ``generator=`` — e.g.
      ``F.dropout`` — draws from it.

    Save and restore it with :meth:`get_state` / :meth:`set_state` (a uint8
    tensor, like ``torch.Generator.get_state``).
    """

    def __init__(self, name: str, seed: int = 0, device: torch.device | str = "cpu"):
        self.name = str(name)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(_stream_seed(self.name, self.seed))
        self._saved: list[torch.Tensor] = []

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def __enter__(self) -> torch.Generator:
        default = _default_generator(self.device)
        self._saved.append(default.get_state())
        default.set_state(self.generator.get_state())
        return self.generator

    def __exit__(self, *exc) -> None:
        default = _default_generator(self.device)
        self.generator.set_state(default.get_state())
        default.set_state(self._saved.pop())

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, seed={self.seed}, device={str(self.device)!r})"


def stream(name: str, seed: int = 0, device: torch.device | str = "cpu") -> Stream:
    """A named stream seeded from ``(name, seed)``; see :class:`Stream`."""
    return Stream(name, seed, device)


# --------------------------------------------------------------------------- #
# Factories
# --------------------------------------------------------------------------- #
def _layout(global_shape, mesh, placements, dim_sizes, dtype) -> ShardTensorSpec:
    if placements is None:
        raise TypeError("placements is required with a mesh, e.g. [Shard(0)] or [Replicate()]")
    if dim_sizes is None:
        return ShardTensorSpec.chunked(mesh, placements, global_shape, dtype)
    return ShardTensorSpec.from_sizes(mesh, placements, global_shape, dtype, dim_sizes)


def _factory(kind, params, global_shape, mesh, placements, dim_sizes, dtype, device, generator, requires_grad):
    global_shape = tuple(int(s) for s in global_shape)
    if mesh is None:  # the one-process reference: the whole tensor, same key consumption
        # device=None means torch's default device, as for torch.randn (CPU unless set_default_device)
        device = torch.device(device) if device is not None else torch.get_default_device()
        key = _philox.draw_key(device, generator)
        out = _plain(kind, params, key, global_shape, dtype, device)
        return out.requires_grad_(requires_grad)
    spec = _layout(global_shape, mesh, placements, dim_sizes, dtype)
    device = collectives.mesh_device(mesh)
    key = draw_key(device, generator, mesh)
    local = distribution_values(kind, key, spec, dtype, device, params)
    return ShardTensor.from_spec(local, spec).requires_grad_(requires_grad)


class _WholeSpec:
    """The layout "one box holding everything", for the plain reference (no mesh needed)."""

    def __init__(self, shape):
        self.global_shape = tuple(shape)
        self.local_shape = tuple(shape)

    def local_offsets(self):
        return (0,) * len(self.global_shape)


def _plain(kind, params, key, shape, dtype, device):
    return distribution_values(kind, key, _WholeSpec(shape), dtype, device, params)


def randn(
    global_shape: Sequence[int],
    mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    dim_sizes=None,
    dtype: torch.dtype | None = None,
    device=None,
    generator: torch.Generator | None = None,
    requires_grad: bool = False,
):
    """Standard normal values of ``global_shape``, sharded over ``mesh`` by ``placements``.

    ``dim_sizes`` gives explicit shard sizes per dim (``ShardTensorSpec.from_sizes``),
    else the split rule applies. Without ``mesh``: the whole tensor as a plain
    tensor on ``device`` (default: torch's default device, CPU unless
    ``torch.set_default_device``), with the values every sharded draw of
    the same shape and generator state gives.
    """
    dtype = dtype or torch.get_default_dtype()
    return _factory("normal", {}, global_shape, mesh, placements, dim_sizes, dtype, device, generator, requires_grad)


def rand(
    global_shape: Sequence[int],
    mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    dim_sizes=None,
    dtype: torch.dtype | None = None,
    device=None,
    generator: torch.Generator | None = None,
    requires_grad: bool = False,
):
    """Values uniform in ``[0, 1)``; arguments as :func:`randn`."""
    dtype = dtype or torch.get_default_dtype()
    return _factory("uniform", {}, global_shape, mesh, placements, dim_sizes, dtype, device, generator, requires_grad)


def randint(
    low: int,
    high: int,
    global_shape: Sequence[int],
    mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    dim_sizes=None,
    dtype: torch.dtype = torch.int64,
    device=None,
    generator: torch.Generator | None = None,
):
    """Integers uniform in ``[low, high)``; arguments as :func:`randn`."""
    low, high = int(low), int(high)
    if low >= high:
        raise ValueError(f"randint: low must be < high, got low={low}, high={high}")
    params = {"low": low, "high": high}
    return _factory("integers", params, global_shape, mesh, placements, dim_sizes, dtype, device, generator, False)


def _like(kind, x, dtype, generator):
    dtype = dtype or x.dtype
    if isinstance(x, ShardTensor):
        op = torch.randn_like if kind == "normal" else torch.rand_like
        return op(x, dtype=dtype, generator=generator)
    key = _philox.draw_key(x.device, generator)
    return _plain(kind, {}, key, tuple(x.shape), dtype, x.device)


def randn_like(x: torch.Tensor, *, dtype: torch.dtype | None = None, generator: torch.Generator | None = None):
    """``torch.randn_like`` that gives the same values for a plain tensor and for any sharding of it.

    On a ShardTensor it *is* ``torch.randn_like``; on a plain tensor it
    evaluates the same counter-based generator over the whole tensor (torch's
    own ``randn_like`` on a plain tensor uses torch's stream instead).
    """
    return _like("normal", x, dtype, generator)


def rand_like(x: torch.Tensor, *, dtype: torch.dtype | None = None, generator: torch.Generator | None = None):
    """Uniform ``[0, 1)`` counterpart of :func:`randn_like`."""
    return _like("uniform", x, dtype, generator)
