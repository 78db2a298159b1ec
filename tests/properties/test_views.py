"""Property-based differential tests of the views rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import KNOWN_VIEWS, VIEWS
from ._runner import check_case
from ._strategies import cases


@given(cases(VIEWS))
def test_views(case):
    check_case(case)


@given(cases(KNOWN_VIEWS))
def test_view_dtype(case):
    """``x.view(dtype)`` of the same item size: a bit reinterpretation, layout unchanged."""
    check_case(case)
