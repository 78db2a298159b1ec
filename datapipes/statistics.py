"""Per-variable statistics over a whole dataset, computed distributed, and normalization by them.

:func:`compute_statistics` runs a pipe over every sample once (no shuffle, no
drop): the ddp ranks take disjoint samples and the domain ranks disjoint boxes,
so every value is counted exactly once. Each rank keeps ``(count, mean, M2,
min, max)`` per variable (Chan et al.'s pairwise update, stable in float64
where ``sum(x**2) - n * mean**2`` would cancel), and the ranks combine them with
one small ``all_gather`` per mesh dim. The result is identical on every rank
and can be saved as JSON and loaded without recomputing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import reduce
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_dp import collectives

from ._files import atomic_path
from .agreement import check_all_ranks
from .pipe import DomainPipe
from .source import Source

__all__ = ["Normalize", "Statistics", "compute_statistics"]

_FIELDS = ("count", "mean", "std", "min", "max")


@dataclass(frozen=True)
class Statistics:
    """``count``, ``mean``, ``std`` (population), ``min`` and ``max`` of each variable."""

    count: Mapping[str, int]
    mean: Mapping[str, float]
    std: Mapping[str, float]
    min: Mapping[str, float]
    max: Mapping[str, float]

    @property
    def variables(self) -> tuple[str, ...]:
        return tuple(self.mean)

    def save(self, path) -> Path:
        """Write as JSON (atomically)."""
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps({k: dict(v) for k, v in asdict(self).items()}, indent=2))
        return Path(path)

    @classmethod
    def load(cls, path) -> "Statistics":
        data = json.loads(Path(path).read_text())
        return cls(**{k: data[k] for k in _FIELDS})


def compute_statistics(source: Source, mesh: DeviceMesh, *, variables: Sequence[str] | None = None,
                       **pipe_options) -> Statistics:
    """Statistics of every floating-point variable (or of ``variables``) over all samples.

    ``pipe_options`` go to :class:`~datapipes.pipe.DomainPipe` (``split_dims``,
    ``prefetch``, ``workers``, ``ddp_dim``, ``batch_size`` ...); the order
    options are fixed so every sample is read once. Collective: every rank of
    ``mesh`` must call it. With ``validate=True`` a NaN or infinity anywhere
    raises :class:`~datapipes.errors.InvalidValuesError` on every rank (naming
    the file, variable, sample and the rank that read it) instead of giving
    NaN statistics; any other read error is likewise raised on every rank.
    """
    pipe = DomainPipe(source, mesh, shuffle=False, drop_last=False, **pipe_options)
    names = tuple(variables) if variables is not None else tuple(
        v for v in source.variables if source.dtype(v).kind in "fc"
    )
    local = torch.tensor([[0.0, 0.0, 0.0, float("inf"), float("-inf")]] * len(names), dtype=torch.float64)
    error = None
    try:
        for batch in pipe:
            for i, name in enumerate(names):
                local[i] = _combine(local[i], _moments(batch[name].to_local()))
    except Exception as err:  # e.g. a NaN in this rank's slab (validate=True): only this rank knows
        error = err
    finally:
        pipe.close()
    check_all_ranks(error, mesh)  # every rank raises it, instead of waiting in the all_gather below
    total = _all_combine(local, mesh)
    per = {name: total[i].tolist() for i, name in enumerate(names)}
    return Statistics(
        count={k: int(v[0]) for k, v in per.items()},
        mean={k: v[1] for k, v in per.items()},
        std={k: (v[2] / v[0]) ** 0.5 if v[0] else 0.0 for k, v in per.items()},
        min={k: v[3] for k, v in per.items()},
        max={k: v[4] for k, v in per.items()},
    )


def _moments(x: torch.Tensor) -> torch.Tensor:
    """``(count, mean, M2, min, max)`` of all values of ``x``."""
    x = x.detach().to(torch.float64).reshape(-1)
    if x.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, float("inf"), float("-inf")], dtype=torch.float64)
    mean = x.mean()
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), mean,
                        ((x - mean) ** 2).sum(), x.min(), x.max()])


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Moments of the union of two disjoint sets (last dim: count, mean, M2, min, max)."""
    na, nb = a[..., 0], b[..., 0]
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = b[..., 1] - a[..., 1]
    mean = a[..., 1] + delta * nb / safe
    m2 = a[..., 2] + b[..., 2] + delta**2 * na * nb / safe
    return torch.stack([n, mean, m2, torch.minimum(a[..., 3], b[..., 3]), torch.maximum(a[..., 4], b[..., 4])], -1)


def _all_combine(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Combine every rank's moments: one all_gather per mesh dim, folded in mesh-coordinate order.

    Coordinate order (not the process group's rank order, which can differ
    from group to group along one mesh dim) makes every rank fold the same
    values in the same order, so all ranks get bitwise the same statistics.
    """
    local = local.to(collectives.mesh_device(mesh))
    for dim in range(mesh.ndim):
        parts = collectives.all_gather_v(local[None], [1] * mesh.size(dim), 0, mesh, dim).unbind(0)
        local = reduce(_combine, parts)
    return local.cpu()


class Normalize:
    """In-place ``(x - mean) / std`` per variable: a pipe transform (runs in the reader).

    Args:
        statistics: from :func:`compute_statistics` or :meth:`Statistics.load`.
        variables: which to normalize (default: all in ``statistics``).
        eps: floor for ``std`` so constant fields do not divide by zero.
    """

    def __init__(self, statistics: Statistics, variables: Sequence[str] | None = None, eps: float = 1e-12):
        names = statistics.variables if variables is None else tuple(variables)
        missing = [v for v in names if v not in statistics.mean]
        if missing:
            raise KeyError(f"no statistics for variable(s) {missing} (have {list(statistics.variables)})")
        self.mean = {v: statistics.mean[v] for v in names}
        self.std = {v: max(statistics.std[v], eps) for v in names}

    def __call__(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, mean in self.mean.items():
            if name in tensors:
                tensors[name].sub_(mean).div_(self.std[name])

    def inverse(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo the normalization of ``name`` (e.g. on a model's prediction)."""
        return tensor * self.std[name] + self.mean[name]
