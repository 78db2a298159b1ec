"""``ShardTensor``: a distributed tensor whose shards may have any sizes.

The class is deliberately thin. It holds a local tensor and a
:class:`~physicsnemo_dp.spec.ShardTensorSpec`, converts to and from plain
tensors and DTensors, and hands every op to the dispatch layers in
:mod:`physicsnemo_dp.dispatch`. Layout arithmetic lives in ``_layout``,
communication in ``collectives``, redistribution in ``_plan`` /
``_redistribute`` and differentiable conversions in ``_conversion``.

Autograd tracks the wrapper (whose shape is the *global* shape); the local
tensor never requires grad, so gradients of ShardTensors are ShardTensors.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from . import _agreement, _gathers, _layout, _stall, promotion
from ._conversion import Contiguous, FromLocal, Redistribute, ToLocal
from ._redistribute import grad_layout, redistribute_local, target_layout
from ._torch_compat import (
    TensorBase,
    aot_cache_bypass,
    current_mesh,
    eval_frame_callback,
    make_wrapper_subclass,
    make_wrapper_subclass_raw,
    torch_function_disabled,
    traced,
)
from ._checking import checks_enabled
from .dispatch import registry
from .dispatch.torch_dispatch import handle_torch_dispatch
from .dispatch.torch_function import (
    _PATCHES,
    handle_torch_function,
    operator_call,
    patches_enabled,
    set_patches_enabled,
)
from .errors import PlacementError
from .rule_kit import _register_shard_tensor_cls, plain_gradient, restore_storage_tags, storage_tags
from .spec import ShardTensorSpec

__all__ = ["ShardTensor"]



#: torch.compile treats ShardTensor as opaque: its graphs record torch calls on
#: ShardTensors and the handlers run as plain Python while they are traced.
#: Dynamo must not compile the handlers' own frames either when a call runs
#: eagerly inside a compiled function (at a graph break, e.g. ring attention).
_handle_torch_function = torch.compiler.disable(handle_torch_function)
_REQUIRES_GRAD = TensorBase.requires_grad.__get__
_TENSOR_MATMUL = torch.Tensor.__matmul__
_is_compiling = torch.compiler.is_compiling
_STRIDED = torch.strided


_DETACH = torch.ops.aten.detach.default
_ADD = torch.ops.aten.add.Tensor


class ShardTensor(torch.Tensor):
    """A tensor split over a device mesh with per-rank shard sizes of your choosing.

    Construct with :meth:`from_local`, :meth:`from_dtensor` or
    :func:`physicsnemo_dp.scatter_tensor`; never call the constructor with
    arbitrary specs. ``shape`` is the global shape; :meth:`to_local` gives this
    rank's piece.
    """

    _local_tensor: torch.Tensor
    _spec: ShardTensorSpec
    __slots__ = ["_local_tensor", "_spec"]

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: ShardTensorSpec, *, requires_grad: bool):
        if local_tensor.requires_grad and not requires_grad:
            local_tensor = local_tensor.detach()
        if local_tensor.is_conj() or local_tensor.is_neg():
            # Rules run local kernels inside __torch_dispatch__, where torch excludes the Conjugate and
            # Negative keys: most kernels would read a lazily conjugated/negated tensor's memory as is.
            local_tensor = local_tensor.resolve_conj().resolve_neg()
        out = make_wrapper_subclass(
            cls,
            spec.global_shape,
            stride=spec.tensor_meta.stride,
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            requires_grad=requires_grad,
        )
        out._local_tensor = local_tensor
        out._spec = spec
        if not patches_enabled():
            set_patches_enabled(True)
        return out

    @classmethod
    def _of_local(cls, local_tensor: torch.Tensor, spec: ShardTensorSpec, requires_grad: bool = False) -> "ShardTensor":
        """``ShardTensor(local_tensor, spec, requires_grad=requires_grad)`` with fewer frames (every op result is
        one; with ``requires_grad``, every output of a compiled region)."""
        if not requires_grad and local_tensor.requires_grad:
            local_tensor = local_tensor.detach()
        if local_tensor.is_conj() or local_tensor.is_neg():
            local_tensor = local_tensor.resolve_conj().resolve_neg()
        # positional arguments (WRAPPER_ARGS): torch's argument parser takes ~0.3 us less than with keywords
        out = make_wrapper_subclass_raw(
            cls, spec.global_shape, spec.tensor_meta.stride, None, None, local_tensor.dtype, _STRIDED,
            local_tensor.device, False, requires_grad
        )  # fmt: skip
        out._local_tensor = local_tensor
        out._spec = spec
        if not _PATCHES["enabled"]:  # patches_enabled(), inlined: every op result comes here
            set_patches_enabled(True)
        return out

    # ------------------------------------------------------------ protocol
    def __repr__(self) -> str:
        grad = f", grad_fn={self.grad_fn.name()}" if self.grad_fn is not None else ""
        grad += ", requires_grad=True" if self.requires_grad and not grad else ""
        return f"ShardTensor(local={self._local_tensor}, spec={self._spec}{grad})"

    # The context also carries the tags kept on the local tensor's storage (rule_kit.carry_storage_tag: a
    # graph's index buffer), which tracing's fake and functional stand-ins would otherwise lose.
    # Called for every ShardTensor entering or leaving a compiled region and by each of its guards: the
    # C getter under disabled torch-function, without the ``requires_grad`` property's frame.
    def __tensor_flatten__(self):
        with torch_function_disabled():
            requires_grad = _REQUIRES_GRAD(self)
        return ["_local_tensor"], (self._spec, requires_grad, storage_tags(self._local_tensor))

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        spec, requires_grad, tags = meta
        local = inner_tensors["_local_tensor"]
        if tags:
            restore_storage_tags(local, tags)
        # what a compiled region's runtime wrapper rebuilds for every output: 2 us, not 7 (ShardTensor(...))
        return ShardTensor._of_local(local, spec, requires_grad)

    # torch.compile traces the backward ahead of time and must guess each
    # tangent's layout. The guess is the gradient layout (Partial read as
    # Replicate: a pending sum cannot be the layout of a gradient); a runtime
    # gradient in another layout is redistributed to the guess.
    def __coerce_tangent_metadata__(self) -> "ShardTensor":
        target = grad_layout(self._spec)
        return self if target == self._spec else _relayout(self, target)

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        if expected_type is not None and expected_type is not type(self):
            return None
        spec = flatten_spec[0]
        return self if spec == self._spec else _relayout(self, spec)

    def _stable_hash_for_caching(self) -> str:
        """Refuse torch.compile's on-disk AOTAutograd cache for graphs with ShardTensor inputs.

        That cache is keyed by the Dynamo graph (``conv2d(x, w)``) and its
        inputs' metadata, but what AOTAutograd traces from it is decided by
        the sharding rules: by this rank's place in the mesh (ranks with the
        same layout and local shape compile different graphs) and by the
        rules' code and registered handlers, none of which a key can see. A hit
        could replay another rank's or an older library's graph. Inductor's
        own cache, keyed by the traced graph itself, still applies.
        """
        raise aot_cache_bypass("ShardTensor graphs depend on the rank and on the sharding rules")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if eval_frame_callback() is not None:  # dynamo_frame_hook_active(), inlined: this runs on every op
            return _handle_torch_function(func, types, args, kwargs)
        return handle_torch_function(func, types, args, kwargs)  # the wrapper costs ~1.4 us a call

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _DETACH and not registry.dispatch_handlers_registered():
            # Autograd saves every ShardTensor output of a Function through a detached copy (C++, on each
            # call): the table's rule for detach (the local tensor detached, same spec) without its lookups.
            x = args[0]
            return ShardTensor._of_local(x._local_tensor.detach(), x._spec)
        if func is _ADD and not kwargs and not registry.dispatch_handlers_registered():
            # Two ShardTensors of one spec without pending sums (a residual add in forward, autograd's sum of a
            # tensor's gradients in backward: most of a step's adds): the pointwise rule's answer, the local
            # sum in that spec, without the way through the table and the rule (~1.5 us a call)
            a, b = args
            if type(a) is cls and type(b) is cls:
                spec = a._spec
                if b._spec is spec and not spec.has_partial:
                    return cls._of_local(_ADD(a._local_tensor, b._local_tensor), spec)
        return handle_torch_dispatch(func, types, args, kwargs)

    def __matmul__(self, other):
        """``self @ other``: a plain weight reaches the contraction's fast path without torch's hook entry.

        The same call as torch's ``Tensor.__matmul__`` (:func:`~physicsnemo_dp.dispatch.torch_function.operator_call`);
        torch.compile traces ``Tensor.__matmul__`` itself.
        """
        if _is_compiling():  # (first: Dynamo folds it, so it never traces the eager checks behind it)
            return _TENSOR_MATMUL(self, other)
        return operator_call(_TENSOR_MATMUL, _TYPES, (self, other))

    # ------------------------------------------------------- construction
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        sharding_shapes="infer",
        global_shape: Sequence[int] | None = None,
    ) -> "ShardTensor":
        """Wrap each rank's local piece into one ShardTensor (differentiable).

        ``sharding_shapes`` says how every rank learns the other shards' sizes:

        * ``"infer"`` (default): one small all-gather of every rank's local
          shape, dtype, placements and ``global_shape``. Any disagreement, or
          an invalid argument on some ranks only, raises the same
          ``PlacementError`` on every rank.
        * ``"chunk"``: sizes follow the split rule of ``global_shape`` (required);
          no communication, so nothing compares the ranks' arguments: a rank
          whose local shape disagrees raises alone, the others go on.
        * a dict ``{mesh_dim: [local shape of each rank along that mesh dim]}``,
          identical on every rank; no communication (same caveat).

        Under :func:`physicsnemo_dp.debug.checks` (or ``PDP_CHECKS=1``) the
        last two also make one small all-gather that verifies every rank built
        the same layout and holds its own box, and raise the same error on
        every rank. ``global_shape``, when given with ``"infer"`` or a dict, is
        checked.
        """
        return _from_local(local_tensor, device_mesh, placements, sharding_shapes, global_shape)

    @classmethod
    def from_dtensor(cls, dtensor) -> "ShardTensor":
        """The same data as a ShardTensor (differentiable, no communication)."""
        spec = ShardTensorSpec.chunked(
            dtensor.device_mesh, dtensor.placements, tuple(dtensor.shape), dtensor.dtype
        )
        local = dtensor.to_local()
        if checks_enabled():  # a DTensor built with from_local(shape=) may hold other sizes
            _agreement.verify("from_dtensor", dtensor.device_mesh, local, spec, None)
        return FromLocal.apply(local, spec)

    @staticmethod
    def from_spec(local_tensor: torch.Tensor, spec: ShardTensorSpec) -> "ShardTensor":
        """Wrap this rank's piece in a layout every rank already knows (differentiable, no communication).

        For code that builds many tensors of one layout, e.g. a datapipe's
        batches: ``spec`` comes from an earlier tensor (``x.spec``) or from
        ``ShardTensorSpec.from_sizes``. The local tensor must have this rank's
        box of ``spec`` and its dtype; otherwise ``PlacementError``. Under the
        checking mode the ranks also verify collectively that they passed the
        same layout.
        """
        if not isinstance(spec, ShardTensorSpec):
            raise TypeError(f"spec must be a ShardTensorSpec, got {type(spec).__name__}")
        _, error = _agreement.with_checked_arguments(lambda: _check_boxed(local_tensor, spec))
        if checks_enabled():
            _agreement.verify("from_spec", spec.mesh, local_tensor, spec, error)
        elif error is not None:
            raise _stall.raised_alone(error)
        if not local_tensor.requires_grad:  # nothing to record: skip the autograd Function (~8 us)
            return ShardTensor(local_tensor, spec, requires_grad=False)
        return FromLocal.apply(local_tensor, spec)

    # --------------------------------------------------------- conversion
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's local tensor (differentiable). Partial data stays unreduced.

        ``grad_placements`` declares the layout of the gradient that will
        flow back into the returned tensor (default: this tensor's layout with
        Partial read as Replicate). ``Partial`` there means each rank's local
        gradient is an additive contribution.
        """
        if grad_placements is None:
            grad_spec = grad_layout(self._spec)
        else:
            grad_spec = self._spec.with_layout(
                _layout.normalize_placements(grad_placements, self._spec.mesh.ndim, self.ndim),
                self._spec.dim_sizes,
            )
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local_tensor
        return ToLocal.apply(self, grad_spec)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole tensor on every rank (all pending reductions done), contiguous as DTensor's.

        The gathers write their result contiguously, so this copies only a
        local tensor that needed no communication (already replicated) and
        is not contiguous.
        """
        placements = (Replicate(),) * self._spec.mesh.ndim
        if _gathers.called_by_user():  # the user asked for the whole tensor: not an implicit gather
            with _gathers.explicit():
                replicated = self.redistribute(placements=placements)
        else:
            replicated = self.redistribute(placements=placements)
        return replicated.to_local(grad_placements=grad_placements).contiguous()

    def is_contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
        """Whether this rank's *local* tensor is contiguous in ``memory_format``.

        The wrapper's strides describe the global tensor, which never exists
        in memory; code that asks (to decide whether ``.view`` works, or a
        kernel may read rows as consecutive memory) needs the local answer.
        Ranks may answer differently.
        """
        return self._local_tensor.is_contiguous(memory_format=memory_format)

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> "ShardTensor":
        """Same layout with a local tensor contiguous in ``memory_format`` (differentiable; ``self`` if it already is)."""
        local = self._local_tensor
        if local.is_contiguous(memory_format=memory_format):
            return self
        if torch.is_grad_enabled():
            with torch_function_disabled():
                recorded = _REQUIRES_GRAD(self)
            if recorded:
                return Contiguous.apply(self, memory_format)
        # nothing to record (AOTAutograd's tangents in backward, no_grad code): Contiguous's forward, no Function
        return ShardTensor._of_local(local.contiguous(memory_format=memory_format), self._spec)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> "ShardTensor":
        """The same data in another layout (differentiable).

        Dims whose sharding is unchanged keep their shard sizes; newly sharded
        dims split with the one split rule. Communication is the minimum the
        transition needs (see ``physicsnemo_dp._plan``). ``async_op`` is
        accepted for DTensor compatibility; collectives complete before return.
        """
        if device_mesh is not None and device_mesh != self._spec.mesh:
            raise PlacementError(
                "redistribute cannot move a ShardTensor to a different device mesh; "
                "gather it (full_tensor) and scatter it on the new mesh instead"
            )
        if placements is None:
            raise PlacementError("redistribute needs placements=")
        layout, error = _agreement.with_checked_arguments(lambda: target_layout(self._spec, placements))
        if error is not None:  # the same on every rank when every rank passed the same placements
            raise _stall.raised_alone(error)
        dst = self._spec.with_layout(layout.placements, layout.dim_sizes)
        if dst == self._spec:
            return self
        with _stall.activity(_Move(self._spec, dst)):
            if _gathers.called_by_user():  # a layout the user asked for: not an implicit gather
                with _gathers.explicit():
                    return Redistribute.apply(self, dst)
            return Redistribute.apply(self, dst)

    # ---------------------------------------------------------- metadata
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def spec(self) -> ShardTensorSpec:
        """The layout: mesh, placements, global shape, dtype and every shard's size (immutable)."""
        return self._spec

    def offsets(self, mesh_dim: int | None = None):
        """Where this rank's shard starts along each sharded dim (see ``ShardTensorSpec.offsets``)."""
        return self._spec.offsets(mesh_dim)

    # Reading these through Tensor's C getters under disabled torch-function
    # keeps them from re-entering __torch_function__ (which torch.compile's
    # fake-tensor conversion and autograd-graph walkers trip over).
    @property
    def grad_fn(self):
        with torch_function_disabled():
            return TensorBase.grad_fn.__get__(self)

    @property
    def is_leaf(self) -> bool:
        with torch_function_disabled():
            return TensorBase.is_leaf.__get__(self)

    @property
    def requires_grad(self) -> bool:
        with torch_function_disabled():
            return TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        with torch_function_disabled():
            TensorBase.requires_grad.__set__(self, value)

    def requires_grad_(self, requires_grad: bool = True) -> "ShardTensor":
        """Set ``requires_grad`` on the wrapper (the local tensor never tracks grads)."""
        self.requires_grad = requires_grad
        return self

    @property
    def grad_dtype(self):
        return self._local_tensor.dtype

    @property
    def grad(self):
        """The accumulated gradient as a ShardTensor in this tensor's layout, or None.

        Backward rules may produce an equivalent gradient in another layout
        (other shard sizes, another sharded dim); it is redistributed to this
        tensor's layout on first read and stored so. A pending sum (Partial)
        over a mesh dim where this tensor is replicated is kept: it is a valid
        and cheaper form of the same gradient. A plain tensor of the global
        shape (one that a backward formula built with a factory, or assigned by
        hand) is read as the full gradient: this rank's box of it
        (``rule_kit.plain_gradient``); one of another shape as this rank's local
        gradient in this tensor's layout.
        """
        with torch_function_disabled():
            g = TensorBase.grad.__get__(self)
        if g is None:
            return None
        if not isinstance(g, ShardTensor):  # a plain gradient: of the global shape from a backward factory, or by hand
            g = plain_gradient(g, self._spec)
            with torch_function_disabled():
                TensorBase.grad.__set__(self, g)
            return g
        target = grad_layout(self._spec)
        # A pending sum where this tensor is replicated is a valid, cheaper form of
        # the same gradient (e.g. declared with to_local(grad_placements=[Partial()])).
        kept = tuple(
            gp if issubclass(type(mine), Replicate) and issubclass(type(gp), Partial) else tp
            for mine, gp, tp in zip(self._spec.placements, g._spec.placements, target.placements)
        )
        target = target.with_layout(kept, target.dim_sizes)
        if g._spec != target:  # backward rules may leave another (equivalent) layout
            with _gathers.explicit():  # the gradient in its tensor's own layout
                g = Redistribute.apply(g.detach(), target)
            with torch_function_disabled():
                TensorBase.grad.__set__(self, g)
        return g

    @grad.setter
    def grad(self, value) -> None:
        with torch_function_disabled():
            TensorBase.grad.__set__(self, value)

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Backpropagate from this tensor, reducing pending Partial data first."""
        start = self
        if any(issubclass(type(p), Partial) for p in self._spec.placements):
            resolved = tuple(Replicate() if issubclass(type(p), Partial) else p for p in self._spec.placements)
            start = self.redistribute(placements=resolved)
        torch.autograd.backward(
            start, gradient, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs
        )

    # ------------------------------------------------------- configuration
    get_promotion_mode = staticmethod(promotion.get_promotion_mode)
    set_promotion_mode = staticmethod(promotion.set_promotion_mode)
    promotion_mode = staticmethod(promotion.promotion_mode)
    patches_enabled = staticmethod(patches_enabled)

    @staticmethod
    def register_dispatch_handler(op, handler) -> None:
        """Use ``handler(func, types, args, kwargs)`` for ATen op ``op`` (below autograd)."""
        registry.dispatch_handlers.register(op, handler)

    @staticmethod
    def register_function_handler(func, handler) -> None:
        """Use ``handler(func, types, args, kwargs)`` for Python function ``func`` (above autograd).

        Plain non-scalar tensor arguments are promoted before the handler runs.
        """
        registry.function_handlers.register(func, handler)

    @staticmethod
    def register_named_function_handler(func_name: str, handler) -> None:
        """Use ``handler`` for the custom op named ``func_name`` (e.g. ``"mylib.op.default"``)."""
        registry.named_function_handlers.register(func_name, handler)


_register_shard_tensor_cls(ShardTensor)


# --------------------------------------------------------------------------- #
# from_local
# --------------------------------------------------------------------------- #
# Opaque to Dynamo: it records one call in the graph instead of tracing the
# layout arithmetic and the construction of the subclass (AOTAutograd still
# traces through it). Only the communication-free modes work under tracing.
@torch.compiler.allow_in_graph
def _from_local(local_tensor, device_mesh, placements, sharding_shapes, global_shape) -> ShardTensor:
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if mesh is None:
        raise PlacementError("from_local needs device_mesh= (or an active `with mesh:` block)")
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    if isinstance(sharding_shapes, str) and sharding_shapes == "infer":
        if isinstance(local_tensor, torch.Tensor) and traced(local_tensor):
            raise PlacementError(
                'from_local(sharding_shapes="infer") reads the other ranks\' shapes at run time, which '
                'torch.compile cannot trace; inside a compiled region pass sharding_shapes="chunk" '
                "(with global_shape=) or a dict of the shards' shapes"
            )
        return FromLocal.apply(local_tensor, _inferred_spec(local_tensor, mesh, placements, global_shape))
    spec, error = _agreement.with_checked_arguments(
        lambda: _declared_spec(local_tensor, mesh, placements, sharding_shapes, global_shape)
    )
    if checks_enabled():  # opt-in: these modes exist to avoid communication
        mode = "from_local(sharding_shapes={...})" if isinstance(sharding_shapes, dict) else 'from_local(sharding_shapes="chunk")'
        _agreement.verify(mode, mesh, local_tensor, spec, error)
    elif error is not None:
        raise _stall.raised_alone(error)
    return FromLocal.apply(local_tensor, spec)


class _Move(NamedTuple):
    """A redistribution as a stall report names it (formatted only if a collective stalls)."""

    src: ShardTensorSpec
    dst: ShardTensorSpec

    def __str__(self) -> str:
        shape = tuple(self.src.global_shape)
        return f"redistribute of a {shape} tensor from {tuple(self.src.placements)} to {tuple(self.dst.placements)}"


# --------------------------------------------------------------------------- #
# from_local helpers
# --------------------------------------------------------------------------- #
def _check_local(local, mesh: DeviceMesh, allow_meta: bool = False) -> None:
    if not isinstance(local, torch.Tensor) or isinstance(local, ShardTensor):
        raise TypeError(f"local_tensor must be a plain torch.Tensor, got {type(local).__name__}")
    if local.ndim > _agreement.MAX_NDIM:
        raise PlacementError(f"tensors with more than {_agreement.MAX_NDIM} dims are not supported")
    if local.device.type != mesh.device_type and not (allow_meta and local.device.type == "meta"):
        raise PlacementError(
            f"local_tensor is on {local.device} but the device mesh is of type "
            f"{mesh.device_type!r}; move the tensor to the mesh's device first"
        )


def _check_boxed(local, spec: ShardTensorSpec) -> None:
    """``local`` is a plain tensor of this rank's box of ``spec``, with its dtype and device type.

    A meta ``local`` is accepted on any mesh: a known spec needs no data or
    communication to build the tensor, which is how
    :func:`physicsnemo_dp.debug.simulate` plays one rank of a large job on a
    CPU mesh (shapes only). ``from_local`` keeps refusing them: its default
    infers the sizes by exchanging the local tensors.
    """
    _check_local(local, spec.mesh, allow_meta=True)
    if tuple(local.shape) != tuple(spec.local_shape) or local.dtype != spec.tensor_meta.dtype:
        raise PlacementError(
            f"rank {torch.distributed.get_rank()}: local_tensor is {local.dtype} of shape {tuple(local.shape)} "
            f"but the spec gives this rank {spec.tensor_meta.dtype} of shape {tuple(spec.local_shape)}"
        )


def _inferred_spec(local, mesh: DeviceMesh, placements, global_shape) -> ShardTensorSpec:
    """The spec of ``sharding_shapes="infer"``: one all-gather of every rank's arguments, then validation.

    Each rank's row carries its local shape and everything else that must
    agree (ndim, dtype, placements as passed, ``global_shape=``, whether its
    own arguments were valid). Nothing is raised before the exchange; after it
    every rank validates the same table, so a mistake made on one rank (other
    placements, a shard dim out of range there) raises the same error on all.
    """
    _, error = _agreement.with_checked_arguments(lambda: _check_local(local, mesh))
    row = _agreement.row(
        'from_local(sharding_shapes="infer")', error, mesh, local=local, placements=placements, global_shape=global_shape
    )
    table = _agreement.exchange(row, error, mesh, "from_local")
    _agreement.same_tensor_kind(table)
    placements = _agreement.same_placements(table, mesh.ndim, local.ndim)
    dim_sizes = _layout.dim_sizes_from_local_shapes([f.shape for f in table], tuple(mesh.shape), placements)
    derived = _layout.global_shape_of(local.shape, placements, dim_sizes)
    _agreement.global_shape_matches(table, derived, "from_local", f"the shards, which make {derived}")
    return ShardTensorSpec.from_sizes(mesh, placements, derived, local.dtype, dim_sizes)


def _declared_spec(local, mesh: DeviceMesh, placements, sharding_shapes, global_shape) -> ShardTensorSpec:
    """The spec of ``sharding_shapes="chunk"`` or a dict, from this rank's arguments alone (no communication)."""
    _check_local(local, mesh)
    placements = _layout.normalize_placements(placements, mesh.ndim, local.ndim)
    if isinstance(sharding_shapes, str) and sharding_shapes == "chunk":
        if global_shape is None:
            raise PlacementError('sharding_shapes="chunk" needs global_shape=')
        dim_sizes = _layout.chunk_dim_sizes(tuple(global_shape), tuple(mesh.shape), placements)
    elif isinstance(sharding_shapes, dict):
        dim_sizes = _dim_sizes_from_dict(sharding_shapes, local, mesh, placements)
    else:
        raise PlacementError(f'sharding_shapes must be "infer", "chunk" or a dict, got {sharding_shapes!r}')
    derived = _layout.global_shape_of(local.shape, placements, dim_sizes)
    if global_shape is not None and tuple(global_shape) != derived:
        raise PlacementError(
            f"global_shape={tuple(global_shape)} does not match the shards, which make {derived}"
        )
    spec = ShardTensorSpec.from_sizes(mesh, placements, derived, local.dtype, dim_sizes)
    if tuple(local.shape) != tuple(spec.local_shape):
        raise PlacementError(
            f"rank {torch.distributed.get_rank()}: local tensor has shape "
            f"{tuple(local.shape)} but the layout gives it {tuple(spec.local_shape)}"
        )
    return spec


def _dim_sizes_from_dict(shapes_by_mesh_dim: dict, local, mesh, placements) -> tuple:
    tables: list = [None] * local.ndim
    for d in range(local.ndim):
        mesh_dims = _layout.sharding_mesh_dims(placements, d)
        if len(mesh_dims) > 1:
            raise PlacementError(
                f"dim {d} is sharded over several mesh dims {mesh_dims}; a sharding_shapes "
                'dict cannot describe that, use sharding_shapes="infer"'
            )
        if not mesh_dims:
            continue
        m = mesh_dims[0]
        if m not in shapes_by_mesh_dim:
            raise PlacementError(f"sharding_shapes has no entry for mesh dim {m}, which shards dim {d}")
        shapes = [tuple(s) for s in shapes_by_mesh_dim[m]]
        if len(shapes) != mesh.size(m):
            raise PlacementError(
                f"sharding_shapes[{m}] lists {len(shapes)} shapes but mesh dim {m} has {mesh.size(m)} ranks"
            )
        for s in shapes:
            if len(s) != local.ndim or any(s[k] != local.shape[k] for k in range(local.ndim) if k != d):
                raise PlacementError(
                    f"sharding_shapes[{m}] entry {s} is inconsistent with the local shape "
                    f"{tuple(local.shape)}: shards may differ only along dim {d}"
                )
        tables[d] = tuple(s[d] for s in shapes)
    return tuple(tables)


_TYPES = (ShardTensor,)  # the ``types`` a fast path offered a call by ShardTensor.__matmul__ sees


def _relayout(x: ShardTensor, spec: ShardTensorSpec) -> ShardTensor:
    """``x`` in layout ``spec``: differentiable when ``x`` requires grad, a plain move otherwise.

    Used for torch.compile's tangents, which take their gradient layout: never an implicit gather.
    """
    with _gathers.explicit():
        if x.requires_grad:
            return Redistribute.apply(x, spec)
        return ShardTensor(redistribute_local(x._local_tensor, x._spec, spec), spec, requires_grad=False)
