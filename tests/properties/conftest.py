"""Hypothesis profiles of the property tests.

``default`` (CI): a fixed, small number of examples per family, derandomized and
without the example database, so every run draws the same cases and the whole
directory stays within its time budget. ``nightly`` (``HYPOTHESIS_PROFILE=nightly``):
many more, freshly random examples each run; a failure prints the
``@reproduce_failure`` blob to replay it.
"""

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("default", max_examples=60, derandomize=True, database=None, **_COMMON)
settings.register_profile("nightly", max_examples=1000, derandomize=False, database=None, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
