"""The compile matrix: every op family under ``torch.compile(fullgraph=True)`` against eager.

Rows are the families of ``_cases.FAMILIES``, columns the backends; each cell
runs on a 1-D mesh of 3 ranks (uneven shards, an empty one) and on the 2x2
mesh, and on 1 rank (see ``_compare.FULL`` for which run where by default).
Outputs, layouts, input, parameter gradients and buffers must match the eager run.
"""

import pytest

from ._cases import FAMILIES
from ._compare import FULL, compare, meshes_for, skip_unless_in_scope


def _check(ctx, family, backend):
    skip_unless_in_scope(ctx, backend)
    for case in FAMILIES[family](ctx.mesh):
        compare(case.fn, case.inputs, ctx.mesh, backend=backend, module=case.module, label=f"{family}: {case.label}")


@pytest.mark.parametrize("family", list(FAMILIES))
@meshes_for("aot_eager")
def test_aot_eager(ctx, family):
    _check(ctx, family, "aot_eager")


#: Families Inductor compiles in the default run (a cold Inductor compile costs 5-40 s per family
#: here): the models, which hold conv, group/batch norm (cnn), layer norm and linear (mlp), and
#: pointwise; every family runs under aot_eager by default and under Inductor with PDP_COMPILE_MATRIX=full.
_INDUCTOR_DEFAULT = ("pointwise", "cnn", "mlp", "attention")


@pytest.mark.parametrize("family", list(FAMILIES))
@meshes_for("inductor")
def test_inductor(ctx, family):
    if not FULL and family not in _INDUCTOR_DEFAULT:
        pytest.skip(f"inductor on {family} runs with PDP_COMPILE_MATRIX=full only")
    _check(ctx, family, "inductor")
