"""Property-based differential tests of the dim_ops rules (see _runner.py for what is checked)."""

from hypothesis import example, given
from torch.distributed.tensor.placement_types import Replicate, Shard

from ._ops import DIM_OPS
from ._runner import check_case
from ._strategies import Case, InputCase, cases

_PLAIN, _PLAIN1 = InputCase((2,), None), InputCase((1,), None)


@given(cases(DIM_OPS))
# Found by the nightly profile: layer_norm over every dim of x gave its weight a gradient of
# shape (1,) (spatial/norm.py summed over an empty dim list, which sums over all dims).
@example(Case("layer_norm", 2, (2,), (InputCase((2,), (Replicate(),), (None,), ("contiguous",) * 2), _PLAIN, _PLAIN),
              "float64", True, 0, {"k": 1}))
# ... and over a sharded size-1 dim with an empty shard, the weight gradient of that empty rank
# had one element instead of none: that rank raised in the gather, the other waited forever.
@example(Case("layer_norm", 2, (2,), (InputCase((1,), (Shard(0),), ((0, 1),), ("contiguous",) * 2), _PLAIN1, _PLAIN1),
              "float64", True, 0, {"k": 1}))
def test_dim_ops(case):
    check_case(case)
