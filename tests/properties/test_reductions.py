"""Property-based differential tests of the reductions rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import REDUCTIONS
from ._runner import check_case
from ._strategies import cases


@given(cases(REDUCTIONS))
def test_reductions(case):
    check_case(case)
