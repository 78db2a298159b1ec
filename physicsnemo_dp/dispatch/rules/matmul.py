"""Contractions (mm, bmm, addmm, baddbmm, mv, dot, matmul, linear, einsum): sharded free dims stay sharded, sharded contraction dims give Partial."""

from __future__ import annotations

RULES: dict = {}
FUNCTIONS: dict = {}
