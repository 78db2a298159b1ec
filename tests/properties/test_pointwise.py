"""Property-based differential tests of the pointwise rules (see _runner.py for what is checked)."""

from hypothesis import given

from ._ops import KNOWN_POINTWISE, POINTWISE, SAME_SPEC_ADD, ZERO_DIM_PLAIN_GRAD
from ._runner import check_case
from ._strategies import cases


@given(cases(POINTWISE))
def test_pointwise(case):
    check_case(case)


@given(cases(KNOWN_POINTWISE))
def test_zero_dim_dtensor_operand(case):
    """A 0-dim (Replicate) DTensor meeting a ShardTensor in an elementwise op."""
    check_case(case)


@given(cases(ZERO_DIM_PLAIN_GRAD))
def test_zero_dim_plain_operand_gradient(case):
    """A 0-dim plain tensor that requires grad (a scalar parameter) is promoted: a plain, mesh-summed gradient."""
    check_case(case)


@given(cases(SAME_SPEC_ADD))
def test_add_of_same_spec_operands(case):
    """Operands of one spec in their own memory layouts, every dtype, uneven and empty shards: the forward adds
    and the gradient sum answered in ``__torch_dispatch__``, against one process."""
    check_case(case)
