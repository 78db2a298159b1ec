"""Indexing (index_select, gather, advanced indexing, index_put, embedding, masked ops) on sharded tensors."""

from __future__ import annotations

RULES: dict = {}
FUNCTIONS: dict = {}
