"""Property-based differential tests of the joins rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import JOINS, SAME_LAYOUT_CAT
from ._runner import check_case
from ._strategies import cases


@given(cases(JOINS))
def test_joins(case):
    check_case(case)


@given(cases(SAME_LAYOUT_CAT))
def test_cat_of_same_layout_operands(case):
    """Operands of one layout joined along a dim neither shards (the local join, one autograd node), in
    every memory layout and dtype, uneven and empty shards, against one process."""
    check_case(case)
