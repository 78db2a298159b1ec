"""Pyflakes over the whole repository, run the way CI runs it: ``ruff check`` with pyproject's settings.

Unused imports and variables are dead code, undefined names are bugs waiting
for the branch that runs them; both fail the build here.
"""

import shutil
import subprocess
from pathlib import Path

from ._tools import executable

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    return executable("ruff", "ruff")


def test_repository_is_pyflakes_clean():
    result = subprocess.run([_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_catches_an_unused_import(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "bad.py").write_text("import os\n")
    result = subprocess.run([_ruff(), "check", "--no-cache", "."], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "F401" in result.stdout
