"""``simulate(setup, world_size=...)``: one rank of a job of any size, on one CPU, without data.

The step runs through the real op rules: the library cannot tell it apart
from a run on a real mesh, except that

* the process group is torch's fake one (every collective returns at once;
  the library still counts what it would move, from the layouts);
* every tensor is a meta tensor (shapes, dtypes and strides, no memory, no
  arithmetic), so a step that needs terabytes costs nothing but planning.

What comes back is :func:`~physicsnemo_dp.debug.explain`'s table for that
rank, in which bytes and memory are the real run's (``LiveBytes`` counts meta
storages as if they held memory) and time is the per-op planning and
dispatch cost (there is no arithmetic to time).

**One rank, not the job.** Each call plays one rank (``rank=``, default 0):
uneven layouts give ranks different shards, halos and traffic, so the
figures are that rank's. ``rank="largest"`` picks the rank whose inputs are
largest (the one that sets the memory bill of an uneven split).

**Not simulated.** Anything that needs values: ``item()``, ``nonzero``,
boolean masks, ``unique``, data-dependent control flow raise
:class:`DataDependentError` naming the op. Kernels' scratch memory is not
seen (as in :class:`~physicsnemo_dp.debug.LiveBytes`). The mesh is a CPU
mesh, so kernels are chosen as on CPU (SDPA: the fused CPU kernel), and the
few ops whose meta kernel allocates where the CPU kernel returns a tensor it
was given (the functional collectives' wrappers, moves to the data's device)
run the CPU way (:class:`_AsOnCpu`): the peak is the real run's.

Why composites need help: ``nn.MultiheadAttention`` runs with subclasses'
``__torch_function__`` off, so its SDPA call reaches ``__torch_dispatch__``
as the fused kernel that torch picks *for the tensor's device*. A ShardTensor
with meta locals is a meta tensor, for which torch picks the unfused math
path, not the CPU kernel whose rule (ring attention) the real run uses.
While it simulates, the simulator sends such SDPA calls to the kernel torch
picks on CPU (see :func:`_cpu_attention_kernels`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention import SDPBackend

from .. import _meshes
from .. import _torch_compat as tc
from .._conversion import FromLocal
from ..collectives import mesh_device
from ..shard_tensor import ShardTensor
from ..spec import ShardTensorSpec
from ._explain import Explanation, Recorder, format_bytes
from ._memory import LiveBytes

__all__ = ["simulate", "Simulation", "sharded_input", "simulating", "DataDependentError"]

aten = torch.ops.aten


class DataDependentError(RuntimeError):
    """An op of a simulated step needs tensor values, which meta tensors do not have."""


@dataclass
class _World:
    mesh: DeviceMesh
    inputs: list[ShardTensorSpec] = field(default_factory=list)


_STATE: dict[str, _World | None] = {"world": None}


def simulating() -> bool:
    """Whether the calling code runs inside :func:`simulate` (its tensors are meta tensors)."""
    return _STATE["world"] is not None


def sharded_input(
    mesh: DeviceMesh,
    shape: Sequence[int],
    placements: Sequence,
    dtype: torch.dtype = torch.float32,
    sizes: Sequence[Sequence[int] | None] | None = None,
    seed: int = 0,
) -> ShardTensor:
    """A global input of ``shape`` laid out by ``placements``, built from this rank's box only (no communication).

    The same setup code serves a simulation and a real run: inside
    :func:`simulate` the local piece is a meta tensor; otherwise it is random
    data (normal, seeded by ``seed`` and the rank) on the mesh's device, so a
    real run of the same setup is what the simulation predicts.

    Args:
        mesh: The device mesh.
        shape: Global shape.
        placements: One placement per mesh dim (``Shard(d)``, ``Replicate()``).
        dtype: Element type.
        sizes: Per tensor dim, ``None`` or the shard sizes along it (as in
            ``ShardTensorSpec.from_sizes``); ``None`` splits like ``torch.chunk``.
        seed: Seed of the random data of a real run.

    Returns:
        A ShardTensor of global ``shape``.
    """
    shape = tuple(int(s) for s in shape)
    if sizes is None:
        spec = ShardTensorSpec.chunked(mesh, placements, shape, dtype)
    else:
        spec = ShardTensorSpec.from_sizes(mesh, placements, shape, dtype, tuple(sizes))
    world = _STATE["world"]
    if world is not None:
        world.inputs.append(spec)
        return FromLocal.apply(torch.empty(spec.local_shape, dtype=dtype, device="meta"), spec)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + torch.distributed.get_rank())
    local = torch.randn(spec.local_shape, generator=generator, dtype=dtype).to(mesh_device(mesh))
    return ShardTensor.from_spec(local, spec)


@dataclass
class Simulation:
    """What one rank of the simulated job does in one step.

    ``explanation`` is the per-op table (``print(sim.explanation)``); the
    properties total it. ``seconds`` is the wall time of the simulated step
    (planning and dispatch of every op, no arithmetic); ``setup_seconds``
    that of building the model and inputs.
    """

    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    rank: int
    explanation: Explanation
    seconds: float
    setup_seconds: float

    @property
    def peak_bytes(self) -> int:
        """Peak live bytes this rank adds during the step (activations, gradients, buffers)."""
        return self.explanation.peak_bytes

    @property
    def collectives(self) -> dict:
        """``{kind: {"calls", "sent", "received"}}`` for this rank, as ``count_collectives().summary()``."""
        return self.explanation.collectives()

    @property
    def bytes_sent(self) -> int:
        return sum(v["sent"] for v in self.collectives.values())

    @property
    def bytes_received(self) -> int:
        return sum(v["received"] for v in self.collectives.values())

    def op_seconds(self) -> dict[str, float]:
        """Planning time summed per op name (forward calls and backward nodes), largest first."""
        totals: dict[str, float] = {}
        for row in self.explanation.rows:
            totals[row.op] = totals.get(row.op, 0.0) + row.seconds
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def summary(self) -> dict:
        """One flat row: sizes, peak, bytes per kind, times (what the command line prints per world size)."""
        row = {
            "world_size": self.world_size,
            "mesh_shape": "x".join(map(str, self.mesh_shape)),
            "rank": self.rank,
            "peak_bytes": self.peak_bytes,
            "sent": self.bytes_sent,
            "received": self.bytes_received,
            "ops": len(self.explanation.rows),
            "step_seconds": self.seconds,
        }
        for kind, v in self.collectives.items():
            row[f"sent_{kind}"] = v["sent"]
        return row

    def __str__(self) -> str:
        lines = [
            f"rank {self.rank} of {self.world_size} (mesh {'x'.join(map(str, self.mesh_shape))} "
            f"{', '.join(self.mesh_dim_names)}): peak {format_bytes(self.peak_bytes)}, "
            f"sent {format_bytes(self.bytes_sent)}, received {format_bytes(self.bytes_received)}, "
            f"{len(self.explanation.rows)} ops in {self.seconds:.3f} s"
        ]
        for (kind, dim), v in self.explanation.collectives_by_mesh_dim().items():
            lines.append(
                f"  {kind:<16} on {dim:<8} {v['calls']:>5} calls  sent {format_bytes(v['sent']):>10}  "
                f"received {format_bytes(v['received']):>10}"
            )
        slow = list(self.op_seconds().items())[:5]
        lines.append("  slowest ops (planning): " + ", ".join(f"{op} {s * 1e3:.1f} ms" for op, s in slow))
        return "\n".join(lines)


def simulate(
    setup: Callable[[DeviceMesh], Callable[[], object]],
    world_size: int | None = None,
    *,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    rank: int | str = 0,
) -> Simulation:
    """Run one rank of a ``world_size``-rank job's step on meta tensors over a fake process group.

    ``setup(mesh)`` builds the model and the inputs and returns the step
    (forward and backward), e.g.::

        def setup(mesh):
            model = UNet()
            x = sharded_input(mesh, (8, 1, 1024, 1024), [Shard(2)])
            return lambda: model(x).pow(2).mean().backward()

        print(simulate(setup, world_size=1024))

    It runs under ``torch.device("meta")``, so parameters are meta tensors
    too; the same ``setup`` runs for real on a real mesh (``sharded_input``
    then makes real data), which is how the simulation is checked.

    Args:
        setup: ``setup(mesh) -> step``.
        world_size: Ranks of the simulated job (default: the product of ``mesh_shape``).
        mesh_shape: Shape of the device mesh (default ``(world_size,)``).
        mesh_dim_names: Names of the mesh dims (default, as for
            :func:`~physicsnemo_dp.launch` and the CLI: ``("domain",)`` for a 1-D mesh,
            ``("ddp", "domain")`` for a 2-D one, ``("dim0", "dim1", ...)`` beyond).
        rank: The rank to play, or ``"largest"`` for the rank whose
            ``sharded_input`` boxes hold the most bytes.

    Returns:
        A :class:`Simulation`.

    Raises:
        ValueError: Sizes that do not fit together, or an unknown ``rank``.
        RuntimeError: A process group is already initialised in this process
            (simulate in a process of its own).
        DataDependentError: The step needs tensor values.
    """
    mesh_shape, names = _mesh_arguments(world_size, mesh_shape, mesh_dim_names)
    size = math.prod(mesh_shape)
    if rank == "largest":
        world, _, _ = _setup(setup, size, mesh_shape, names, 0)
        rank = _largest_rank(world)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int in [0, {size}) or 'largest', got {rank!r}")
    _forget_cached_plans()
    with tc.fake_process_group(size, rank):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        start = time.perf_counter()
        step = _built(setup, mesh)
        setup_seconds = time.perf_counter() - start
        recorder = Recorder(meta=True)
        start = time.perf_counter()
        with _world(mesh), _cpu_attention_kernels(recorder.memory), recorder, _AsOnCpu(recorder):
            result = step()
        seconds = time.perf_counter() - start
        explanation = recorder.explanation(result)
    _forget_cached_plans()
    return Simulation(size, mesh_shape, names, rank, explanation, seconds, setup_seconds)


def _mesh_arguments(world_size, mesh_shape, mesh_dim_names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if mesh_shape is None:
        if world_size is None:
            raise ValueError("simulate needs world_size or mesh_shape")
        mesh_shape = (world_size,)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not mesh_shape or min(mesh_shape) < 1:
        raise ValueError(f"mesh_shape must be positive sizes, got {mesh_shape}")
    if world_size is not None and math.prod(mesh_shape) != world_size:
        raise ValueError(f"world_size={world_size} but mesh_shape={mesh_shape} has {math.prod(mesh_shape)} ranks")
    if mesh_dim_names is None:
        mesh_dim_names = {1: ("domain",), 2: ("ddp", "domain")}.get(
            len(mesh_shape), tuple(f"dim{i}" for i in range(len(mesh_shape)))
        )
    names = tuple(str(n) for n in mesh_dim_names)
    if len(names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names={names} needs one name per mesh dim of mesh_shape={mesh_shape}")
    return mesh_shape, names


def _forget_cached_plans() -> None:
    """Clear the library's memoised plans, so a simulation never reuses another rank's.

    Rules memoise plans on layouts (``functools.lru_cache`` on specs). A spec
    compares equal on every rank of a mesh (the mesh compares by its shape
    and ranks, not by which rank this process is), which is right for a real
    job, where a process is one rank for its whole life. Simulations of
    different ranks in one process would hit the other rank's entries.
    """
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "physicsnemo_dp" or name.startswith("physicsnemo_dp.")):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                value.cache_clear()
    _meshes.forget()  # a canonical mesh knows which rank it was made on


@contextlib.contextmanager
def _world(mesh: DeviceMesh):
    previous = _STATE["world"]
    world = _STATE["world"] = _World(mesh)
    try:
        yield world
    finally:
        _STATE["world"] = previous


def _built(setup, mesh):
    with _world(mesh), torch.device("meta"):
        step = setup(mesh)
    if not callable(step):
        raise TypeError(f"setup(mesh) must return the step to simulate (a callable), got {type(step).__name__}")
    return step


def _setup(setup, size, mesh_shape, names, rank):
    with tc.fake_process_group(size, rank):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        with _world(mesh) as world, torch.device("meta"):
            step = setup(mesh)
    return world, mesh, step


def _largest_rank(world: _World) -> int:
    """The rank whose input boxes hold the most bytes (the lowest such rank on ties)."""
    if not world.inputs:
        raise ValueError("rank='largest' needs inputs made with sharded_input(...) in setup")
    best, best_bytes = 0, -1
    for rank, coord in enumerate(itertools.product(*(range(s) for s in world.mesh.shape))):
        held = sum(math.prod(spec.local_shape_at(coord)) * spec.tensor_meta.dtype.itemsize for spec in world.inputs)
        if held > best_bytes:
            best, best_bytes = rank, held
    return best


# --------------------------------------------------------------------------- #
# What a CPU run would do that meta tensors do not
# --------------------------------------------------------------------------- #


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


@contextlib.contextmanager
def _cpu_attention_kernels(memory: LiveBytes):
    """While simulating, composites' SDPA calls on meta ShardTensors take the kernel torch picks on CPU.

    ``F.multi_head_attention_forward`` looks ``scaled_dot_product_attention``
    up in ``torch.nn.functional`` at each call, under subclass
    torch-function disabled; no mode can see that call (a function mode sees
    the composite itself and runs its body with the mode popped). So the
    module attribute is swapped for the duration of the simulated step and
    restored after. Calls with torch-function enabled (user code calling
    ``F.scaled_dot_product_attention`` directly) go to the original, hence to
    the library's SDPA handler, as on a real mesh. The CPU stand-ins that
    torch's kernel choice reads are not counted in ``memory``: a real run
    never makes them.
    """
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(*args, **kwargs):
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        if tc.subclass_torch_function_disabled() and isinstance(q, ShardTensor) and q._local_tensor.is_meta:
            with memory._uncounted():
                proxies = [_proxy(t) for t in (q, k, v, mask)]
                choice = tc.fused_sdp_choice(*proxies, dropout_p, is_causal, scale, gqa)
            if choice == SDPBackend.FLASH_ATTENTION.value and not gqa:
                return aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
                )[0]
        return original(*args, **kwargs)  # otherwise the math path: a decomposition, the same on meta as on CPU

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _proxy(t):
    """A one-element CPU stand-in with ``t``'s dtype, ndim and last dim: what torch's kernel choice reads."""
    return None if t is None else torch.zeros((1,) * (t.ndim - 1) + (t.shape[-1],), dtype=t.dtype)


_DATA_DEPENDENT = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.bincount.default,
        aten.repeat_interleave.Tensor,
        aten.equal.default,
    }
)


#: Indexing ops whose output size depends on the values of a boolean (or uint8) mask index.
_INDEXING = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default})

#: Ops whose meta kernel allocates where the device kernel (CPU and CUDA alike) does not, with what the device
#: kernel returns. Every functional collective wraps its output with ``_wrap_tensor_autograd``, whose device
#: kernel returns an ``AsyncCollectiveTensor`` around the output itself, and ``wait()`` on that
#: (``wait_tensor``) hands the same output back; both meta kernels return ``torch.empty_like``, a second
#: storage of the output's size. Counted with the meta kernels, every all-reduce of a gradient held twice its
#: bytes: the transformer block's peak was 1.20x the measured one, and so were (1.14-1.17x) the U-Net ranks
#: with 1-row shards, whose peak is in the backward's weight-gradient all-reduces, not in activations.
_DEVICE_KERNELS: dict = tc.collective_output_kernels()


def _moves_to_the_mesh_device(func, args, kwargs) -> bool:
    """Whether ``func`` is ``t.to(device)`` of a CPU tensor to a meta one, which a CPU run does not do at all.

    Rules build small tables (halo indices, interpolation taps) on CPU and
    move them next to the data (``tc.graph_constant``): on a CPU mesh that
    ``to`` returns the table itself, on meta tensors it makes a meta copy,
    which the simulation does not count and which keeps the table alive
    (views of it keep it too: a view holds its base's Python object). Only
    a move that keeps dtype and memory layout is the identity on CPU.
    """
    if func is not aten._to_copy.default or args[0].is_meta:
        return False
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    layout = kwargs.get("memory_format")
    return (device is not None and torch.device(device).type == "meta" and dtype in (None, args[0].dtype)
            and layout in (None, torch.preserve_format))  # fmt: skip


class _AsOnCpu(tc.TorchDispatchMode):
    """Runs meta ops as a CPU run would, as far as memory goes, and refuses ops whose result depends on values.

    Three jobs on the simulated step's plain (local) tensors: ops whose
    device kernel does not allocate (:data:`_DEVICE_KERNELS`) run as on the
    device, and a CPU tensor's move to meta (:func:`_moves_to_the_mesh_device`)
    is not counted, so :class:`~physicsnemo_dp.debug.LiveBytes` sees the same
    storages as in a real run; data-dependent ops raise
    :class:`DataDependentError` naming the op and the row that ran it.
    """

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(tc.is_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func in _DEVICE_KERNELS and args[0].is_meta:
            return _DEVICE_KERNELS[func](*args)
        if _moves_to_the_mesh_device(func, args, kwargs):
            with self._recorder.memory._uncounted():  # the CPU table is counted where it was made
                out = func(*args, **kwargs)
            out._simulated_from = args[0]  # on CPU they are one tensor: the table lives while the copy (or a view) does
            return out
        leaves = [t for t in tc.pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in leaves) and (
            func in _DATA_DEPENDENT or (func in _INDEXING and any(t.dtype in (torch.bool, torch.uint8) for t in leaves))
        ):
            raise self._error(func)
        try:
            return func(*args, **kwargs)
        except NotImplementedError as error:  # a meta kernel that needs values (torch's own wording varies)
            if any(t.is_meta for t in leaves):
                raise self._error(func) from error
            raise

    def _error(self, func) -> DataDependentError:
        rows = self._recorder.rows
        where = f" (in {rows[-1].phase} op {rows[-1].op!r})" if rows else ""
        return DataDependentError(
            f"simulate: {func} needs tensor values{where}, which a simulation on meta tensors does not have. "
            "Keep the step's shapes and control flow independent of data (fixed-size masks, no .item()), "
            "or measure this step on a real run with physicsnemo_dp.debug.explain."
        )
