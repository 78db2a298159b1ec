"""Tests of the example scripts.

The examples are scripts, not a package: each imports its sibling helper as
``import _common``. Their folders go on ``sys.path`` here so that the test
process and the harness's ranks (which import this package too) import them
the same way the scripts import each other.
"""

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

for _folder in (EXAMPLES, EXAMPLES / "minimal"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
