"""``physicsnemo_dp.integrations``: third-party spectral layers, unchanged, allocate their spectrum sharded.

neuraloperator's FNO and TFNO (the ``spectral`` extra, marker ``spectral_extra``) and a line-for-line
copy of PhysicsNeMo's ``SpectralConv1d/2d/3d`` and ``DPOT2DLayer`` (``_physicsnemo_layers.py``; PhysicsNeMo is not
installable here) against one process: output, input gradient and every parameter gradient, uneven
shards (an empty one at 3 and 4 ranks), worlds 1-4 and the 2x2 mesh, with implicit gathers set to
``"raise"`` (the adapted layers gather nothing). Without the adapter the same layers report implicit
gathers at the user's line. The traffic test compares bytes received per rank at P = 2 and P = 4.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_dp import ShardTensor, count_collectives, implicit_gathers
from physicsnemo_dp import integrations
from physicsnemo_dp._gathers import FIX_PLAIN_BUFFER, listening
from tests._harness import EVERY_WORLD_SIZE, distributed, run_job

from ..core._util import make_spec, shard_from_global
from . import _physicsnemo_layers as pnm
from ._conformance import check_model, placements_for

extra = pytest.mark.spectral_extra


class _Records:
    def __init__(self):
        self.found = []

    def implicit_gather(self, record):
        self.found.append(record)


def _neuralop_models():
    models = pytest.importorskip("neuralop.models")
    fno = models.FNO(n_modes=(4, 4), in_channels=1, out_channels=1, hidden_channels=6, n_layers=2)
    tfno = models.TFNO(
        n_modes=(4, 4), in_channels=1, out_channels=1, hidden_channels=6, n_layers=1, factorization="tucker", rank=0.5
    )
    return {"FNO": fno, "TFNO": tfno}


# --------------------------------------------------------------------------- #
# neuraloperator (spectral extra)
# --------------------------------------------------------------------------- #
@extra
@distributed(world_sizes=EVERY_WORLD_SIZE, timeout=240)
def test_neuraloperator_fno_and_tfno_through_the_adapter(ctx):
    """FNO (2 blocks) and TFNO (Tucker weights, 1 block) on an 11 x 9 grid: equal to one process, nothing gathered."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 11, 9)
    for name, model in _neuralop_models().items():
        for i, placements in enumerate(placements_for(ctx.mesh, (2, 3))):
            with integrations.neuraloperator() as adapter, implicit_gathers("raise"):
                out = check_model(model, x, ctx.mesh, placements, salt=i)
            assert adapter.redirected == len(list(_spectral_convs(model))) * 1, (name, adapter)
            assert any(p.is_shard() for p in out.placements), (name, out.placements)
    assert not adapter.active


def _spectral_convs(model):
    from neuralop.layers.spectral_convolution import SpectralConv

    return [m for m in model.modules() if isinstance(m, SpectralConv)]


@extra
@distributed(world_sizes=(3,), mesh_2d=False, timeout=180)
def test_neuraloperator_without_the_adapter_reports_implicit_gathers(ctx):
    """The plain ``torch.zeros`` spectrum written with sharded modes is reported at the line that called the model."""
    model = _neuralop_models()["FNO"]
    spec = make_spec(ctx.mesh, (Shard(2),), (2, 1, 11, 9), "uneven", dtype=torch.float32)
    x = shard_from_global(torch.randn(2, 1, 11, 9), spec, requires_grad=True)
    with implicit_gathers("allow"), listening(_Records()) as sink:
        line = inspect.currentframe().f_lineno + 1
        model(x).sum().backward()
    assert sink.found, "no implicit gather reported"
    plain = [r for r in sink.found if r.fix == FIX_PLAIN_BUFFER]
    assert plain and all(r.source == f"{__file__}:{line}" for r in sink.found), [str(r) for r in sink.found]
    assert all(r.kind.startswith("sharded values written into a plain tensor") for r in plain)
    with implicit_gathers("raise"), pytest.raises(Exception, match="written into a plain tensor"):
        model(x)
    with integrations.neuraloperator(), implicit_gathers("raise"):  # the same call, adapted: nothing to report
        model(x).sum().backward()


_PARAMETER_KINDS = ("all_reduce", "all_gather")  # bounded by the parameters' bytes separately


def _traffic_body(ctx, adapted: bool):
    """Bytes this rank receives per collective kind in one FNO step (forward + backward), rows sharded evenly."""
    models = pytest.importorskip("neuralop.models")
    torch.manual_seed(0)
    b, c, h, w = 1, 8, 32, 32
    model = models.FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=c, n_layers=2)
    spec = make_spec(ctx.mesh, (Shard(2),), (b, 1, h, w), "chunk", dtype=torch.float32)
    x = shard_from_global(torch.randn(b, 1, h, w), spec, requires_grad=True)
    adapter = integrations.neuraloperator() if adapted else None
    try:
        with implicit_gathers("allow"), listening(_Records()) as sink, count_collectives() as counter:
            model(x).square().mean().backward()
    finally:
        if adapter is not None:
            adapter.remove()
    return {
        "received": dict(counter.bytes_received),
        "implicit": sum(r.nbytes for r in sink.found),
        "spectrum_bytes": b * c * h * (w // 2 + 1) * 8,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


@extra
def test_neuraloperator_traffic_per_rank_is_local_and_does_not_grow_with_ranks():
    """Adapted: what a rank receives outside parameter-gradient all-reduces is the FFTs' transposes only.

    Per rank and step (forward + backward of a 2-block FNO, hidden 8 x 32 x 32): no implicit gather, all-gathers
    only of spectral weight gradients (a rank without kept modes receives the others' part of the Replicate
    gradient: O(parameters), not O(domain)), and per spectral transform one transpose, which brings a rank (P - 1) / P**2 of the spectrum (the hidden
    features' half spectrum, complex64: 17/16 of the real features' bytes), at most a quarter of its global
    bytes, less from P = 2 to P = 4. Without the adapter each block all-gathers the written modes.
    """
    figures = {}
    for p in (2, 4):
        for adapted in (True, False):
            outcomes = run_job(p, (p,), __name__, "_traffic_body", {"adapted": adapted}, timeout=240)
            figures[p, adapted] = [o.value for o in outcomes]
    for p in (2, 4):
        for rank, fig in enumerate(figures[p, True]):
            received, spectrum = fig["received"], fig["spectrum_bytes"]
            moved = sum(v for k, v in received.items() if k not in _PARAMETER_KINDS)
            assert fig["implicit"] == 0, (p, rank, fig)
            assert received.get("all_gather", 0) <= fig["parameter_bytes"], (p, rank, fig)
            # 2 blocks x (rfft2 + irfft2) x (forward + backward) = 8 transforms, one transpose each
            assert moved <= 8 * spectrum / 4, (p, rank, received, spectrum)
        worst = {
            q: max(sum(v for k, v in f["received"].items() if k not in _PARAMETER_KINDS) for f in figures[q, True])
            for q in (2, 4)
        }
    assert worst[4] <= worst[2], worst
    for p in (2, 4):
        assert all(f["implicit"] > 0 for f in figures[p, False]), figures[p, False]
    print({f"P={p} {'adapter' if a else 'plain'}": figures[p, a][0]["received"] for p, a in figures})


# --------------------------------------------------------------------------- #
# PhysicsNeMo's spectral convolutions (a copy of their code: no extra needed)
# --------------------------------------------------------------------------- #
_PNM = (pnm.SpectralConv1d, pnm.SpectralConv2d, pnm.SpectralConv3d, pnm.DPOT2DLayer)


def _pnm_cases(mesh):
    """(layer, global input, layouts); odd grids, so shards are uneven.

    1-D: the one spatial dim sharded; the transform parks the shard on another dim of at least P entries,
    hence a batch of 4 (on the 2x2 mesh the batch stays whole over "ddp": sharding it there would leave the
    channels, a contracted dim whose sharding makes the weight gradient gather the modes).
    3-D on the 2x2 mesh: batch x first spatial dim only. Sharding two spatial dims there parks a shard on
    the input channels, and ``F.pad``'s backward then all-gathers the channel dim of the padded mode block
    (``WindowFunction.backward``: S(2)S(1) -> S(2)R, a spatial-op limitation, not the adapter's).
    """
    torch.manual_seed(0)
    one_d = [(Shard(2),)] if mesh.ndim == 1 else [(Replicate(), Shard(2))]
    three_d = placements_for(mesh, (2, 4))[:1] if mesh.ndim == 2 else placements_for(mesh, (2, 4))
    return [
        (pnm.SpectralConv1d(3, 3, 4), torch.randn(4, 3, 13), one_d),
        (pnm.SpectralConv2d(2, 3, 3, 3), torch.randn(2, 2, 11, 9), placements_for(mesh, (2, 3))),
        (pnm.SpectralConv3d(2, 2, 2, 2, 2), torch.randn(2, 2, 7, 4, 5), three_d),
        (pnm.DPOT2DLayer(width=4, num_blocks=2, modes=3), torch.randn(2, 11, 9, 4), placements_for(mesh, (1, 2))),
    ]


@distributed(timeout=180)
def test_physicsnemo_spectral_convs_through_the_adapter(ctx):
    """SpectralConv1d (slice assignment), 2d and 3d (``zeros + F.pad``): one process's values, nothing gathered."""
    for layer, x, layouts in _pnm_cases(ctx.mesh):
        for i, placements in enumerate(layouts):
            with integrations.allocate_like_input(*_PNM) as adapter, implicit_gathers("raise"):
                out = check_model(layer, x, ctx.mesh, placements, salt=i)
            # one plain torch.zeros per forward (DPOT: two; its other two buffers are zeros_like of those)
            assert adapter.redirected == (2 if isinstance(layer, pnm.DPOT2DLayer) else 1), (
                type(layer).__name__,
                adapter,
            )
            assert any(p.is_shard() for p in out.placements), out.placements


@distributed(world_sizes=(3,), mesh_2d=False)
def test_physicsnemo_spectral_convs_without_the_adapter(ctx):
    """Without it: SpectralConv1d's and DPOT2DLayer's writes are implicit gathers; 2d/3d hold a whole plain spectrum.

    ``zeros + F.pad(sharded)`` moves nothing (the plain zeros are sliced to each rank's box) but each rank
    allocates the global spectrum: the adapter removes that allocation too (``redirected``).
    """
    cases = _pnm_cases(ctx.mesh)
    layer, x, _ = cases[0]
    xs = shard_from_global(x, make_spec(ctx.mesh, (Shard(2),), tuple(x.shape), dtype=x.dtype), requires_grad=True)
    with implicit_gathers("allow"), listening(_Records()) as sink:
        layer(xs).sum().backward()
    # the copy lives under tests/ (user code, unlike an installed package): its own line is the one to change
    assert sink.found and all(r.fix == FIX_PLAIN_BUFFER for r in sink.found)
    lines = open(pnm.__file__).read().splitlines()
    for r in sink.found:
        path, _, number = r.source.rpartition(":")
        assert path == pnm.__file__ and "out_ft[:, :, : self.modes1] =" in lines[int(number) - 1], r.source
    layer, x, _ = cases[1]
    xs = shard_from_global(x, make_spec(ctx.mesh, (Shard(2),), tuple(x.shape), dtype=x.dtype))
    with implicit_gathers("raise"):
        assert isinstance(layer(xs), ShardTensor)  # runs, and gathers nothing: only the allocation is global
    layer, x, _ = cases[3]  # DPOT2DLayer: slice assignments into plain buffers, each written block gathered
    xs = shard_from_global(x, make_spec(ctx.mesh, (Shard(1),), tuple(x.shape), dtype=x.dtype))
    with implicit_gathers("allow"), listening(_Records()) as sink:
        expected = layer(x)
        assert torch.allclose(layer(xs).full_tensor(), expected, atol=1e-6)
    assert sink.found and all(r.fix == FIX_PLAIN_BUFFER for r in sink.found), [str(r) for r in sink.found]


def test_adapter_arguments_and_versions(monkeypatch):
    """Bad arguments name the fix; a library version other than the verified one is refused or warned about."""
    with pytest.raises(ValueError, match="unknown library 'jax'.*allocate_like_input"):
        integrations.enable("jax")
    with pytest.raises(TypeError, match="nn.Module subclasses, got 3"):
        integrations.allocate_like_input(3)
    with pytest.raises(TypeError, match="at least one nn.Module class"):
        integrations.allocate_like_input()
    import importlib.metadata
    import importlib.util

    real = importlib.metadata.version

    def missing(name):
        if name == "nvidia-physicsnemo":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(
        ImportError, match=r"'nvidia-physicsnemo' is not installed \(pip install nvidia-physicsnemo==2.2.2\)"
    ):
        integrations.physicsnemo()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    with pytest.raises(RuntimeError, match=r"neuraloperator 9.9.9 is installed.*verified with 2.0.0.*strict=False"):
        integrations.neuraloperator()
    if importlib.util.find_spec("neuralop") is not None:
        with pytest.warns(integrations.IntegrationVersionWarning, match="9.9.9"):
            adapter = integrations.neuraloperator(strict=False)
        adapter.remove()
        adapter.remove()  # idempotent
        assert not adapter.active


def test_adapter_scope_and_what_it_leaves_alone():
    """Only the adapted class's forward, only with a ShardTensor argument; hooks gone after the block, even on error."""
    from torch.nn.modules import module as torch_module

    class Plain(torch.nn.Module):
        def forward(self, x):
            return torch.zeros(x.shape), torch.zeros(3, dtype=torch.float64)

    before = (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks))
    layer = Plain()
    with integrations.allocate_like_input(Plain) as adapter:
        a, b = layer(torch.ones(2, 3))  # a plain input: nothing adapted
        assert type(a) is torch.Tensor and type(b) is torch.Tensor and adapter.redirected == 0

        class Boom(torch.nn.Module):
            def forward(self, x):
                raise KeyError("boom")

        with integrations.allocate_like_input(Boom):
            with pytest.raises(KeyError):
                Boom()(torch.ones(1))
        assert not torch.overrides._is_torch_function_mode_enabled()
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == before
    assert "Plain" in repr(adapter) and "removed" in repr(adapter)


@distributed(world_sizes=(3,), mesh_2d=True)
def test_allocation_mode_rules(ctx):
    """Which factory calls become sharded: extents of a live ShardTensor's sharded dims, strided, same device."""
    mesh = ctx.mesh
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
    x = shard_from_global(torch.randn(2, 7, 5), make_spec(mesh, placements, (2, 7, 5), dtype=torch.float32))

    class Layer(torch.nn.Module):
        buffer = torch.empty(2, 7, 5)

        def forward(self, x):
            return {
                "zeros": torch.zeros(4, 7, 3, dtype=torch.cfloat),  # other extents on unsharded dims: sharded
                "empty": torch.empty((2, 7, 5)),
                "ones": torch.ones([2, 7, 5], dtype=torch.float64),
                "full": torch.full((2, 7, 1), 2.5),
                "new_zeros": torch.ones(1).new_zeros(2, 7, 5),  # a plain tensor's new_*: sharded, its dtype
                "other_extent": torch.zeros(2, 6, 5),  # the sharded dim's extent differs: plain
                "other_rank": torch.zeros(7, 5),  # another number of dims: plain
                "out": torch.zeros(2, 7, 5, out=self.buffer),  # out= is the caller's: plain
                "grad": torch.zeros(2, 7, 5, requires_grad=True),  # a new leaf: plain
                "meta": torch.zeros(2, 7, 5, device="meta"),  # another device: plain
            }

    with integrations.allocate_like_input(Layer) as adapter:
        got = Layer()(x)
    sharded = {"zeros", "empty", "ones", "full", "new_zeros"}
    for name, t in got.items():
        assert isinstance(t, ShardTensor) == (name in sharded), name
    assert adapter.redirected == len(sharded)
    assert got["zeros"].dtype == torch.cfloat and got["zeros"].placements == x.placements
    assert got["zeros"]._local_tensor.shape == (4, x._local_tensor.shape[1], 3)
    assert got["ones"].dtype == torch.float64 and torch.equal(
        got["ones"].full_tensor(), torch.ones(2, 7, 5, dtype=torch.float64)
    )
    assert torch.equal(got["full"].full_tensor(), torch.full((2, 7, 1), 2.5))
    assert torch.equal(got["new_zeros"].full_tensor(), torch.zeros(2, 7, 5))
    dist.barrier()
