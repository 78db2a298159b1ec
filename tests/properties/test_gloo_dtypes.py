"""Property-based differential tests with dtypes gloo has no kernels for (complex, int16).

gloo's all_to_all refuses complex and all its collectives refuse int16 ("Invalid
scalar type"); the collective wrappers in ``physicsnemo_dp._torch_compat`` send
them as same-size views, so these ops must match the single-process result like
any other (this used to be a strict expected failure).

Gradients of complex ops are a separate, open problem, pinned below: their
backward formulas call ``aten._conj`` and ``aten.view_as_real``, which have no
ShardTensor rule (on one rank too: no communication is involved).
"""

import pytest
from hypothesis import Phase, given, settings

from ._ops import GLOO_DTYPES
from ._runner import check_case
from ._strategies import cases


def _complex_grad(case) -> bool:
    return case.requires_grad and case.dtype.startswith("complex")


@given(cases(GLOO_DTYPES).filter(lambda case: not _complex_grad(case)))
def test_dtypes_gloo_has_no_kernels_for(case):
    check_case(case)


@pytest.mark.xfail(strict=True, reason="complex backward formulas call aten._conj / aten.view_as_real, which have "
                   "no ShardTensor rule (NotImplementedError, also on one rank)")
@settings(phases=[Phase.explicit, Phase.generate])  # an expected failure: skip the shrink
@given(cases(GLOO_DTYPES).filter(_complex_grad))
def test_complex_gradients(case):
    check_case(case)
