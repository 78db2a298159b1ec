"""Property-based differential tests of the matmul rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import MATMUL, PLAIN_WEIGHT_PRODUCT
from ._runner import check_case
from ._strategies import cases


@given(cases(MATMUL))
def test_matmul(case):
    check_case(case)


@given(cases(PLAIN_WEIGHT_PRODUCT))
def test_product_with_a_plain_weight(case):
    """``torch.matmul(x, w)`` and ``x @ w`` with a plain weight (the fast path before promotion, the operator
    without torch's hook) on every layout, memory layout and dtype of ``x``, against one process."""
    check_case(case)
