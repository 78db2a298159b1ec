"""Ops along one dim (softmax, log_softmax, cumsum and friends, sort) and layer_norm over unsharded dims."""

from __future__ import annotations

RULES: dict = {}
FUNCTIONS: dict = {}
