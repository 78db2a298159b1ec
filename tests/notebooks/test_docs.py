"""The documentation stays true: the API page matches the docstrings, relative links resolve."""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "notebooks" / "README.md", ROOT / "README.md"]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "tools" / "gen_api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    expected = _generator().render()
    actual = (ROOT / "docs" / "api.md").read_text()
    diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "committed", "generated"))[:60])
    assert actual == expected, f"docs/api.md is out of date; run `python tools/gen_api_docs.py`:\n{diff}"
    assert str(ROOT) not in actual, "docs/api.md names a path of this checkout (a module in some __all__?)"


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
