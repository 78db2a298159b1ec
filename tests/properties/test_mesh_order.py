"""Every core family on meshes that list their ranks in any order (see _runner.py for what is checked).

``DeviceMesh("cpu", [3, 2, 1, 0])`` puts global rank 3 at mesh coordinate 0, but the
process group of the mesh dim numbers its members by increasing global rank, so
coordinate and group rank differ. Size tables, split lists, peers and broadcast
sources are indexed by coordinate; these cases draw a random order of the ranks (the
same on every rank: the case carries it) for 1-D meshes of 2, 3 and 4 ranks and the
2x2 mesh, and compare with one process as the family tests do.
"""

from hypothesis import given

from ._ops import ATTENTION, DIM_OPS, INDEXING, JOINS, LAYOUTS, MATMUL, POINTWISE, REDUCTIONS, SPATIAL, VIEWS
from ._runner import check_case
from ._strategies import permuted

#: The core families, one table: a drawn case picks any op of any of them.
_CORE = {**POINTWISE, **REDUCTIONS, **VIEWS, **JOINS, **MATMUL, **INDEXING, **LAYOUTS,
         **{name: DIM_OPS[name] for name in ("cumsum", "softmax", "sort", "flip", "roll")}}


@given(permuted(_CORE))
def test_core_families(case):
    check_case(case, contiguity=None)


@given(permuted({"conv": SPATIAL["conv"], **ATTENTION}))
def test_halos_and_ring(case):
    """Halo exchanges (point to point with the neighbours) and ring attention (point-to-point hops)."""
    check_case(case, contiguity=None)
