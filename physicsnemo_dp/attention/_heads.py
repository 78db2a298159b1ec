"""Local tensors to and from the grouped layout of :mod:`._blocks`.

Queries ``(*B, Hq, L, E)`` become ``(*B, Hq / g, g, L, E)`` and keys/values
``(*B, Hk, S, E)`` become ``(*B, Hk, 1, S, E)``, where ``g`` is the number of
query heads per key/value head (grouped-query attention). Without GQA ``g``
is 1 and a key/value head dim of extent 1 simply broadcasts. Two-dimensional
inputs ``(L, E)`` get a unit head dim first.
"""

from __future__ import annotations

import torch


def query_groups(q_heads: int, kv_heads: int) -> int:
    """Query heads per key/value head (1 when the counts match or keys broadcast)."""
    return 1 if kv_heads in (1, q_heads) else q_heads // kv_heads


def _lift(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.ndim == 2 else t


def group_queries(q: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    q = _lift(q)
    return q.unflatten(-3, (q.shape[-3] // g, g)).to(dtype)


def group_keys(t: torch.Tensor) -> torch.Tensor:
    return _lift(t).unsqueeze(-3)


def group_mask(mask: torch.Tensor | None, q_ndim: int, g: int) -> torch.Tensor | None:
    """Right-align ``mask`` with the (lifted) query dims and split its head dim like the queries'."""
    if mask is None:
        return None
    ndim = max(q_ndim, 3)
    mask = mask.reshape((1,) * (ndim - mask.ndim) + tuple(mask.shape))
    if g > 1 and mask.shape[-3] > 1:
        return mask.unflatten(-3, (mask.shape[-3] // g, g))
    return mask.unsqueeze(-3)


def ungroup_queries(t: torch.Tensor, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    """Grouped query-shaped tensor (an output or dq) back to the caller's layout."""
    t = t.flatten(-4, -3)
    return (t.squeeze(0) if ndim == 2 else t).to(dtype)


def ungroup_keys(t: torch.Tensor, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    t = t.squeeze(-3)
    return (t.squeeze(0) if ndim == 2 else t).to(dtype)


def ungroup_rows(lse: torch.Tensor, ndim: int) -> torch.Tensor:
    """Grouped per-row values ``(*B, Hk, g, L)`` (the log-sum-exp) as ``(*B, Hq, L)``."""
    lse = lse.flatten(-3, -2)
    return lse.squeeze(0) if ndim == 2 else lse


def group_rows(lse: torch.Tensor, g: int) -> torch.Tensor:
    """Inverse of :func:`ungroup_rows`."""
    lse = lse.unsqueeze(0) if lse.ndim == 1 else lse
    return lse.unflatten(-2, (lse.shape[-2] // g, g))
