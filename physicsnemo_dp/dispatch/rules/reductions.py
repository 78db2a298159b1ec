"""Reductions (sum, mean, max, min, amax, amin, argmax, argmin, norm, var, std, prod) over sharded and unsharded dims."""

from __future__ import annotations

RULES: dict = {}
FUNCTIONS: dict = {}
