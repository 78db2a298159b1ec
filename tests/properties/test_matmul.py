"""Property-based differential tests of the matmul rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import MATMUL
from ._runner import check_case
from ._strategies import cases


@given(cases(MATMUL))
def test_matmul(case):
    check_case(case)
