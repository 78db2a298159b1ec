"""Command-line tools the tests run as subprocesses, found the way CI installs them."""

import shutil
import sys
from pathlib import Path

import pytest


def executable(name: str, package: str) -> str:
    """Path of console script ``name``: beside this interpreter (the venv), else on PATH; fails the test if absent."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install {package} (it is in the 'test' extra)")
    return found
