"""Memory-layout metadata of every family's outputs: ``full_tensor()`` is contiguous with
the reference's strides, and ``is_contiguous()`` agrees with the local tensor."""

from hypothesis import given

from ._ops import GLOO_DTYPES, OPS
from ._runner import check_case
from ._strategies import cases


@given(cases({name: op for name, op in OPS.items() if name not in GLOO_DTYPES}))
def test_contiguity(case):
    check_case(case, contiguity=True)
