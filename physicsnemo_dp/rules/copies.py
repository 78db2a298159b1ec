"""The ``*_copy`` ops: the rule of their view op, then a contiguous copy of each local result.

``permute_copy``, ``transpose_copy``, ``t_copy``, ``view_copy``,
``expand_copy``, ``unsqueeze_copy``, ``squeeze_copy``, ``slice_copy``,
``select_copy``, ``split_copy``, ``split_with_sizes_copy``, ``unbind_copy``,
``alias_copy``, ``detach_copy``, ``view_as_real_copy``/``view_as_complex_copy``
are what functionalization and export turn views into. Each runs the rule of
its view (``views.py``, ``joins.py``, ``tensor_like.py``: the same layouts and
the same communication, none in the common cases) and copies every local
result into fresh contiguous memory. ``diagonal_copy`` is served by
``shape_ops.py``. Their backward formulas are the views' (``permute`` back,
``slice_backward``, ``stack``...), served by the same families.
"""

from __future__ import annotations

import torch

from ..rule_kit import shard_tensor_cls, wrap
from . import joins, tensor_like, views

aten = torch.ops.aten

_VIEW_OF = {
    aten.permute_copy.default: aten.permute.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.t_copy.default: aten.t.default,
    aten.view_copy.default: aten.view.default,
    aten.view_copy.dtype: aten.view.dtype,
    aten.expand_copy.default: aten.expand.default,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.view_as_real_copy.default: aten.view_as_real.default,
    aten.view_as_complex_copy.default: aten.view_as_complex.default,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.select_copy.int: aten.select.int,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.unbind_copy.int: aten.unbind.int,
    aten.alias_copy.default: aten.alias.default,
    aten.detach_copy.default: aten.detach.default,
}

_VIEW_RULES = {**tensor_like.RULES, **views.RULES, **joins.RULES}


def _fresh(out):
    if isinstance(out, (tuple, list)):
        return type(out)(_fresh(o) for o in out)
    if isinstance(out, shard_tensor_cls()):
        return wrap(out._local_tensor.clone(memory_format=torch.contiguous_format), out._spec)
    return out


def _copy_of_view(func, args, kwargs):
    view = _VIEW_OF[func]
    return _fresh(_VIEW_RULES[view](view, args, kwargs))


RULES: dict = dict.fromkeys(_VIEW_OF, _copy_of_view)
