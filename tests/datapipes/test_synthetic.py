"""Synthetic generators produce the physics they claim, at any size asked."""

from __future__ import annotations

import numpy as np
import pytest

from datapipes.synthetic import darcy_flow, heat_equation, point_cloud


def _darcy_residual(k: np.ndarray, p: np.ndarray) -> float:
    """max |-div(k grad p) - 1| over interior nodes (the generator's discretization, recomputed)."""
    h2 = 1.0 / (k.shape[-1] - 1) ** 2
    kx = 2 * k[:, :-1, 1:-1] * k[:, 1:, 1:-1] / (k[:, :-1, 1:-1] + k[:, 1:, 1:-1])
    ky = 2 * k[:, 1:-1, :-1] * k[:, 1:-1, 1:] / (k[:, 1:-1, :-1] + k[:, 1:-1, 1:])
    fx = kx * np.diff(p[:, :, 1:-1], axis=1)
    fy = ky * np.diff(p[:, 1:-1, :], axis=2)
    return float(np.abs(-(np.diff(fx, axis=1) + np.diff(fy, axis=2)) / h2 - 1).max())


@pytest.mark.parametrize("resolution", [8, 24])
def test_darcy_pressure_solves_the_equation(resolution):
    data = darcy_flow(3, resolution, seed=5)
    k, p = (data[name].astype(np.float64) for name in ("permeability", "pressure"))
    assert k.shape == p.shape == (3, resolution, resolution)
    assert set(np.unique(k)) <= {3.0, 12.0}
    assert (p[:, 0] == 0).all() and (p[:, :, -1] == 0).all() and (p[:, 1:-1, 1:-1] > 0).all()
    assert _darcy_residual(k, p) < 1e-3


def test_heat_solution_decays_and_keeps_the_mean():
    data = heat_equation(2, (16, 8, 4), time=0.01, seed=1)
    u0, u = data["u0"], data["u"]
    assert u.shape == (2, 16, 8, 4)
    assert np.allclose(u0.mean(axis=(1, 2, 3)), u.mean(axis=(1, 2, 3)), atol=1e-5)
    assert ((u - u.mean()) ** 2).sum() < ((u0 - u0.mean()) ** 2).sum()


@pytest.mark.parametrize("kind,fields", [("surface", {"pressure", "normal"}), ("volume", {"temperature", "velocity"})])
def test_point_clouds(kind, fields):
    mesh = point_cloud(1000, kind=kind)
    assert set(mesh.fields) == fields and mesh.points.shape[1] == 3
    assert all(len(v) == len(mesh.points) for v in mesh.fields.values())
    if kind == "surface":
        assert mesh.cells.shape[1] == 3 and mesh.cells.max() < len(mesh.points)
        assert 500 < len(mesh.points) <= 1000
    else:
        assert mesh.cells is None and len(mesh.points) == 1000
