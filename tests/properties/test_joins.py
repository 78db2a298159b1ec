"""Property-based differential tests of the joins rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import JOINS
from ._runner import check_case
from ._strategies import cases


@given(cases(JOINS))
def test_joins(case):
    check_case(case)
