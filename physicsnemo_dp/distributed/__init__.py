"""Model-facing parallelization: a ``(ddp, domain)`` mesh, DDP or FSDP2, capabilities, precision.

A training script resolves one :class:`MeshContext` and calls
:func:`parallelize_model`; models customize only through a
:class:`ModelParallelizer` sidecar and declare what they support with
:class:`ModelCapabilities`. Core tensor code (everything else in
``physicsnemo_dp``) never imports this package; models import only the names
in ``__all__``. See ``README.md`` next to this file for the whole flow.
"""

from .capabilities import (
    CapabilityError,
    ModelCapabilities,
    query_capabilities,
    register_capabilities,
    unregister_capabilities,
)
from .activation_checkpointing import is_checkpointed
from .config import ActivationCheckpointing, DDPConfig, FSDP2Config, MixedPrecisionPolicy, Trainability
from .mesh_context import AXES, MeshContext
from .parallelizer import ModelParallelizer, find_blocks, parallelize_model

__all__ = [
    "AXES",
    "MeshContext",
    "DDPConfig",
    "FSDP2Config",
    "ActivationCheckpointing",
    "MixedPrecisionPolicy",
    "Trainability",
    "ModelParallelizer",
    "parallelize_model",
    "find_blocks",
    "is_checkpointed",
    "ModelCapabilities",
    "CapabilityError",
    "query_capabilities",
    "register_capabilities",
    "unregister_capabilities",
]
