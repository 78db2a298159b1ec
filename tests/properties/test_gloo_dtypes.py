"""Property-based differential tests with dtypes gloo has no kernels for (complex, int16)."""

import pytest
from hypothesis import Phase, given, settings

from ._ops import GLOO_DTYPES
from ._runner import check_case
from ._strategies import cases


@pytest.mark.xfail(strict=True, reason="collectives.py hands complex and int16 tensors to gloo as they are; gloo "
                   "raises 'Invalid scalar type' (e.g. full_tensor() of a complex64 or int16 ShardTensor sharded "
                   "over 2 ranks); they could travel as same-size real/int views")
@settings(phases=[Phase.explicit, Phase.generate])  # an expected failure: skip the shrink
@given(cases(GLOO_DTYPES))
def test_gloo_cannot_send_these_dtypes(case):
    check_case(case)
