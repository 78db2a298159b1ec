"""Opt-in adapters that keep third-party layers O(local) on ShardTensors without editing them.

Some public layers allocate a buffer with a plain factory of the *global*
shape and write sharded values into it: the spectral convolutions of
neuraloperator (``SpectralConv``: ``out_fft = torch.zeros(...)``, then
``out_fft[slices] = contract(...)``) and PhysicsNeMo (``SpectralConv1d/2d/3d/4d``:
``out_ft = torch.zeros(...)`` filled by slice assignment or by
``out_ft + F.pad(...)``; ``DPOT2DLayer``'s block-diagonal spectral MLP buffers). On a ShardTensor that runs, with the right values,
but every rank then holds the whole spectrum and gathers what is written into
it (reported as an implicit gather, ``docs/communication.md``). Inside an
adapted layer's ``forward`` such a factory call is served like
``x_ft.new_zeros(...)`` instead: laid out like the most recent ShardTensor the
layer received or computed whose sharded dims have the requested extents,
so the spectrum stays sharded and the library code runs unchanged::

    import physicsnemo_dp.integrations as integrations

    with integrations.neuraloperator():      # neuraloperator's SpectralConv (FNO, TFNO, ...)
        y = fno(x_sharded)
        y.square().mean().backward()

    handle = integrations.enable("neuraloperator")   # the same for the rest of the run
    ...
    handle.remove()

Nothing of the library is patched: a pair of global module forward hooks,
removed when the block ends, switches a ``TorchFunctionMode``
(:class:`AllocationMode`) on only while an adapted layer's ``forward`` runs
with a ShardTensor argument. Each library is checked against the version the
adapter was verified with (:data:`VERIFIED`); another version is refused
(``strict=True``, the default) or accepted with a warning (``strict=False``).
:func:`allocate_like_input` adapts any other layer class the same way.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings

from ._allocation import Adapter, AllocationMode, allocate_like_input

__all__ = [
    "neuraloperator",
    "physicsnemo",
    "enable",
    "allocate_like_input",
    "Adapter",
    "AllocationMode",
    "VERIFIED",
    "IntegrationVersionWarning",
]

#: library -> (distribution name, versions the adapter was verified with, the classes it adapts)
VERIFIED: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    # tests/spectral/test_integrations.py runs neuraloperator's FNO and TFNO through the adapter
    "neuraloperator": (
        "neuraloperator",
        ("2.0.0",),
        ("neuralop.layers.spectral_convolution:SpectralConv",),
    ),
    # Read from nvidia-physicsnemo 2.2.2's physicsnemo/nn/module/spectral_layers.py and models/dpot/dpot.py;
    # PhysicsNeMo needs warp and jaxtyping, so the tests run a line-for-line copy of SpectralConv1d/2d/3d's and
    # DPOT2DLayer's forward code (tests/spectral/_physicsnemo_layers.py). SpectralConv4d: the same pattern, not run
    "physicsnemo": (
        "nvidia-physicsnemo",
        ("2.2.2",),
        (
            "physicsnemo.nn.module.spectral_layers:SpectralConv1d",
            "physicsnemo.nn.module.spectral_layers:SpectralConv2d",
            "physicsnemo.nn.module.spectral_layers:SpectralConv3d",
            "physicsnemo.nn.module.spectral_layers:SpectralConv4d",
            "physicsnemo.models.dpot.dpot:DPOT2DLayer",
        ),
    ),
}


class IntegrationVersionWarning(UserWarning):
    """An adapter runs on a library version it was not verified with (``strict=False``)."""


def _installed_version(distribution: str, library: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"integrations.{library}: the package {distribution!r} is not installed "
            f"(pip install {distribution}=={VERIFIED[library][1][-1]})"
        ) from None


def _classes(library: str, strict: bool) -> tuple[type, ...]:
    distribution, versions, targets = VERIFIED[library]
    version = _installed_version(distribution, library)
    if version not in versions:
        message = (
            f"integrations.{library}: {distribution} {version} is installed, but the adapter was verified with "
            f"{', '.join(versions)} only; its layers may allocate differently. Install {distribution}=="
            f"{versions[-1]}, or pass strict=False to use the adapter anyway (check the result against one "
            "process, and for implicit gathers with physicsnemo_dp.implicit_gathers('raise'))"
        )
        if strict:
            raise RuntimeError(message)
        warnings.warn(message, IntegrationVersionWarning, stacklevel=3)
    classes = []
    for target in targets:
        module_name, _, qualname = target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as error:
            if strict:
                raise RuntimeError(f"integrations.{library}: cannot find {target} in {distribution} {version}: {error}")
            continue
        classes.append(obj)
    if not classes:
        raise RuntimeError(f"integrations.{library}: none of {', '.join(targets)} exists in {distribution} {version}")
    return tuple(classes)


def enable(library: str, *, strict: bool = True) -> Adapter:
    """Adapt a library's layers until the returned :class:`Adapter` is removed (or its ``with`` block ends).

    ``library`` is a key of :data:`VERIFIED` (``"neuraloperator"``,
    ``"physicsnemo"``). With ``strict=True`` an installed version other than
    the verified ones raises ``RuntimeError``; with ``strict=False`` it warns
    (:class:`IntegrationVersionWarning`).
    """
    if library not in VERIFIED:
        raise ValueError(
            f"integrations.enable: unknown library {library!r}; known: {', '.join(sorted(VERIFIED))} "
            "(for any other layer class: integrations.allocate_like_input(MyLayer))"
        )
    return allocate_like_input(*_classes(library, strict), name=library)


def neuraloperator(*, strict: bool = True) -> Adapter:
    """neuraloperator's ``SpectralConv`` (FNO, TFNO and every model built on it) allocates its spectrum sharded.

    ``with integrations.neuraloperator(): ...`` (or keep the handle and call ``remove()``). Verified with
    neuraloperator 2.0.0 (see :func:`enable` for ``strict``).
    """
    return enable("neuraloperator", strict=strict)


def physicsnemo(*, strict: bool = True) -> Adapter:
    """PhysicsNeMo's ``SpectralConv1d/2d/3d/4d`` (its FNO) and ``DPOT2DLayer`` (DPOT) allocate their buffers sharded.

    Written against nvidia-physicsnemo 2.2.2's source (see :data:`VERIFIED`; :func:`enable` for ``strict``).
    """
    return enable("physicsnemo", strict=strict)
