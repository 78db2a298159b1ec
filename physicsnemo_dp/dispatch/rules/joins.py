"""Joining and splitting (cat, stack, split, chunk, unbind, narrow, slice, select) along and across the sharded dim."""

from __future__ import annotations

RULES: dict = {}
FUNCTIONS: dict = {}
