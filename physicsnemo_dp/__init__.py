"""physicsnemo_dp: domain-parallel physics ML on PyTorch.

One sample's domain (a mesh, a grid, a volume) is split across ranks as a
:class:`ShardTensor` whose shards may have any sizes. Ordinary ``nn.Module``
code runs on it and gives the output and gradients one big device would.
"""

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .collectives import CommCounter, count_collectives
from .errors import PlacementError, PromotionError
from .promotion import TensorPromotionMode, get_promotion_mode, promotion_mode, set_promotion_mode
from .scatter import scatter_tensor
from .shard_tensor import ShardTensor
from .spec import ShardTensorSpec
from .spatial import halo_exchange
from .sync import sync_module_over_mesh
from .launch import RankError, launch
from .split import chunk_sizes
from . import catalog, debug  # noqa: F401  (catalog fills the op table; debug is a public subpackage)

__all__ = [
    "ShardTensor",
    "ShardTensorSpec",
    "TensorPromotionMode",
    "scatter_tensor",
    "halo_exchange",
    "sync_module_over_mesh",
    "launch",
    "RankError",
    "set_promotion_mode",
    "get_promotion_mode",
    "promotion_mode",
    "count_collectives",
    "CommCounter",
    "PlacementError",
    "PromotionError",
    "chunk_sizes",
    "Shard",
    "Replicate",
    "Partial",
]
