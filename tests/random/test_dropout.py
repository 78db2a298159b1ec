"""Dropout on ShardTensors: the masks do not depend on the decomposition; gradients use the same mask.

On CPU ``F.dropout`` decomposes into ``empty_like`` + ``bernoulli_(1 - p)`` +
``div_`` + ``mul``; the feature variants draw a ``(N, C, 1, ...)`` mask through
``new_empty`` (a replicated tensor: every rank computes the whole small mask,
so its values are per (n, c) whatever the split of N or C). The expected
values below follow those decompositions with the counter-based reference.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tests._harness import EVERY_WORLD_SIZE, distributed

from ..core._util import shard_from_global
from ..ops._diff import layouts
from ._ref import reference, sharded

SHAPE = (4, 6, 5, 3)  # (N, C, H, W)
P = 0.3
SEED = 21


def _g(seed=0):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _keep(shape, device):
    return reference("bernoulli", shape, torch.float64, SEED, device, p=1 - P)


def _alpha(x, keep):
    """torch's alpha-dropout formula (``_dropout_impl`` with alpha=True) on a keep mask."""
    alpha = 1.7580993408473766
    a = 1.0 / ((alpha * alpha * P + 1) * (1 - P)) ** 0.5
    b = (keep - 1) * (alpha * a) + alpha * a * P
    return x * (keep * a) + b


#: (label, sharded op, expected output from (x, device))
CASES = [
    ("dropout", lambda x: F.dropout(x, P), lambda x, d: x * (_keep(SHAPE, d) / (1 - P))),
    ("nn.Dropout", lambda x: nn.Dropout(P)(x), lambda x, d: x * (_keep(SHAPE, d) / (1 - P))),
    ("dropout2d", lambda x: F.dropout2d(x, P), lambda x, d: x * (_keep(SHAPE[:2] + (1, 1), d) / (1 - P))),
    ("nn.Dropout2d", lambda x: nn.Dropout2d(P)(x), lambda x, d: x * (_keep(SHAPE[:2] + (1, 1), d) / (1 - P))),
    ("dropout1d", lambda x: F.dropout1d(x.flatten(2), P), lambda x, d: x.flatten(2) * (_keep(SHAPE[:2] + (1,), d) / (1 - P))),
    ("dropout3d", lambda x: F.dropout3d(x, P),  # a 4-D input is one unbatched (C, D, H, W) volume per channel
     lambda x, d: x * (_keep((1,) + SHAPE[:1] + (1, 1, 1), d)[0] / (1 - P))),
    ("alpha_dropout", lambda x: F.alpha_dropout(x, P, True), lambda x, d: _alpha(x, _keep(SHAPE, d))),
    ("feature_alpha_dropout", lambda x: F.feature_alpha_dropout(x, P, True), lambda x, d: _alpha(x, _keep(SHAPE[:2] + (1, 1), d))),
    ("nn.AlphaDropout", lambda x: nn.AlphaDropout(P)(x), lambda x, d: _alpha(x, _keep(SHAPE, d))),
]


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_dropout_family_matches_the_reference_forward_and_backward(ctx):
    G = _g()
    w = _g(seed=1)
    for label, op, expected_of in CASES:
        ref_x = G.clone().requires_grad_(True)
        expected = expected_of(ref_x, ctx.device)
        (expected * (w if expected.shape == SHAPE else w.flatten(2))).sum().backward()
        for placements in layouts(ctx.mesh, 4, dims=(0, 1, 2)):
            x = sharded(G, ctx.mesh, placements, requires_grad=True)
            torch.manual_seed(SEED)
            out = op(x)
            full = out.full_tensor()
            assert torch.allclose(full, expected.detach(), rtol=0, atol=1e-12), f"{label} {placements}"
            ww = w if expected.shape == SHAPE else w.flatten(2)
            (out * shard_from_global(ww, out._spec)).sum().backward()
            assert torch.allclose(x.grad.full_tensor(), ref_x.grad, rtol=0, atol=1e-12), f"{label} grad {placements}"


@distributed(world_sizes=EVERY_WORLD_SIZE)
def test_eval_mode_and_p_zero_are_identity(ctx):
    G = _g()
    x = sharded(G, ctx.mesh, layouts(ctx.mesh, 4)[0])
    drop = nn.Dropout2d(P).eval()
    assert torch.equal(drop(x).full_tensor(), G)
    assert torch.equal(F.dropout(x, 0.0).full_tensor(), G)
    assert torch.equal(F.dropout(x, 1.0).full_tensor(), torch.zeros_like(G))
