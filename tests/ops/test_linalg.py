"""Batched linear algebra (``rules/linalg.py``) on uneven shards, against one process (forward and gradients).

One distributed job per world size: every op with the batch dim sharded (no communication), a matrix dim
sharded (redistributed whole first), replicated and pending inputs, a second operand in another layout or
broadcast; errors of a singular matrix held by one rank raised alike on every rank with the global index.
"""

import pytest
import torch

from physicsnemo_dp import count_collectives
from tests._harness import distributed

from ..core._util import make_spec, shard_from_global
from ._diff import OP_WORLD_SIZES, check, layouts

SHAPE = (7, 4, 4)  # 7 matrices: uneven over 3 ranks, with an empty shard


def _spd(shape=SHAPE, seed=0):
    a = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a @ a.transpose(-1, -2) + shape[-1] * torch.eye(shape[-1], dtype=torch.float64)


def _g(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


RHS = _g((4, 2), 3)  # a plain right-hand side that broadcasts over the batch

#: On every layout (batch sharded, a matrix dim sharded, replicated, pending).
EVERY_LAYOUT = [
    torch.linalg.inv,
    lambda a: torch.linalg.svd(a, full_matrices=False),
    torch.linalg.eigh,
    lambda a: torch.linalg.slogdet(a),
    lambda a: torch.linalg.lstsq(a, RHS.expand(7, 4, 2)).solution,
]
#: With the batch dim sharded (the intended use: no communication).
ONE = [
    torch.inverse,
    lambda a: torch.linalg.inv_ex(a).inverse,
    lambda a: torch.linalg.solve(a, RHS),
    lambda a: torch.linalg.solve(a, a[..., 0] * 1),  # a batch of vectors
    torch.linalg.svdvals,
    torch.linalg.qr,
    torch.linalg.cholesky,
    torch.cholesky,
    torch.linalg.det,
    torch.det,
    torch.logdet,
    torch.linalg.eigvalsh,
    lambda a: torch.linalg.lstsq(a[:, :, :3], RHS.expand(7, 4, 2), driver="gelsd"),
    lambda a: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), RHS.expand(7, 4, 2)),
    lambda a: torch.linalg.solve_triangular(torch.linalg.cholesky(a), RHS.expand(7, 4, 2), upper=False),
    lambda a: torch.cholesky_solve(RHS.expand(7, 4, 2), torch.linalg.cholesky(a)),
    torch.linalg.matrix_exp,
    torch.linalg.pinv,
]
TWO = [torch.linalg.solve, lambda a, b: torch.linalg.lstsq(a, b).solution, lambda a, b: torch.linalg.inv(a) @ b]


@distributed(world_sizes=OP_WORLD_SIZES, timeout=180)
def test_batched_linalg(ctx):
    mesh = ctx.mesh
    for placements in layouts(mesh, 3, partial=True):
        for i, fn in enumerate(EVERY_LAYOUT):
            check(fn, [(_spd(), placements)], mesh, label=f"every layout[{i}]")
    batch = layouts(mesh, 3, dims=(0,))[0]
    for i, fn in enumerate(ONE):
        check(fn, [(_spd(), batch)], mesh, label=f"linalg[{i}]")
    for placements in layouts(mesh, 3, dims=(0, 2))[:2]:
        for i, fn in enumerate(TWO):  # the second operand's shard sizes differ (another salt): it moves to A's
            check(fn, [(_spd(), placements), (_g((7, 4, 3)), placements)], mesh, label=f"two[{i}]")
    # a 4-d batch with its last batch dim sharded, one matrix sharded by rows (gathered)
    check(torch.linalg.inv, [(_spd((2, 5, 3, 3)), layouts(mesh, 4, dims=(1,))[0])], mesh, label="batch dim 1")
    check(torch.linalg.eigvalsh, [(_spd((5, 5)), layouts(mesh, 2, dims=(0,))[0])], mesh, label="one matrix")

    # the batch dim sharded: no communication (the *_ex forms); the checked forms agree with one int
    spec = make_spec(mesh, batch, SHAPE)
    a = shard_from_global(_spd(), spec)
    with count_collectives() as counter:
        torch.linalg.inv_ex(a), torch.linalg.svd(a), torch.linalg.det(a), torch.linalg.eigh(a), torch.linalg.qr(a)
    assert counter.total_calls == 0, counter.summary()
    with count_collectives() as counter:
        torch.linalg.inv(a)
    assert counter.total_calls == 1 and counter.total_sent <= 16, counter.summary()  # one all-reduce of one int

    # bad shapes: torch's own message on every rank, before anything moves
    with pytest.raises(RuntimeError, match="linalg.solve"):
        torch.linalg.solve(a, _g((3, 2)))

    # a singular matrix on one rank: torch's error, with the global batch index, on every rank
    bad = _spd()
    bad[5] = 0
    x = shard_from_global(bad, spec)
    for fn, text in ((torch.linalg.inv, "(Batch element 5)"), (torch.linalg.cholesky, "(Batch element 5)")):
        with pytest.raises(RuntimeError, match=text.replace("(", r"\(").replace(")", r"\)")):
            fn(x)
    deficient = _spd()[:, :, :3].contiguous()
    deficient[5, :, 2] = 0
    d_spec = make_spec(mesh, spec.placements, (7, 4, 3))
    with pytest.raises(RuntimeError, match="does not have full rank"):  # only the rank holding entry 5 fails in LAPACK
        torch.linalg.lstsq(shard_from_global(deficient, d_spec), _g((7, 4, 2)), driver="gels")
    flat = bad.clone()
    flat[5, :, 3] = 0  # rank-deficient: gelsd then computes no residuals, on every rank alike
    out = torch.linalg.lstsq(shard_from_global(flat[:, :, :3].contiguous(), d_spec), _g((7, 4, 2)), driver="gelsd")
    assert tuple(out.residuals.shape) == (0,)
