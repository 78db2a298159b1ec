"""A planned contraction on the local tensors: the native kernel where the labels allow one.

Once every operand is in its planned layout the local pieces are contracted
like plain tensors. ``torch.einsum`` could do all of them, but it costs more
than the kernel the plain op would run: its Python wrapper and its own
permute/reshape bookkeeping on every call, a bias added in a second pass
instead of ``addmm``'s fused one, and reductions over permuted (strided)
views. So :func:`local_program` picks, once per equation and global shapes
(memoised: it is pure metadata), the kernel of the plain op:

* two operands whose dims are each batch (in both and in the output), free
  (in one and in the output) or contracted (in both, not in the output) make
  a matrix product: grouping each operand's dims is a permute and a reshape
  (views in the usual cases: a linear layer's leading dims, a weight's rows),
  then one ``mm``/``addmm`` or ``bmm``/``baddbmm``. That covers ``linear``,
  ``mm``, ``bmm``, ``matmul`` and their gradients (``grad_out @ W`` and
  ``grad_out^T @ x`` over the flattened leading dims). Operands that already
  are ``mm``'s, or ``linear``'s (any leading dims, the weight ``(m, k)``), go
  to that plain call as they are: one Python call, the plain op's bits;
* one operand is a ``sum`` over its summed dims (a bias gradient), then a
  permute;
* anything else (three operands, a dim summed within one operand) stays an
  einsum.

Broadcast dims (extent 1 where the label is larger elsewhere) are squeezed
first, as einsum would broadcast them; output dims no kernel can produce
(summed dims kept with extent 1, labels no operand has) are inserted after.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Callable

import torch
import torch.nn.functional as F

from .labels import is_broadcast, label_extents, summed_labels

#: torch.einsum's equation letters: at most 52 distinct dims.
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class _Product:
    """``a @ b`` after grouping: ``a`` as (batch, left, contracted), ``b`` as (batch, contracted, right).

    ``order`` says which operand is ``a`` (the one whose free dims come first
    in the output, so that the result needs no permute in the usual cases).
    """

    order: tuple  # operand indices (a, b)
    perms: tuple  # per a, b: its dims in group order (None: already in it)
    n_batch: int
    n_left: int
    n_right: int
    out_perm: tuple | None  # from (batch, left, right) to the output order; None: already in it
    #: "mm": (n, k) @ (k, m) as they are; "linear": ``F.linear(a, b)``, ``a`` (..., k) and ``b`` (m, k) as they
    #: are (a layer's leading dims folded and the weight transposed inside ATen: 0.4 us less than the permute
    #: here on 2-D inputs, 1.5 us on 3-D ones); "" for the general grouping. Only for unscaled products.
    form: str = ""

    def __call__(self, tensors, bias=None, alpha=1, beta=1):
        """The product (``beta * bias + alpha * product`` in one kernel when a bias is given)."""
        form = self.form
        if form and alpha == 1 and beta == 1:
            if form == "linear":
                return F.linear(tensors[0], tensors[1], bias)
            return torch.mm(tensors[0], tensors[1]) if bias is None else torch.addmm(bias, tensors[0], tensors[1])
        (i, j), (p, q) = self.order, self.perms
        a = tensors[i] if p is None else tensors[i].permute(p)
        b = tensors[j] if q is None else tensors[j].permute(q)
        nb, nl = self.n_batch, self.n_left
        grouped = self._grouped(a.ndim, b.ndim)
        if not grouped:  # already (left, inner) @ (inner, right), or batched alike: no reshape
            batch, left, right = a.shape[:nb], a.shape[nb : nb + nl], b.shape[b.ndim - self.n_right :]
            inner = prod(a.shape[nb + nl :])
            lead = (prod(batch),) if nb else ()
            a = a.reshape(*lead, prod(left), inner)
            b = b.reshape(*lead, inner, prod(right))
        if bias is None:
            result = torch.bmm(a, b) if nb else torch.mm(a, b)
        else:
            result = (torch.baddbmm if nb else torch.addmm)(bias, a, b, beta=beta, alpha=alpha)
        if not grouped:
            result = result.reshape((*batch, *left, *right))
        return result if self.out_perm is None else result.permute(self.out_perm)

    def _grouped(self, a_ndim: int, b_ndim: int) -> bool:
        """Whether both operands already have the kernel's dims (each group one dim: mm or bmm as they are)."""
        nb = self.n_batch
        return nb <= 1 and self.n_left == 1 and self.n_right == 1 and a_ndim == nb + 2 and b_ndim == nb + 2

    def fuses(self, bias_ndim: int) -> bool:
        """Whether a bias of that many dims broadcasts against the kernel's result as against the output.

        The kernel's result is (batch, left, right) with each group flattened:
        the same shape as the output when every group is at most one dim (and
        the output is not permuted), and the same trailing dim when only the
        right group is (``linear``'s leading dims flattened, a 1-D bias).
        """
        if self.out_perm is not None or self.n_right != 1:
            return False
        return (self.n_batch <= 1 and self.n_left == 1) or (self.n_batch == 0 and bias_ndim <= 1)


@dataclass(frozen=True)
class _Sum:
    """One operand: a sum over its summed dims, then the output order."""

    dims: tuple
    out_perm: tuple | None

    def __call__(self, tensors):
        (t,) = tensors
        if self.dims:
            t = t.sum(self.dims)
        return t if self.out_perm is None else t.permute(self.out_perm)


@dataclass(frozen=True)
class _Einsum:
    """The general case: ``torch.einsum`` with a precomputed equation string."""

    equation: str

    def __call__(self, tensors):
        return torch.einsum(self.equation, *tensors)


@dataclass(frozen=True)
class LocalProgram:
    """How the local pieces of one contraction are computed (see the module docstring)."""

    squeeze: tuple  # per operand: its broadcast dims
    kernel: Callable
    fuses_bias: bool  # whether the kernel adds the bias itself (addmm, baddbmm)
    missing: tuple  # output dims inserted after the kernel
    expand: bool  # whether an inserted dim has a label no operand has (expanded to the local shape)
    squeezes: bool  # any(squeeze), read on every call

    def run(self, locals_, out_spec, bias=None, alpha=1, beta=1):
        """``alpha * contraction + beta * bias`` on local tensors; ``out_spec`` gives expanded dims' extents."""
        tensors = [t.squeeze(d) if d else t for t, d in zip(locals_, self.squeeze)] if self.squeezes else locals_
        if bias is not None and self.fuses_bias and _same_float_dtype(bias, *tensors):
            return self.kernel(tensors, bias, alpha, beta)
        result = self.kernel(tensors)
        for d in self.missing:
            result = result.unsqueeze(d)
        if self.expand:
            result = result.expand(tuple(out_spec.local_shape)).contiguous()
        if alpha != 1:
            result = result * alpha
        if bias is not None:
            result = result + beta * bias
        return result


def direct_kernel(program: LocalProgram):
    """``torch.mm`` or ``F.linear`` where :meth:`LocalProgram.run` of two operands without a bias, ``alpha == 1``,
    is that one call on the local tensors as they are (see ``_Product.form``); else None."""
    kernel = program.kernel
    if program.squeezes or program.missing or program.expand or not isinstance(kernel, _Product) or not kernel.form:
        return None
    return F.linear if kernel.form == "linear" else torch.mm


def _same_float_dtype(*tensors) -> bool:
    """``addmm`` needs one dtype, and a float one to take float ``alpha``/``beta``."""
    dtype = tensors[0].dtype
    return dtype.is_floating_point and all(t.dtype == dtype for t in tensors)


@lru_cache(maxsize=1024)
def local_program(eq, shapes, out_shape, bias_ndim=None) -> LocalProgram:
    """The :class:`LocalProgram` of ``eq`` on operands of global ``shapes`` (memoised).

    ``bias_ndim`` is the ndim of the bias added to the result, if any: the
    matrix-product kernels add it themselves when it broadcasts alike.
    """
    ext = label_extents(shapes, eq.operands, eq.out, out_shape)
    summed = summed_labels(eq.operands, eq.out, out_shape, ext)
    kept = [
        tuple(lab for n, lab in zip(shape, labs) if not is_broadcast(n, lab, ext))
        for shape, labs in zip(shapes, eq.operands)
    ]
    squeeze = tuple(
        tuple(d for d, (n, lab) in enumerate(zip(shape, labs)) if is_broadcast(n, lab, ext))
        for shape, labs in zip(shapes, eq.operands)
    )
    present = {lab for labs in kept for lab in labs}
    out = tuple(lab for lab in eq.out if lab in present and lab not in summed)
    if len(present) > len(_LETTERS):
        raise RuntimeError(f"contraction: at most {len(_LETTERS)} distinct dims are supported, got {len(present)}")
    kernel = _kernel(tuple(kept), out)
    all_present = {lab for labs in eq.operands for lab in labs}
    missing = tuple(d for d, lab in enumerate(eq.out) if lab in summed or lab not in all_present)
    fuses_bias = bias_ndim is not None and not missing and isinstance(kernel, _Product) and kernel.fuses(bias_ndim)
    expand = any(eq.out[d] not in all_present for d in missing)
    return LocalProgram(squeeze, kernel, fuses_bias, missing, expand, any(squeeze))


def _kernel(labels, out):
    """The cheapest kernel for ``einsum(labels -> out)`` (labels without broadcast dims)."""
    if len(labels) == 1:
        (labs,) = labels
        dims = tuple(d for d, lab in enumerate(labs) if lab not in out)
        rest = [lab for lab in labs if lab in out]
        return _Sum(dims, _perm(rest, out))
    if len(labels) == 2:
        product = _product(*labels, out)
        if product is not None:
            return product
    return _Einsum(_equation(labels, out))


def _product(a_labs, b_labs, out):
    """A :class:`_Product` for ``einsum(a, b -> out)``, or None if a dim is summed within one operand."""
    a_set, b_set = set(a_labs), set(b_labs)
    if any(lab not in out and lab not in b_set for lab in a_labs) or any(
        lab not in out and lab not in a_set for lab in b_labs
    ):
        return None
    batch = [lab for lab in out if lab in a_set and lab in b_set]
    a_free = [lab for lab in out if lab in a_set and lab not in b_set]
    b_free = [lab for lab in out if lab in b_set and lab not in a_set]
    contracted = [lab for lab in a_labs if lab not in out]
    order = (0, 1)
    if a_free and b_free and out.index(b_free[0]) < out.index(a_free[0]):  # e.g. the gradient a^T @ g
        order, (a_labs, b_labs), (a_free, b_free) = (1, 0), (b_labs, a_labs), (b_free, a_free)
    perms = (
        _perm(a_labs, batch + a_free + contracted),
        _perm(b_labs, batch + contracted + b_free),
    )
    out_perm = _perm(batch + a_free + b_free, out)
    form = ""
    if order == (0, 1) and not batch and len(b_free) == 1 and len(contracted) == 1 and out_perm is None:
        if perms == (None, None) and len(a_free) == 1:
            form = "mm"
        elif perms[0] is None and perms[1] == (1, 0):
            form = "linear"
    return _Product(order, perms, len(batch), len(a_free), len(b_free), out_perm, form)


def _perm(labels, out):
    """The permute taking dims labelled ``labels`` to the order of ``out`` (None if already in it)."""
    labels = list(labels)
    perm = tuple(labels.index(lab) for lab in out)
    return None if perm == tuple(range(len(perm))) else perm


def _equation(labels, out) -> str:
    """``labels -> out`` as a torch.einsum equation string."""
    letters: dict = {}

    def term(labs):
        return "".join(letters.setdefault(lab, _LETTERS[len(letters)]) for lab in labs)

    return ",".join(term(labs) for labs in labels) + "->" + term(out)
