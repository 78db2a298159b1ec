"""Every private PyTorch API physicsnemo_dp touches, in one place.

PyTorch's distributed-tensor internals change between releases. Importing them
only here means a torch upgrade is a one-file change: if a name moves, fix it
here and nothing else needs to know.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "funcol",
    "disabled_torch_function",
    "torch_function_disabled",
    "make_wrapper_subclass",
    "all_to_all_single",
    "all_gather_tensor",
    "all_reduce",
    "broadcast",
    "wait",
    "current_mesh",
]


#: ``__torch_function__`` implementation that opts a subclass out of the
#: Python-level override protocol (what DTensor uses).
disabled_torch_function = torch._C._disabled_torch_function_impl


def torch_function_disabled():
    """Context manager under which ``__torch_function__`` of subclasses is skipped."""
    return torch._C.DisableTorchFunctionSubclass()


def make_wrapper_subclass(cls, shape, *, dtype, device, requires_grad, stride=None):
    """Create the storage-less outer tensor of a wrapper subclass."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        shape,
        strides=stride,
        dtype=dtype,
        device=device,
        layout=torch.strided,
        requires_grad=requires_grad,
    )


def _group(mesh, mesh_dim: int):
    return (mesh, mesh_dim)


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """Materialize the result of a functional collective."""
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def all_to_all_single(tensor, output_split_sizes, input_split_sizes, mesh, mesh_dim):
    return wait(
        funcol.all_to_all_single(
            tensor, list(output_split_sizes), list(input_split_sizes), _group(mesh, mesh_dim)
        )
    )


def all_gather_tensor(tensor, gather_dim, mesh, mesh_dim):
    return wait(funcol.all_gather_tensor(tensor, gather_dim, _group(mesh, mesh_dim)))


def all_reduce(tensor, reduce_op: str, mesh, mesh_dim):
    return wait(funcol.all_reduce(tensor, reduce_op, _group(mesh, mesh_dim)))


def broadcast(tensor, src_group_rank: int, mesh, mesh_dim):
    # The functional op takes the source's rank *within the group*.
    return wait(funcol.broadcast(tensor, src_group_rank, _group(mesh, mesh_dim)))


def current_mesh():
    """The mesh of the innermost ``with mesh:`` block, or None."""
    from torch.distributed.device_mesh import _mesh_resources

    stack = getattr(_mesh_resources, "mesh_stack", [])
    return stack[-1] if stack else None
