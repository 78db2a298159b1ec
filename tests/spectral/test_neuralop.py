"""neuraloperator's FNO, imported unchanged, on ShardTensors equals one process (the ``spectral`` extra).

    .venv/bin/pip install -e '.[spectral]' -c <(echo torch==2.13.0)
    .venv/bin/python -m pytest tests/spectral -m spectral_extra -q

Its code path is not ours: a grid positional embedding built from
``torch.linspace`` and joined by ``torch.cat``, channel MLPs and skips that
flatten the spatial dims (``x.reshape(b, c, -1)``) into 1-D convolutions,
``rfftn`` / ``fftshift`` / a centred slice of the spectrum / a plain
``torch.zeros(..., dtype=torch.cfloat)`` filled by slice assignment /
``irfftn(s=...)``, tensorly's ``einsum`` with a complex weight held in a
tensorly-torch ``FactorizedTensor``, soft gating. float32 only: the package
allocates its spectrum as ``torch.cfloat`` whatever the input's dtype, so a
float64 model fails in one process too.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import distributed

from ._conformance import check_model, placements_for

pytestmark = pytest.mark.spectral_extra


@distributed(timeout=180)
def test_fno(ctx):
    """Two FNO blocks on an 11 x 9 grid (uneven shards, an empty one at 3 and 4 ranks), modes (4, 4)."""
    fno = pytest.importorskip("neuralop.models").FNO
    model = fno(n_modes=(4, 4), in_channels=1, out_channels=1, hidden_channels=6, n_layers=2).to(ctx.device)
    x = torch.randn(2, 1, 11, 9).to(ctx.device)
    for i, placements in enumerate(placements_for(ctx.mesh, (2, 3))):
        check_model(model, x, ctx.mesh, placements, salt=i)
