"""What happens when a plain ``torch.Tensor`` (or a DTensor) meets a ShardTensor.

A plain tensor in an op with sharded data is almost always a model weight
(replicated by DDP, all-gathered by FSDP2). *Promotion* treats it as
``Replicate`` on the ShardTensor's mesh and, in backward, sums its gradient
over that mesh so it equals the single-process gradient. DTensors are
converted with ``ShardTensor.from_dtensor`` and keep their own gradient
convention.

The step is the differentiable :class:`Promote`; :func:`promote_args` applies
it to an op's arguments. The ``__torch_function__`` hook calls it before every
op, and rules that build a replicated operand themselves (``matmul``) use
:class:`Promote` directly.

The mode is explicit, resettable state: :func:`set_promotion_mode` and the
:func:`promotion_mode` context manager (which always restores the previous
mode) — tests can change it without leaking into each other.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from ._redistribute import redistribute_local
from ._torch_compat import Function, pytree
from .errors import PlacementError, PromotionError
from .rule_kit import shard_tensor_cls
from .spec import ShardTensorSpec

__all__ = ["TensorPromotionMode", "set_promotion_mode", "get_promotion_mode", "promotion_mode"]


class TensorPromotionMode(enum.Enum):
    """How a plain tensor meeting a ShardTensor is handled."""

    #: No promotion: a plain tensor meeting sharded data raises, unless it is a
    #: 0-dim tensor without grad (a scalar; a scalar parameter's gradient needs promotion).
    DISABLED = "disabled"
    #: Promote to Replicate and warn on every promotion (to find where it happens).
    WARN = "warn"
    #: Promote to Replicate silently. The default.
    SILENT = "silent"


_mode = TensorPromotionMode.SILENT


def _coerce(mode) -> TensorPromotionMode:
    if isinstance(mode, TensorPromotionMode):
        return mode
    if isinstance(mode, str):
        try:
            return TensorPromotionMode(mode.lower())
        except ValueError:
            pass
    choices = ", ".join(repr(m.value) for m in TensorPromotionMode)
    raise ValueError(f"mode must be a TensorPromotionMode or one of {choices}, got {mode!r}")


def set_promotion_mode(mode) -> None:
    """Set the promotion mode (enum or ``"disabled"`` / ``"warn"`` / ``"silent"``)."""
    global _mode
    _mode = _coerce(mode)


def get_promotion_mode() -> TensorPromotionMode:
    """The active promotion mode (``SILENT`` unless changed)."""
    return _mode


@contextlib.contextmanager
def promotion_mode(mode) -> Iterator[TensorPromotionMode]:
    """Use ``mode`` inside the block; the previous mode returns on exit, also on errors."""
    previous = get_promotion_mode()
    set_promotion_mode(mode)
    try:
        yield get_promotion_mode()
    finally:
        set_promotion_mode(previous)


# --------------------------------------------------------------------------- #
# The promotion step
# --------------------------------------------------------------------------- #
def _is_dtensor(x) -> bool:
    return isinstance(x, DTensor)


def _needs_promotion(x, ShardTensor) -> bool:
    """Plain tensors and DTensors, except plain 0-dim tensors that need no gradient (scalars).

    A 0-dim DTensor left as it is reaches DTensor's dispatch, which refuses the
    ShardTensor beside it; a 0-dim plain tensor that requires grad (a scalar
    parameter) would get the unreduced, per-rank gradient as a ShardTensor.
    """
    return (
        isinstance(x, torch.Tensor) and not isinstance(x, ShardTensor)
        and (x.ndim > 0 or x.requires_grad or _is_dtensor(x))
    )


class Promote(Function):
    """Plain tensor -> Replicate ShardTensor; gradient summed over the mesh."""

    @staticmethod
    def forward(plain, mesh):
        ShardTensor = shard_tensor_cls()
        spec = ShardTensorSpec.chunked(mesh, (Replicate(),) * mesh.ndim, plain.shape, plain.dtype)
        return ShardTensor(plain.detach(), spec, requires_grad=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = output._spec

    @staticmethod
    def backward(ctx, grad):
        ShardTensor = shard_tensor_cls()
        if not isinstance(grad, ShardTensor):
            return grad, None
        return redistribute_local(grad._local_tensor, grad._spec, ctx.spec), None


def _needs_no_promotion(args, kwargs, ShardTensor) -> bool:
    """Fast check for the common call: tensors at top level, all ShardTensors on one mesh object.

    Anything else (containers, plain tensors other than scalars without grad,
    DTensors of any ndim, several mesh objects) takes the general path of
    :func:`promote_args`.
    """
    mesh = None
    for a in (*args, *kwargs.values()):
        if type(a) is ShardTensor:
            if mesh is None:
                mesh = a._spec.mesh
            elif a._spec.mesh is not mesh:
                return False
        elif isinstance(a, torch.Tensor):
            if a.ndim > 0 or a.requires_grad or _is_dtensor(a):
                return False
        elif isinstance(a, (list, tuple, dict)):
            return False
    return True


def promote_args(func, args, kwargs):
    """Promote plain non-scalar tensors and DTensors among ``args``/``kwargs``.

    Honours the promotion mode; raises ``PromotionError`` in DISABLED mode and
    ``PlacementError`` when ShardTensors on different meshes meet.
    """
    ShardTensor = shard_tensor_cls()
    if _needs_no_promotion(args, kwargs, ShardTensor):
        return args, kwargs
    flat, spec = pytree.tree_flatten((args, kwargs))
    meshes = []
    for x in flat:
        if isinstance(x, ShardTensor) and not any(x.device_mesh == m for m in meshes):
            meshes.append(x.device_mesh)
    if len(meshes) > 1:
        raise PlacementError(
            f"{_name(func)}: ShardTensor arguments live on different device meshes; "
            "redistribute them onto one mesh first"
        )
    if not meshes or not any(_needs_promotion(x, ShardTensor) for x in flat):
        return args, kwargs
    mesh = meshes[0]
    mode = get_promotion_mode()
    if mode is not TensorPromotionMode.DISABLED and _writes_into_plain(func, args, ShardTensor):
        return _gathered_operands(func, flat, spec, ShardTensor, mode)
    out = []
    for x in flat:
        if not _needs_promotion(x, ShardTensor):
            out.append(x)
        elif _is_dtensor(x):
            out.append(ShardTensor.from_dtensor(x))
        elif mode is TensorPromotionMode.DISABLED:
            raise PromotionError(
                f"{_name(func)}: a plain tensor of shape {tuple(x.shape)} meets a ShardTensor "
                "while promotion is DISABLED; make it distributed first (scatter_tensor, "
                "ShardTensor.from_local(..., placements=[Replicate()])) or enable promotion "
                "with set_promotion_mode('silent')"
            )
        else:
            if mode is TensorPromotionMode.WARN:
                warnings.warn(
                    f"{_name(func)}: promoting a plain tensor of shape {tuple(x.shape)} to "
                    "Replicate on the ShardTensor's mesh",
                    stacklevel=4,
                )
            out.append(Promote.apply(x, mesh))
    return pytree.tree_unflatten(out, spec)


def _writes_into_plain(func, args, ShardTensor) -> bool:
    """Whether ``func`` writes in place into a plain tensor (``plain[idx] = sharded``, ``plain.add_(sharded)``).

    Promoting that destination would write into a detached alias: the values
    land in the plain tensor's memory but autograd never learns of the write,
    so gradients to the sharded operands are silently lost.
    """
    name = getattr(func, "__name__", "")
    in_place = name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__")
    )
    return in_place and bool(args) and _needs_promotion(args[0], ShardTensor) and not _is_dtensor(args[0])


def _gathered_operands(func, flat, spec, ShardTensor, mode):
    """Operands of an in-place op on a plain destination: ShardTensors become their whole values.

    A plain tensor stands for the same value on every rank, so what is
    written into it must be whole: each sharded operand is gathered
    (``full_tensor()``, differentiable) and the op runs on plain tensors,
    recorded by autograd as usual. This is the pattern of public FNO code
    (``out_ft = torch.zeros(...)``, ``out_ft[..., :m1, :m2] = modes``): only
    the written values move, and everything after runs replicated; create
    the destination from a ShardTensor (``x.new_zeros``, ``zeros_like``) to
    keep it sharded.
    """
    if mode is TensorPromotionMode.WARN:
        warnings.warn(
            f"{_name(func)}: writing ShardTensor values into a plain tensor gathers them; "
            "create the destination with x.new_zeros(...) to keep it sharded",
            stacklevel=4,
        )
    out = [x.full_tensor() if isinstance(x, ShardTensor) else x for x in flat]
    return pytree.tree_unflatten(out, spec)


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)
