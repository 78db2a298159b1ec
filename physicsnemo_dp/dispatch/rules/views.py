"""View and shape ops (view, reshape, flatten, unflatten, (un)squeeze, permute, transpose, t, expand, movedim): the shard dim moves with the data."""

from __future__ import annotations

RULES: dict = {}
FUNCTIONS: dict = {}
