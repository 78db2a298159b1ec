"""physicsnemo_dp: domain-parallel physics ML on PyTorch.

One sample's domain (a mesh, a grid, a volume) is split across ranks as a
:class:`ShardTensor` whose shards may have any sizes. Ordinary ``nn.Module``
code runs on it and gives the output and gradients one big device would.
"""

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .collectives import CommCounter, count_collectives
from .errors import ImplicitGatherError, ImplicitGatherWarning, PlacementError, PromotionError
from ._gathers import implicit_gathers
from .dispatch.fallback import fallback
from .promotion import TensorPromotionMode, bucket_gradients, get_promotion_mode, promotion_mode, set_promotion_mode
from .scatter import scatter_tensor
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec
from .spatial import halo_exchange
from .sync import sync_module_over_mesh
from .fusion import rowwise, rowwise_all
from .launch import RankError, launch
from .split import chunk_sizes
from . import catalog, debug  # noqa: F401  (catalog fills the op table; debug is a public subpackage)
from . import random  # noqa: E402,F401  (public subpackage: decomposition-invariant random numbers)
from . import integrations  # noqa: E402,F401  (public subpackage: opt-in adapters for third-party layers)
from .random import rand, randint, randn  # noqa: E402

__all__ = [
    "ShardTensor",
    "ShardTensorSpec",
    "TensorPromotionMode",
    "scatter_tensor",
    "halo_exchange",
    "sync_module_over_mesh",
    "rowwise",
    "rowwise_all",
    "launch",
    "RankError",
    "set_promotion_mode",
    "get_promotion_mode",
    "promotion_mode",
    "bucket_gradients",
    "count_collectives",
    "CommCounter",
    "PlacementError",
    "PromotionError",
    "implicit_gathers",
    "fallback",
    "ImplicitGatherError",
    "ImplicitGatherWarning",
    "chunk_sizes",
    "rand",
    "randn",
    "randint",
    "Shard",
    "Replicate",
    "Partial",
]


# Interoperability with opt_einsum (tensorly's einsum, hence neuraloperator's spectral convolutions):
# opt_einsum picks an operand's array library by the top-level module of its class and looks up
# ``einsum``, ``tensordot`` and ``transpose`` there. For a ShardTensor that is this package; without
# these three it falls back to NumPy, which cannot take a ShardTensor. They are torch's functions in
# opt_einsum's (NumPy-style) signatures, as in opt_einsum's own torch backend; not part of ``__all__``.
def einsum(equation, *operands, **kwargs):
    """``torch.einsum`` with operands as separate arguments (opt_einsum's backend interface)."""
    import torch

    return torch.einsum(equation, *operands)


def tensordot(x, y, axes=2):
    """``torch.tensordot`` with NumPy's ``axes`` keyword (opt_einsum's backend interface)."""
    import torch

    return torch.tensordot(x, y, dims=axes)


def transpose(x, axes):
    """``x.permute(*axes)`` (opt_einsum's backend interface; torch's ``transpose`` swaps two dims only)."""
    return x.permute(*axes)
