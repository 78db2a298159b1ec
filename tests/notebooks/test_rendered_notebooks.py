"""The site's notebook pages (docs/notebooks/<stem>.md) are in step with notebooks/*.ipynb, without running them.

``tools/render_notebooks.py`` executes each notebook and writes its page: every code cell as a
``python`` block marked ``run: skip`` (the notebook test runs the cells), then its outputs. Here
the code cells of each notebook, in order, must equal the python blocks of its page, so a notebook
edited without re-rendering fails with the command that fixes it; the pictures a page links exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RERENDER = (
    "re-render the pages: python tools/render_notebooks.py (then commit docs/notebooks/ and docs/images/notebooks/)"
)
SKIP = re.compile(r"^<!--\s*run:\s*skip\s*\(.+\)\s*-->$")
OPEN = re.compile(r"^(`{3,})(\w*)$")


def fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, code, marked run: skip on the line before) of every fenced block of a page."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j] != m.group(1):
            j += 1
        skipped = i > 0 and bool(SKIP.match(lines[i - 1]))
        blocks.append((m.group(2), "\n".join(lines[i + 1 : j]), skipped))
        i = j + 1
    return blocks


def test_fenced_blocks():
    page = "x\n<!-- run: skip (r) -->\n```python\na = 1\n\nb = 2\n```\n\n````text\n```\n````\n```python\nc\n```\n"
    assert fenced_blocks(page) == [("python", "a = 1\n\nb = 2", True), ("text", "```", False), ("python", "c", False)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_rendered_page_matches_the_notebook(path):
    page = ROOT / "docs" / "notebooks" / f"{path.stem}.md"
    assert page.exists(), f"{page.relative_to(ROOT)} is missing; {RERENDER}"
    text = page.read_text()
    cells = [c.source.rstrip("\n") for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    python = [b for b in fenced_blocks(text) if b[0] == "python"]
    assert [code for _, code, _ in python] == cells, (
        f"{page.relative_to(ROOT)} does not show the code cells of {path.relative_to(ROOT)}; {RERENDER}"
    )
    assert all(skipped for *_, skipped in python), (
        f"{page.relative_to(ROOT)}: a python block lacks its run: skip marker"
    )
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    missing = [p for p in pictures if not (page.parent / p).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links missing pictures {missing}; {RERENDER}"


def test_no_page_without_a_notebook():
    stems = {p.stem for p in NOTEBOOKS}
    orphans = [p.name for p in (ROOT / "docs" / "notebooks").glob("*.md") if p.stem not in stems]
    orphans += [
        p.name for p in (ROOT / "docs" / "images" / "notebooks").glob("*.png") if p.stem.rsplit("_", 1)[0] not in stems
    ]
    assert not orphans, f"rendered pages or pictures of notebooks that no longer exist: {orphans}; delete them"


def test_renderer_cleans_text_outputs():
    """ANSI codes stripped, carriage-return overwrites applied, long outputs shortened, fences never closed early."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_notebooks", ROOT / "tools" / "render_notebooks.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.clean_text("\x1b[31mred\x1b[0m\n10%\r100%\n") == "red\n100%"
    short = tool.clean_text("\n".join(map(str, range(100))), max_lines=8).splitlines()
    assert short == ["0", "1", "2", "3", "4", "5", "... (92 lines omitted) ...", "98", "99"]
    assert tool.fence("a ``` b", "text") == "````text\na ``` b\n````"
