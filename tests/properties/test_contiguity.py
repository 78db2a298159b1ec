"""Memory-layout metadata of every family's outputs: ``full_tensor()`` is contiguous with
the reference's strides, and ``is_contiguous()`` agrees with the local tensor (every dtype
an op accepts, complex and the ones gloo has no kernels for included)."""

from hypothesis import given

from ._ops import OPS
from ._runner import check_case
from ._strategies import cases


@given(cases(OPS))
def test_contiguity(case):
    check_case(case, contiguity=True)
