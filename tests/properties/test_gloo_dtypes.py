"""Property-based differential tests with dtypes gloo has no kernels for (complex, int16).

gloo's all_to_all refuses complex and all its collectives refuse int16 ("Invalid
scalar type"); the collective wrappers in ``physicsnemo_dp._torch_compat`` send
them as same-size views, so these ops must match the single-process result like
any other (this used to be a strict expected failure).

Gradients of complex ops used to be a separate expected failure: their backward
formulas call ``aten._conj`` and ``aten.view_as_real``, which had no ShardTensor
rule (on one rank too). They now have rules (``rules/pointwise.py``,
``rules/views.py``) and the contraction's backward conjugates like torch's, so
complex gradients must match too. The family tests draw complex dtypes as well.
"""

from hypothesis import given

from ._ops import GLOO_DTYPES
from ._runner import check_case
from ._strategies import cases


def _complex_grad(case) -> bool:
    return case.requires_grad and case.dtype.startswith("complex")


@given(cases(GLOO_DTYPES).filter(lambda case: not _complex_grad(case)))
def test_dtypes_gloo_has_no_kernels_for(case):
    check_case(case)


@given(cases(GLOO_DTYPES).filter(_complex_grad))
def test_complex_gradients(case):
    check_case(case)
