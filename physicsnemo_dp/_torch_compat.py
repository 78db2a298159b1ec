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
    return wait(funcol.all_gather_single(tensor, gather_dim, _group(mesh, mesh_dim)))


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


def torch_function_state():
    """This thread's torch-function state (enabled / subclasses disabled / all disabled)."""
    return torch._C._get_torch_function_state()


class torch_function_state_as:
    """Context manager: run the block under a saved torch-function state, then restore.

    A forward recomputed in backward (activation checkpointing) must see the
    state its original run saw: the autograd engine may be entered with
    subclass ``__torch_function__`` disabled, which would send ShardTensor ops
    past their function-level handlers and record a different graph.
    """

    def __init__(self, state) -> None:
        self._state, self._previous = state, None

    def __enter__(self) -> None:
        self._previous = torch._C._get_torch_function_state()
        torch._C._set_torch_function_state(self._state)

    def __exit__(self, *exc) -> None:
        torch._C._set_torch_function_state(self._previous)


def run_autograd_engine(outputs, grad_outputs, *, retain_graph, create_graph, inputs, accumulate_grad, allow_unused=True):
    """Run the autograd engine directly, past ``torch.autograd``'s ``__torch_function__`` check.

    ``torch.autograd.backward``/``grad`` hand subclass tensors to
    ``__torch_function__``; running them from there with subclass
    torch-function disabled would keep it disabled for the whole backward pass,
    so function-level handlers and promotion would be skipped in every backward
    formula and activation-checkpoint recompute. Calling the engine here keeps
    the caller's torch-function state.
    """
    outputs = tuple(outputs)
    grads = torch.autograd._make_grads(outputs, tuple(grad_outputs), is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    return torch.autograd.graph._engine_run_backward(
        outputs,
        grads,
        retain_graph,
        create_graph,
        tuple(inputs),
        allow_unused,
        accumulate_grad,
    )
