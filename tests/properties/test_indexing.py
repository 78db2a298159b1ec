"""Property-based differential tests of the indexing rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import INDEXING
from ._runner import check_case
from ._strategies import cases


@given(cases(INDEXING))
def test_indexing(case):
    check_case(case)
