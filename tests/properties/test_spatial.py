"""Property-based differential tests of the spatial rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import SPATIAL
from ._runner import check_case
from ._strategies import cases


@given(cases(SPATIAL))
def test_spatial(case):
    check_case(case)
