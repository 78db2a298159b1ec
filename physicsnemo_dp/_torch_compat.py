"""Every private PyTorch API physicsnemo_dp touches, in one place.

PyTorch's distributed-tensor internals change between releases. Importing them
only here means a torch upgrade is a one-file change: if a name moves, fix it
here and nothing else needs to know.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
from torch._ops import OpOverload
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "pytree",
    "TorchDispatchMode",
    "OpOverload",
    "TensorBase",
    "upsample_kernels",
    "Function",
    "non_differentiable",
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
    "wire_view",
    "check_reducible",
    "wait",
    "current_mesh",
    "traced",
    "real_tensors",
    "on_real_tensors",
    "graph_constant",
    "graph_break",
    "dynamo_frame_hook_active",
    "aot_cache_bypass",
    "compile_counts",
    "pad_builtin",
    "assert_in_graph",
    "fused_attention_fits",
    "fused_attention",
    "fused_attention_backward",
    "efficient_lse_rows",
    "default_store",
    "torch_function_state",
    "torch_function_state_as",
    "run_autograd_engine",
    "tracing",
    "fake_process_group",
    "is_wrapper_subclass_type",
    "storage_key",
    "fused_sdp_choice",
    "subclass_torch_function_disabled",
    "dispatch_mode_active",
    "SubclassFunction",
    "direct_apply",
    "WRAPPER_ARGS",
    "torch_function_enabled",
    "torch_function_mode_active",
    "collective_output_kernels",
    "version_witness",
    "check_version",
]


#: torch's pytree utilities (``tree_flatten``, ``tree_unflatten``, ``tree_map``): the rules
#: flatten nested op arguments with them, as DTensor does.
#: ``TorchDispatchMode``: the base class of a mode that sees every ATen call below autograd
#: (the FFT family records torch's own decomposition of a ``torch.fft`` call with one).
#: ``OpOverload``: the type of ATen ops (``aten.mm.default``) as the dispatcher hands them over.
#: ``TensorBase``: the C base class whose property descriptors (``grad``, ``grad_fn``, ...)
#: ShardTensor reads directly, so those reads do not re-enter ``__torch_function__``.
TensorBase = torch._C.TensorBase

#: The interpolation kernels ``F.interpolate`` dispatches to, by mode, with the
#: signature ``kernel(x, output_size, align_corners, scales)`` (the nearest kernels take
#: no ``align_corners``). The sharded interpolation calls them on local windows.
upsample_kernels = {
    "nearest": lambda x, size, ac, scales: torch._C._nn.upsample_nearest2d(x, size, scales),
    "nearest-exact": lambda x, size, ac, scales: torch._C._nn._upsample_nearest_exact2d(x, size, scales),
    "linear": lambda x, size, ac, scales: torch._C._nn.upsample_bilinear2d(x, size, ac, scales),
    "cubic": lambda x, size, ac, scales: torch._C._nn.upsample_bicubic2d(x, size, ac, scales),
    "linear-aa": lambda x, size, ac, scales: torch._C._nn._upsample_bilinear2d_aa(x, size, ac, scales),
    "cubic-aa": lambda x, size, ac, scales: torch._C._nn._upsample_bicubic2d_aa(x, size, ac, scales),
}

#: ``__torch_function__`` implementation that opts a subclass out of the
#: Python-level override protocol (what DTensor uses).
disabled_torch_function = torch._C._disabled_torch_function_impl


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _backward_apply(self, *args):
    """``BackwardCFunction.apply`` for a Function that defines ``backward`` (no ``vjp``, no boxed gradients).

    torch's looks up ``backward`` and ``vjp`` on every call, to refuse a Function defining both and to pick
    the one defined (two Python frames and ~50 bytecodes per backward node); for these Functions the answer is
    known when the class is made.
    """
    return self._forward_cls.backward(self, *args)


class _FunctionMeta(type(torch.autograd.Function)):
    """torch's Function metaclass, whose backward class (``_backward_cls``, what the engine calls a node's
    ``apply`` on) gets :func:`_backward_apply` where that is what torch's ``apply`` would do."""

    def __init__(cls, name, bases, attrs):
        super().__init__(name, bases, attrs)
        base = torch.autograd.Function
        if cls.vjp is base.vjp and cls.backward is not base.backward and not cls.boxed_grads_call:
            node = cls._backward_cls
            cls._backward_cls = type(
                node.__name__, (node,), {"apply": _backward_apply, "__module__": node.__module__, "__qualname__": node.__qualname__}
            )


class Function(torch.autograd.Function, metaclass=_FunctionMeta):
    """``torch.autograd.Function`` without the per-call argument binding, where binding changes nothing.

    For Functions with ``setup_context``, torch's ``apply`` binds every call's
    arguments to ``forward``'s signature with ``inspect`` (about 20 µs a call,
    more than many local ops cost) so that defaults reach ``setup_context``.
    When a call passes every argument positionally the binding is the
    identity, and this ``apply`` goes straight to autograd's C++ ``apply``.
    Every autograd Function of the library derives from this one.
    """

    @classmethod
    def apply(cls, *args, **kwargs):
        if kwargs or torch._C._are_functorch_transforms_active() or not _binds_to_itself(cls, len(args)):
            return super().apply(*args, **kwargs)
        # torch._functorch.utils.unwrap_dead_wrappers, without its generator
        args = tuple([_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])
        return super(torch.autograd.Function, cls).apply(*args)


def once_differentiable(fn):
    """``torch.autograd.function.once_differentiable``, without its ``no_grad`` block where grad mode is off already.

    The engine runs a backward with grad mode off unless it creates a graph (``create_graph=True``), so for
    nearly every call torch's wrapper enters and leaves a ``no_grad`` block that changes nothing (~1.5 us a
    call, on every backward node of the library). Then ``fn`` runs directly, which is what torch's wrapper
    does in that case (its ``no_grad`` is a no-op and it returns ``fn``'s outputs as they are); with grad mode
    on, torch's own wrapper runs (it refuses a double backward through the node).
    """
    guarded = torch.autograd.function.once_differentiable(fn)
    is_grad_enabled = torch.is_grad_enabled

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if is_grad_enabled():
            return guarded(ctx, *args)
        return fn(ctx, *args)

    return wrapper


def is_zero_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of autograd's storage-less ZeroTensors (``_efficientzerotensor``)."""
    return tensor._is_zerotensor()


@contextlib.contextmanager
def python_dispatch_excluded():
    """Ops inside skip the Python dispatch key: on a wrapper subclass they change the wrapper's own metadata.

    ``__torch_dispatch__`` of an in-place view op (``squeeze_``, ``unsqueeze_``)
    uses it to give the wrapper its new global shape after the local tensor
    changed; without it the call would re-enter ``__torch_dispatch__``.
    """
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        yield


_NO_PYTHON_DISPATCH = torch._C._DisableTorchDispatch
_NO_SUBCLASS_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_TENSOR_DETACH = torch._C.TensorBase.detach
_VERSION = torch._C.TensorBase._version.__get__


def version_witness(tensor: torch.Tensor) -> tuple:
    """``(alias, version)``: a plain alias of wrapper subclass ``tensor`` that shares its version counter, and
    the counter's value now; :func:`check_version` compares them later.

    What autograd's ``save_for_backward`` keeps of a Function's output to catch an in-place change before
    backward, without saving the output itself: autograd saves an output through a ``detach`` and restores
    it through another, each a trip through ``__torch_dispatch__`` on a wrapper subclass (~8 us a call
    each). The alias is autograd's ``detach`` with Python dispatch off (~2 us; a plain tensor of the wrapper's
    metadata, no data), never read but for its version. For plain eager code: it bypasses dispatch modes.
    """
    with _NO_PYTHON_DISPATCH(), _NO_SUBCLASS_TORCH_FUNCTION():
        alias = _TENSOR_DETACH(tensor)
    return alias, _VERSION(alias)


def check_version(witness: tuple, what: str) -> None:
    """Raise autograd's in-place error if the tensor of :func:`version_witness` changed in place since."""
    alias, version = witness
    now = _VERSION(alias)
    if now != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{what} is at version {now}; expected version {version} instead."
        )


def non_differentiable(ctx, *outputs) -> None:
    """Mark ``outputs`` of a Function as carrying no gradient, and keep autograd from zero-filling theirs.

    By default autograd hands ``backward`` a zero tensor for every output
    without a gradient, non-differentiable ones included: an output-sized
    allocation per call (a whole window, a normalized input). Every backward
    of the library reads only the differentiable output's gradient, which is
    defined whenever backward runs.
    """
    ctx.mark_non_differentiable(*outputs)
    ctx.set_materialize_grads(False)


@functools.lru_cache(maxsize=None)
def _binds_to_itself(cls, nargs: int) -> bool:
    """Whether torch's ``apply`` would pass ``nargs`` positional arguments to ``forward`` as they are.

    It binds them to ``forward``'s signature only for a Function with ``setup_context``; one in the
    ``forward(ctx, ...)`` style gets them unbound. For a ``setup_context`` Function: whether binding adds no
    defaults.
    """
    if cls.setup_context is torch.autograd.Function.setup_context:  # forward(ctx, ...): torch does not bind
        return True
    try:
        bound = inspect.signature(cls.forward).bind(*range(nargs))
    except TypeError:
        return False
    given = bound.args
    bound.apply_defaults()
    return bound.args == given and not bound.kwargs


#: Whether autocast is on for any device type (one C call: the hot path checks it on every handled call).
any_autocast_enabled = torch._C._is_any_autocast_enabled


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
    """Materialize the result of a functional collective (and keep it in a compiled graph)."""
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    if traced(tensor):
        _keep_collective(tensor)
    return tensor


# --------------------------------------------------------------------------- #
# dtypes the backends cannot carry
# --------------------------------------------------------------------------- #
# Backends have a kernel per dtype and refuse the others ("Invalid scalar
# type"). Measured with torch 2.13 on gloo (2 ranks, functional collectives):
# all_to_all_single refuses complex; every collective refuses int16, uint16,
# uint32, uint64 and float8; a bool all_reduce sum returns invalid bools (byte
# 2); send/recv moves anything. NCCL has no int16 either. Every collective wrapper below therefore hands the backend a
# stand-in of the same bytes (data movement) or of a wider dtype (reductions)
# and returns the caller's dtype, so callers never see the difference.

#: Dtypes gloo and NCCL move and reduce as they are (but see bool sums in
#: :func:`_reduction_wire`).
_NATIVE = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool}
)

#: A native dtype of each element size: moving bytes through it is bit-exact
#: (data movement never does arithmetic, so float16 carries int16 payloads,
#: NaN patterns included).
_SAME_SIZE = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}

#: Reductions of dtypes no backend reduces run in a wider native dtype that
#: holds every value exactly; casting the result back wraps integers modulo
#: 2**bits, which is what torch's own integer addition does.
_WIDER = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    **{d: torch.float32 for d in (torch.float8_e4m3fn, torch.float8_e5m2)},
}

#: Signed twins of unsigned dtypes: the bits of a sum are the same in both.
_SIGNED_TWIN = {torch.uint32: torch.int32, torch.uint64: torch.int64}

#: Per backend name, the dtypes it reduces natively beyond ``_NATIVE`` (none
#: known for gloo and NCCL; a backend listed here skips the widening cast).
_REDUCES_ALSO: dict = {"gloo": frozenset(), "nccl": frozenset()}


def _same_size_wire(tensor: torch.Tensor):
    """``(stand-in, restore)`` for moving ``tensor``'s bytes; ``restore`` is None when it travels as it is.

    Views only (free): complex as ``view_as_real`` (a trailing dim of 2, so
    row splits along dim 0 and a non-negative gather dim keep their meaning),
    other dtypes as the native dtype of their element size (same shape, 0-dim
    too). The stand-in shares ``tensor``'s memory when it is contiguous, so a
    receive buffer's stand-in fills the buffer itself.
    """
    dtype = tensor.dtype
    if dtype in _NATIVE:
        return tensor, None
    if dtype.is_complex:
        return torch.view_as_real(tensor.resolve_conj().contiguous()), torch.view_as_complex
    return tensor.contiguous().view(_SAME_SIZE[dtype.itemsize]), lambda out: out.view(dtype)


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a dtype every backend moves (for point-to-point, which has no wrapper here)."""
    return _same_size_wire(tensor)[0]


def check_reducible(dtype: torch.dtype, reduce_op: str) -> None:
    """Refuse a reduction no stand-in can compute, before any rank enters the collective.

    Every rank holds the same dtype, so every rank raises alike instead of
    one failing inside the backend while the others wait for it.
    """
    if dtype.is_complex and reduce_op in ("max", "min"):
        raise TypeError(f"a {reduce_op!r} reduction of {dtype} is undefined: complex numbers have no order")
    if dtype in _NATIVE or dtype.is_complex or dtype in _WIDER or (reduce_op == "sum" and dtype in _SIGNED_TWIN):
        return
    raise TypeError(f"a {reduce_op!r} reduction of {dtype} is unsupported: no backend reduces it and no wider dtype holds it")


def _reduction_wire(tensor: torch.Tensor, reduce_op: str, mesh, mesh_dim):
    """``(stand-in, op, restore)`` for reducing ``tensor``: free views where the arithmetic allows, else a widening cast.

    A bool sum is a logical or, as ``a + b`` of bool tensors is in torch (and
    as NCCL computes it); gloo instead adds the bytes and returns bools whose
    byte is 2 (measured), which later ops misread. It runs as a ``max`` of the
    bytes: exact for any number of ranks, no cast. Complex sums are componentwise, so ``view_as_real`` is exact. Unsigned
    32/64-bit sums are bitwise the signed ones (two's complement addition is
    modular), so a same-size view is exact too. Otherwise the dtype is cast
    to :data:`_WIDER`, only for backends that cannot reduce it as it is (a
    cast is not free). ``avg`` never gets here: :mod:`physicsnemo_dp.collectives`
    sums and divides, as gloo has no avg.
    """
    dtype = tensor.dtype
    check_reducible(dtype, reduce_op)
    if dtype == torch.bool and reduce_op == "sum":
        return tensor.contiguous().view(torch.uint8), "max", lambda out: out.view(torch.bool)
    if dtype in _NATIVE:
        return tensor, reduce_op, None
    if dtype.is_complex:
        return torch.view_as_real(tensor.resolve_conj().contiguous()), reduce_op, torch.view_as_complex
    if reduce_op == "sum" and dtype in _SIGNED_TWIN:
        return tensor.contiguous().view(_SIGNED_TWIN[dtype]), reduce_op, lambda out: out.view(dtype)
    if dtype in _REDUCES_ALSO.get(_backend_name(mesh, mesh_dim), frozenset()):
        return tensor, reduce_op, None
    return tensor.to(_WIDER[dtype]), reduce_op, lambda out: out.to(dtype)


@functools.lru_cache(maxsize=None)
def _backend_name(mesh, mesh_dim: int) -> str:
    """The backend of ``mesh_dim``'s process group (asked once per mesh dim: only widening casts need it)."""
    return str(torch.distributed.get_backend(mesh.get_group(mesh_dim)))


def _restored(out: torch.Tensor, restore) -> torch.Tensor:
    return out if restore is None else restore(out)


# The dtype translation runs inside ``_in_its_pass()`` with the collective, so
# a traced backward keeps the views and casts next to it. Split lists, gathered
# order and ``src_group_rank`` are in *group-rank* order, as the backend reads
# them; :mod:`physicsnemo_dp.collectives` translates from mesh coordinates.
def all_to_all_single(tensor, output_split_sizes, input_split_sizes, mesh, mesh_dim, finish=None):
    with _in_its_pass():
        wire, restore = _same_size_wire(tensor)
        if _eager(wire) and wire.ndim:
            out = wire.new_empty((sum(output_split_sizes), *wire.shape[1:]))
            group = mesh.get_group(mesh_dim)
            _finish(torch.distributed.all_to_all_single(out, wire.contiguous(), list(output_split_sizes),
                                                        list(input_split_sizes), group=group, async_op=True),
                    group, "all_to_all", finish)
        else:
            out = wait(
                funcol.all_to_all_single(
                    wire, list(output_split_sizes), list(input_split_sizes), _group(mesh, mesh_dim)
                )
            )
        return _restored(out, restore)


def all_gather_tensor(tensor, gather_dim, mesh, mesh_dim, finish=None):
    gather_dim %= max(tensor.ndim, 1)  # counted from the front: a complex stand-in has one more (trailing) dim
    with _in_its_pass():
        wire, restore = _same_size_wire(tensor)
        if _eager(wire) and wire.ndim:
            size = mesh.size(mesh_dim)
            out = wire.new_empty((size * wire.shape[0], *wire.shape[1:]))  # the pieces one after another
            group = mesh.get_group(mesh_dim)
            _finish(torch.distributed.all_gather_single(out, wire.contiguous(), group=group, async_op=True),
                    group, "all_gather", finish)
            if gather_dim:
                out = torch.cat(out.view(size, *wire.shape).unbind(0), gather_dim)  # also for empty pieces
        else:
            out = wait(funcol.all_gather_single(wire, gather_dim, _group(mesh, mesh_dim)))
        return _restored(out, restore)


def all_reduce(tensor, reduce_op: str, mesh, mesh_dim, finish=None):
    with _in_its_pass():
        wire, op, restore = _reduction_wire(tensor, reduce_op, mesh, mesh_dim)
        if _eager(wire) and op in _REDUCE_OPS:
            out = wire.clone(memory_format=torch.contiguous_format)  # what the functional op allocates too
            group = mesh.get_group(mesh_dim)
            _finish(torch.distributed.all_reduce(out, op=_REDUCE_OPS[op], group=group, async_op=True),
                    group, "all_reduce", finish)
        else:
            out = wait(funcol.all_reduce(wire, op, _group(mesh, mesh_dim)))
        return _restored(out, restore)


def broadcast(tensor, src_group_rank: int, mesh, mesh_dim, finish=None):
    # The functional op takes the source's rank *within the group*.
    with _in_its_pass():
        wire, restore = _same_size_wire(tensor)
        if _eager(wire):
            out = wire.clone(memory_format=torch.contiguous_format)
            group = mesh.get_group(mesh_dim)
            _finish(torch.distributed.broadcast(out, group=group, group_src=src_group_rank, async_op=True),
                    group, "broadcast", finish)
        else:
            out = wait(funcol.broadcast(wire, src_group_rank, _group(mesh, mesh_dim)))
        return _restored(out, restore)


def _finish(work, group, kind: str, finish) -> None:
    """Wait for an eager collective: through ``finish(work, group, kind)`` when given (the stall check)."""
    if finish is None:
        work.wait()
    else:
        finish(work, group, kind)


def _eager(tensor: torch.Tensor) -> bool:
    """Whether a collective on ``tensor`` may call the process group in place instead of the functional op.

    The functional collectives exist for tracing; in eager code they cost
    about 100 us more CPU per call than the in-place c10d op on the same
    buffer (measured: 150-250 against 41-56 us for a 12k-float all-reduce on
    gloo), in wrapping the result in an ``AsyncCollectiveTensor`` and
    waiting on it. The result is the same tensor either way. Traced, meta
    (``debug.simulate``) and dispatch-mode runs (which must see the
    functional op) keep the functional path.
    """
    return tensor.device.type != "meta" and not tracing(tensor) and not dispatch_mode_active()


#: The reductions :mod:`physicsnemo_dp.collectives` issues (``avg`` arrives as a sum).
_REDUCE_OPS = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}


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


def run_autograd_engine(
    outputs, grad_outputs, *, retain_graph, create_graph, inputs, accumulate_grad, allow_unused=True, made=False
):
    """Run the autograd engine directly, past ``torch.autograd``'s ``__torch_function__`` check.

    ``torch.autograd.backward``/``grad`` hand subclass tensors to
    ``__torch_function__``; running them from there with subclass
    torch-function disabled would keep it disabled for the whole backward pass,
    so function-level handlers and promotion would be skipped in every backward
    formula and activation-checkpoint recompute. Calling the engine here keeps
    the caller's torch-function state.
    """
    outputs = tuple(outputs)
    # ``made``: the caller built every gradient as ``_make_grads`` would (implicit ones of scalar outputs)
    grads = tuple(grad_outputs) if made else torch.autograd._make_grads(outputs, tuple(grad_outputs), is_grads_batched=False)
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


#: dtypes torch's memory-efficient CUDA kernel takes
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_attention_fits(q, k, v, causal: bool) -> bool:
    """Whether :func:`fused_attention` runs a fused kernel on 4-D ``q, k, v`` (else the caller's math path).

    CPU (and meta, on which ``debug.simulate`` plays a CPU mesh): the flash CPU kernel takes any
    floating dtype. CUDA: the memory-efficient kernel, where torch's own selector says it can run on
    these tensors (dtype, head size, alignment, the device's capability, ``sdpa_kernel`` settings).
    """
    kind = q.device.type
    if kind in ("cpu", "meta"):
        return True
    if kind != "cuda" or q.dtype not in _EFFICIENT_DTYPES:
        return False
    # the kernel gets (N, 1, n, E) tensors of q's dtype, unit stride along E: asked about such tensors
    q4, k4, v4 = (q.new_empty((1, 1, t.shape[-2], t.shape[-1])) for t in (q, k, v))
    return torch.backends.cuda.can_use_efficient_attention(torch.backends.cuda.SDPAParams(q4, k4, v4, None, 0.0, causal, False))


def efficient_lse_rows(rows: int) -> int:
    """Rows of the memory-efficient kernel's log-sum-exp: the query count rounded up to 32 (as is on ROCm)."""
    return rows if torch.version.hip and torch.cuda.is_available() else -(-rows // 32) * 32


def fused_attention(q, k, v, causal: bool, scale: float):
    """torch's fused attention kernel for ``q``'s device on 4-D inputs: ``(out, lse (N, H, L))``, no score matrix held.

    CPU: the flash CPU kernel. CUDA: the memory-efficient kernel with its
    log-sum-exp (its rows past the query count, padding, are cut). Both are
    causal from the top-left corner, as the tiles' parts assume.
    """
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse.narrow(-1, 0, q.shape[-2])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def fused_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """The kernel's backward: ``(dq, dk, dv)`` of one key block, given the queries' *final* ``out`` and ``lse``.

    With the final ``lse`` the kernel's probabilities are the block's share
    of the whole softmax, so a block's gradients add up across blocks. On CUDA
    ``lse`` is padded as the forward kernel returns it (``inf``), and the
    dropout state the kernel's schema takes is a placeholder it does not read
    (no dropout).
    """
    if q.device.type == "cuda":
        rows = lse.shape[-1]
        lse = torch.nn.functional.pad(lse, (0, efficient_lse_rows(rows) - rows), value=float("inf")).contiguous()
        seed, offset = (torch.empty((), dtype=torch.int64, device=q.device) for _ in range(2))
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )[:3]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


# --------------------------------------------------------------------------- #
# torch.compile
# --------------------------------------------------------------------------- #
# Under torch.compile the sharding rules run as ordinary Python while Dynamo
# propagates fake tensors and AOTAutograd traces (fake, functional and proxy
# dispatch modes are active). Rules that precompute small index or weight
# tables with torch ops (halo plans, pooling boxes, interpolation taps) must
# compute them on real tensors and hand them to the traced code as constants.


def traced(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a stand-in that torch.compile traces with (fake or functional), not data."""
    if type(tensor) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        # the eager case, fast: a plain Tensor that no torch.func transform wraps (a vjp inside a traced backward
        # wraps fake tensors) is a stand-in only as a C++ functional wrapper
        return torch._is_functional_tensor(tensor)
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor) or torch._is_functional_tensor(tensor)


def tracing(tensor: torch.Tensor) -> bool:
    """Whether torch.compile is tracing the call that handles ``tensor`` (Dynamo compiling, or a stand-in).

    Eager-only communication (point to point has no graph representation)
    takes its traceable path when this is True.
    """
    return traced(tensor) or torch.compiler.is_compiling()


@contextlib.contextmanager
def real_tensors():
    """Context manager: torch ops in the block make real tensors, even while torch.compile traces.

    For metadata arithmetic done with torch ops (plans, index tables) whose
    results are read back with ``.tolist()`` or cached across calls. The
    block runs as it does eagerly: the tracer's modes are off and so is the
    Python dispatcher, under which composite ops reach a dispatch mode whole
    (``aten.fft_rfft2`` instead of the ``aten._fft_r2c`` it decomposes into).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisablePythonDispatcher():
        yield


def on_real_tensors(fn):
    """Decorator: ``fn`` always computes on real tensors (see :func:`real_tensors`).

    For planners whose torch-op results are cached (``lru_cache``) or read
    back as Python numbers: traced stand-ins would make the reads
    data-dependent, and a cached real table later meets fake tensors.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with real_tensors():
            return fn(*args, **kwargs)

    return wrapper


def graph_constant(table: torch.Tensor, like: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """A small real tensor (an index or weight table) on ``like``'s device, usable where ``like`` is traced.

    Eagerly this is ``table.to(like.device)``. When ``like`` is a tracing
    stand-in, the values are re-created inside the trace (``torch.tensor``),
    so they become a constant of the graph instead of a real tensor that fake
    tensors refuse to mix with. Each such constant enters the graph through
    ``lift_fresh_copy``, which Inductor compiles to a copy run on every call.

    ``shared=True`` (read-only tables: indices no op writes into) lifts each
    table once per traced graph and hands every later use in the same trace
    the same graph tensor: a MeshGraphNet's graph tables are read by every
    layer, forward and backward, and were copied once per read (24 copies a
    step for 4 layers; ``tests/compile/test_one_rank.py``).
    """
    if not traced(like):
        return table.to(like.device)
    memo = key = None
    if shared:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()  # one per traced graph (the joint forward and backward of AOTAutograd)
        if mode is not None:
            memo = _LIFTED.setdefault(mode, {})
            key = (id(table), like.device)
            hit = memo.get(key)
            if hit is not None and hit[0] is table:
                return hit[1]
    # Made outside the tracing modes, then lifted (what ``torch.tensor`` does): inside a subclass's
    # __torch_dispatch__ the Conjugate/Negative keys are excluded and ``torch.tensor`` itself fails under
    # fake tensors (its internal ``resolve_conj`` reaches the fake mode with a real tensor).
    with real_tensors():
        real = table.to(like.device, copy=True)
    lifted = torch.ops.aten.lift_fresh.default(real)
    if memo is not None:
        memo[key] = (table, lifted)  # the table is kept alive with its entry: its id is not reused meanwhile
    return lifted


#: proxy tracing mode (one traced graph) -> {(id(table), device): (table, its graph tensor)}; entries go with the mode
_LIFTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def assert_in_graph(condition: torch.Tensor, message: str) -> None:
    """Check a 0-dim bool tensor inside the traced graph; a False value raises ``RuntimeError(message)`` at run time.

    Rules check data (index ranges) eagerly with Python comparisons; while
    torch.compile traces, those values do not exist yet, and reading them
    fails ("data-dependent expression"). This records the check as a graph op.
    """
    torch._assert_async(condition, message)


#: The builtin behind ``F.pad``. Dynamo inlines the Python ``F.pad`` and records
#: this call instead, so a ``F.pad`` handler must be registered for it too.
pad_builtin = torch._C._nn.pad


def dynamo_frame_hook_active() -> bool:
    """Whether Dynamo may compile the Python frames about to run (it has a frame hook installed).

    True inside a ``torch.compile``d call, also where it runs code eagerly at
    a graph break; False in plain eager code.
    """
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None


def graph_break(reason: str) -> Exception:
    """An exception that makes Dynamo break the graph at the current call and run the call eagerly.

    Raised by eager-only code (ring attention's point-to-point loop) when it
    finds itself running on tracing stand-ins (see :func:`traced`).
    """
    from torch._dynamo.exc import Unsupported

    return Unsupported(reason, gb_type="physicsnemo_dp eager-only op")


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counts so far: ``graph_breaks`` (graph breaks met while tracing) and ``graphs``
    (graphs compiled, recompilations included). Differences between two calls count one region of code."""
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


def aot_cache_bypass(reason: str) -> Exception:
    """The exception that makes AOTAutograd skip its on-disk cache for the graph being compiled."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

    return BypassAOTAutogradCache(reason)


# AOTAutograd drops a collective whose result is unused ("dead"), assuming
# every rank traces the same graph. Ours differ per rank (shard sizes, empty
# shards: a rank may compute nothing from what it receives), so a collective
# dead on one rank only would be dropped there and hang the others. Every
# traced collective result is therefore passed to this effectful no-op, which
# AOTAutograd threads with a token to the graph's outputs and never drops.
@torch.library.custom_op("physicsnemo_dp::keep_collective", mutates_args=())
def _keep_collective(tensor: torch.Tensor) -> None:
    """No-op at run time; in a traced graph it keeps the collective that made ``tensor``."""


@_keep_collective.register_fake
def _(tensor):
    return None


torch.library._register_effectful_op("physicsnemo_dp::keep_collective", torch._library.effects.EffectType.ORDERED)


# AOTAutograd's min-cut partitioner moves backward ops that do not depend on
# the incoming gradients into the forward graph. On a rank whose share of a
# backward collective is empty (made from zeros, not from the gradients) that
# would move the collective to the forward there only, and the ranks would
# pair different collectives. A collective traced in the backward is tagged
# to stay in the backward graph, on every rank.
def _in_its_pass():
    if fx_traceback.current_meta.get("partitioner_tag") != "is_backward":
        return _NO_PIN
    return _pinned_to_backward()


_NO_PIN = contextlib.nullcontext()


@contextlib.contextmanager
def _pinned_to_backward():
    meta = fx_traceback.current_meta
    meta["partitioner_tag"] = "must_be_in_backward"
    try:
        yield
    finally:
        meta["partitioner_tag"] = "is_backward"


def default_store():
    """The key-value store of the default process group (torchrun's TCPStore, a FileStore, ...).

    A training loop's stall watchdog publishes each rank's progress there: it
    is the one store every rank of any launcher already shares.
    """
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def _destroyed_groups(mesh) -> dict:
    """The entries of ``mesh``'s process-group registry whose groups ``destroy_process_group`` destroyed.

    A ``DeviceMesh`` keeps its groups' objects in its root mesh's
    ``_pg_registry`` (for tracing), so a mesh that outlives the groups keeps
    them, and their backend's worker threads, alive.
    """
    import torch.distributed.distributed_c10d as c10d

    registry = getattr(mesh._get_root_mesh(), "_pg_registry", None) or {}
    live = c10d._world.pg_names
    return {name: group for name, group in registry.items() if group not in live}


def holds_destroyed_groups(mesh) -> bool:
    """Whether ``mesh`` was built over process groups that have since been destroyed."""
    return bool(_destroyed_groups(mesh))


def release_destroyed_groups(mesh) -> bool:
    """Drop ``mesh``'s references to destroyed process groups, so they are freed now.

    Why: a group freed during interpreter shutdown joins its gloo worker
    threads while Python is being torn down, which can abort the process
    ("terminate called without an active exception") after a clean run.
    Groups still registered are left alone. Returns whether any was dropped.
    """
    destroyed = _destroyed_groups(mesh)
    for name in destroyed:
        del mesh._get_root_mesh()._pg_registry[name]
    return bool(destroyed)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A default process group of ``world_size`` ranks that moves no data, seen as ``rank``.

    torch's fake process group (``torch.testing._internal.distributed.fake_pg``)
    accepts every collective and returns at once, so one process can run the
    code of one rank of a large job: the rules plan and call collectives as on
    the real machine, with meta tensors standing in for data. Used by the
    simulator and by overhead benchmarks at large ``P``. Any default group
    already initialised is refused, not replaced.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a default process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- #
# debug.explain / debug.simulate
# --------------------------------------------------------------------------- #
def is_wrapper_subclass_type(cls) -> bool:
    """Whether ``cls`` is a wrapper tensor subclass (ShardTensor, DTensor): its ops run on inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

    return is_traceable_wrapper_subclass_type(cls)


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of ``tensor``'s storage, for real and meta tensors alike.

    ``data_ptr()`` is 0 for every meta storage; the address of the C++
    StorageImpl tells meta storages apart and is shared by every view.
    """
    return tensor.untyped_storage()._cdata


def fused_sdp_choice(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool) -> int:
    """The SDPA backend (``torch.nn.attention.SDPBackend`` value) torch picks for these arguments on their device."""
    return torch._fused_sdp_choice(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def subclass_torch_function_disabled() -> bool:
    """Whether this call runs with subclasses' ``__torch_function__`` skipped (inside a library composite)."""
    return torch._C._get_torch_function_state() != torch._C._TorchFunctionState.ENABLED


# --------------------------------------------------------------------------- #
# Hot path of the dispatch hooks
# --------------------------------------------------------------------------- #
def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is active (it must see ShardTensor ops, so fast paths that skip
    the dispatcher step aside)."""
    return torch._C._len_torch_dispatch_stack() > 0


#: The frame-evaluation callback Dynamo installs (None in plain eager code); read on every op, so bound once.
eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


class SubclassFunction(Function):
    """A :class:`Function` whose tensor arguments are always library subclasses (ShardTensors).

    torch's ``apply`` first unwraps functorch wrappers left over from an exited
    transform ("dead wrappers", ~1 us a call on the hot path of every
    contraction). A ShardTensor argument is never such a wrapper (they are
    plain tensors wrapping others), so outside functorch transforms this
    ``apply`` goes straight to autograd's C++ ``apply``.
    """

    @classmethod
    def apply(cls, *args, **kwargs):
        if kwargs or torch._C._are_functorch_transforms_active() or not _binds_to_itself(cls, len(args)):
            return super().apply(*args, **kwargs)
        return super(torch.autograd.Function, cls).apply(*args)


def direct_apply(cls, nargs: int):
    """autograd's C++ ``apply`` of the :class:`SubclassFunction` ``cls``, bound once, for a hot path.

    What :meth:`SubclassFunction.apply` calls when no torch.func transform is active and the call's
    positional arguments bind to ``forward`` as they are; the caller checks the first
    (:func:`functorch_transforms_active`) on every call, and this checks the second for ``nargs``
    arguments once, here (it raises otherwise).
    """
    if not (issubclass(cls, SubclassFunction) and _binds_to_itself(cls, nargs)):
        raise TypeError(f"direct_apply: {cls.__name__}.forward must bind {nargs} positional arguments as they are")
    return super(torch.autograd.Function, cls).apply


#: Whether subclasses' ``__torch_function__`` runs (no DisableTorchFunction[Subclass] around the call), and
#: whether a TorchFunctionMode is active: what decides whether torch's hook would reach ShardTensor's first.
torch_function_enabled = torch._C._is_torch_function_enabled
torch_function_mode_active = torch._C._is_torch_function_mode_enabled


#: ``torch.Tensor._make_wrapper_subclass`` itself (what :func:`make_wrapper_subclass` calls), for the
#: constructor every op result goes through: one Python frame less per op. Called with positional
#: arguments, in the order of :data:`WRAPPER_ARGS` (checked here, at import).
make_wrapper_subclass_raw = torch.Tensor._make_wrapper_subclass
WRAPPER_ARGS = ("size", "strides", "storage_offset", "memory_format", "dtype", "layout", "device", "pin_memory",
                "requires_grad")  # fmt: skip


def _check_wrapper_args() -> None:
    """``_make_wrapper_subclass``'s positional order is :data:`WRAPPER_ARGS` (a torch release may change it)."""

    class _Probe(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # pragma: no cover - never dispatched
            raise NotImplementedError

    probe = make_wrapper_subclass_raw(
        _Probe, (2, 3), (1, 2), None, None, torch.float16, torch.strided, torch.device("meta"), False, True
    )
    with torch_function_disabled():
        got = (probe.shape, probe.stride(), probe.dtype, probe.device.type, probe.requires_grad)
    if got != ((2, 3), (1, 2), torch.float16, "meta", True):
        raise ImportError(f"torch.Tensor._make_wrapper_subclass no longer takes {WRAPPER_ARGS} positionally")


_check_wrapper_args()


def collective_output_kernels() -> dict:
    """``{op: what its device kernel returns}`` for the functional collectives' wrap and wait ops.

    Their device kernels return the collective's output itself (wrapped in an
    ``AsyncCollectiveTensor``, then unwrapped by ``wait_tensor``); their meta
    kernels allocate a copy. ``debug.simulate`` runs these instead, so memory
    on meta tensors is counted as on a device.
    """
    ops = torch.ops._c10d_functional
    return {ops._wrap_tensor_autograd.default: funcol.AsyncCollectiveTensor, ops.wait_tensor.default: lambda t: t}


def l1_loss_weight():
    """The ``weight`` argument of the ``F.l1_loss`` call being handled, which torch does not pass on.

    torch 2.13's ``F.l1_loss(input, target, ..., weight=None)`` lists ``weight``
    among the overloaded arguments of ``handle_torch_function`` but leaves it
    out of the call it forwards, so a ``__torch_function__`` handler never
    sees it (``mse_loss`` and ``huber_loss`` forward theirs). The loss rules
    read it from ``F.l1_loss``'s own frame, a few frames up the stack, so that
    a weighted L1 loss on ShardTensors is weighted as in one process rather
    than silently not. None if no such frame (or no weight) is found.
    """
    import sys

    code = torch.nn.functional.l1_loss.__code__
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("weight")
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------- #
# nn.Module hooks (read by physicsnemo_dp.rowwise: a fused module call must not skip any)
# --------------------------------------------------------------------------- #
from torch.nn.modules import module as _nn_module  # noqa: E402

#: torch's registries of global module hooks (``register_module_forward_hook`` & co.), read on every fused call.
_MODULE_HOOK_DICTS = (
    _nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks, _nn_module._global_backward_hooks,
    _nn_module._global_backward_pre_hooks, _nn_module._global_forward_hooks_with_kwargs,
)


def module_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself has forward / backward hooks (its children not included)."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or module._backward_pre_hooks
    )


def global_module_hooks() -> bool:
    """Whether a global module hook (``register_module_forward_hook`` & co.) is registered."""
    return any(_MODULE_HOOK_DICTS)


#: Whether autocast is on for any device type (a fused module call then takes the general, per-op path).
any_autocast_enabled = torch._C._is_any_autocast_enabled


#: Whether a torch.func transform (vmap, grad, jvp) is active around this call (one C call: hot paths read it).
functorch_transforms_active = torch._C._are_functorch_transforms_active


def plain_eager() -> bool:
    """Whether this call runs as plain eager code: not traced by torch.compile (no Dynamo frame hook),
    no dispatch mode and no torch.func transform active.

    Where a fast path may run local kernels inside its own autograd node, skipping the dispatcher:
    everything that must see each ShardTensor op (a tracer, ``debug.explain``'s mode, a transform)
    then gets the general path.
    """
    return not (
        torch.compiler.is_compiling()
        or eval_frame_callback() is not None
        or dispatch_mode_active()
        or functorch_transforms_active()
    )
