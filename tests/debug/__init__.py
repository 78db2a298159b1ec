"""Tests of physicsnemo_dp.debug.explain / simulate. The U-Net comes from examples/ (its folder goes on sys.path)."""

import sys
from pathlib import Path

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(_EXAMPLES) not in sys.path:
    sys.path.insert(0, str(_EXAMPLES))
