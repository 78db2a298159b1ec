"""Property-based differential tests of the attention rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import ATTENTION
from ._runner import check_case
from ._strategies import cases


@given(cases(ATTENTION))
def test_attention(case):
    check_case(case)
