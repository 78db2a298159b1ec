"""Debugging aids that cost something, and therefore are off unless asked for.

* :func:`checks` — the checking mode: collective verification that every rank
  agrees on the metadata of every ShardTensor it builds or redistributes
  (also on process-wide with the environment variable ``PDP_CHECKS=1``).
"""

from .checks import checks, checks_enabled

__all__ = ["checks", "checks_enabled"]
