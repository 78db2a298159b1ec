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


#: The default run compiles every family with aot_eager on 3 ranks; on the 2x2 mesh, the
#: families whose layouts differ there (views, reductions, indexing, fft) and the models,
#: which hold most others (the CNN: pointwise, conv, group/batch norm; the MLP: layer norm,
#: linear; attention: softmax); pooling/interpolation/padding on the 2x2 mesh is left to
#: the full run (its eager rules run there in tests/spatial). A cold Inductor compile costs 5-40 s per family here:
#: Inductor compiles the CNN by default (ring attention's block under Inductor is
#: tests/compile/test_transformer.py's regional test); aot_eager runs every family's graph,
#: which is what Inductor would compile. PDP_COMPILE_MATRIX=full runs every cell.
_AOT_EAGER_2D_DEFAULT = ("views", "reductions", "indexing", "fft", "cnn", "mlp", "attention")
_INDUCTOR_DEFAULT = ("cnn",)


@pytest.mark.parametrize("family", list(FAMILIES))
@meshes_for("aot_eager")
def test_aot_eager(ctx, family):
    if not FULL and ctx.mesh.ndim == 2 and family not in _AOT_EAGER_2D_DEFAULT:
        pytest.skip(f"aot_eager on {family} on the 2x2 mesh runs with PDP_COMPILE_MATRIX=full only")
    _check(ctx, family, "aot_eager")


@pytest.mark.parametrize("family", list(FAMILIES))
@meshes_for("inductor")
def test_inductor(ctx, family):
    if not FULL and family not in _INDUCTOR_DEFAULT:
        pytest.skip(f"inductor on {family} runs with PDP_COMPILE_MATRIX=full only")
    _check(ctx, family, "inductor")
