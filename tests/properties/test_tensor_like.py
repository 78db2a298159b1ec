"""Property-based differential tests of the tensor_like rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import KNOWN_TENSOR_LIKE, TENSOR_LIKE
from ._runner import check_case
from ._strategies import cases


@given(cases(TENSOR_LIKE))
def test_tensor_like(case):
    check_case(case)


@given(cases(KNOWN_TENSOR_LIKE))
def test_contiguous(case):
    """``x.contiguous()`` of a ShardTensor whose local tensor is not contiguous."""
    check_case(case, contiguity=None)
