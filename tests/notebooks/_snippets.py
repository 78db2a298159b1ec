"""Code blocks of the documentation: extraction, run modes, and running them (see tests/README.md).

A ```` ```python ```` block of ``README.md`` or ``docs/*.md`` runs as written. An HTML comment on
the line before the block (invisible on the rendered page) says how:

* ``<!-- run: single -->`` (the default, also for a block without a comment): one Python
  process, like ``python snippet.py``; a block that starts ranks calls ``physicsnemo_dp.launch``
  itself.
* ``<!-- run: launch N -->``: the block is the body every rank runs, on ``N`` ranks started by
  ``physicsnemo_dp.launch``; it sees ``mesh`` (the launch's 1-D ``"domain"`` DeviceMesh), and the
  page says so in its prose.
* ``<!-- run: continue -->``: appended to the page's previous block that runs (same namespace,
  same mode), for a block that goes on where the previous one stopped.
* ``<!-- run: skip (reason) -->``: not run; the reason is required.
* ``<!-- run: launch 2, slow (reason) -->`` (or ``single, slow (reason)``): runs only with
  ``pytest -m slow``, for a block that takes minutes (a cold Inductor compile).

Output: a line ending in ``# prints: TEXT`` says the block prints a line ``TEXT`` (rank 0's output
for launched blocks); ``...`` in ``TEXT`` stands for any characters. The printed lines must contain
every such ``TEXT`` in the order of the comments.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->\s*$")
PRINTS = re.compile(r"#\s*prints:\s*(.*?)\s*$")


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    mode: str  # "single", "launch", "skip"
    nprocs: int = 1
    code: str = ""
    expected: list[str] = field(default_factory=list)
    reason: str = ""
    slow: str = ""  # why the block runs only with -m slow ("" = in the default run)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _parse_mode(text: str, where: str) -> tuple[str, int, str, str]:
    m = re.fullmatch(r"(.*?)\s*,\s*slow\s*\((.+)\)", text)
    if m:
        mode, nprocs, reason, _ = _parse_mode(m.group(1), where)
        if mode not in ("single", "launch"):
            raise ValueError(f"{where}: only a block that runs can be slow, got {text!r}")
        return mode, nprocs, reason, m.group(2).strip()
    return (*_parse_mode_only(text, where), "")


def _parse_mode_only(text: str, where: str) -> tuple[str, int, str]:
    if text == "single":
        return "single", 1, ""
    if text == "continue":
        return "continue", 0, ""
    m = re.fullmatch(r"launch\s+(\d+)", text)
    if m and 2 <= int(m.group(1)) <= 4:
        return "launch", int(m.group(1)), ""
    m = re.fullmatch(r"skip\s*\((.+)\)", text)
    if m and m.group(1).strip():
        return "skip", 0, m.group(1).strip()
    raise ValueError(
        f"{where}: unknown run marker {text!r}; use 'single', 'launch N' (2 <= N <= 4), 'continue' "
        "or 'skip (reason)', the first two optionally followed by ', slow (reason)'"
    )


def blocks(page: Path) -> list[Block]:
    """The page's python blocks that run (continuations merged into the block they continue) and skips."""
    lines = page.read_text().splitlines()
    rel = str(page.relative_to(ROOT))
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        code = "\n".join(lines[start + 1 : j]) + "\n"
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        where = f"{rel}:{start + 1}"
        mode, nprocs, reason, slow = _parse_mode(marker.group(1), where) if marker else ("single", 1, "", "")
        expected = [m.group(1) for m in map(PRINTS.search, code.splitlines()) if m]
        if mode == "continue":
            previous = next((b for b in reversed(out) if b.mode != "skip"), None)
            if previous is None:
                raise ValueError(f"{where}: 'run: continue' but no earlier block on the page runs")
            # pad with blank lines so that line numbers in tracebacks stay those of the page
            gap = start + 1 - (previous.line + previous.code.count("\n"))
            previous.code += "\n" * max(gap, 0) + code
            previous.expected += expected
        else:
            out.append(Block(rel, start + 1, mode, nprocs, code, expected, reason, slow))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def check_output(block: Block, output: str) -> str | None:
    """None if ``output`` shows every ``# prints:`` line of ``block`` in order, else what is missing."""
    lines = [line.strip() for line in output.splitlines()]
    pos = 0
    for text in block.expected:
        pattern = re.compile(".*?".join(re.escape(part) for part in text.split("...")))
        while pos < len(lines) and not pattern.fullmatch(lines[pos]):
            pos += 1
        if pos == len(lines):
            return f"{block.where}: expected a line {text!r} (in order) in its output:\n{output}"
        pos += 1
    return None


def _exec(block: Block, namespace: dict) -> tuple[str, str | None]:
    """Run one block; return (stdout, traceback or None). Tracebacks name the page and its line."""
    buffer = io.StringIO()
    try:
        code = compile("\n" * block.line + block.code, block.page, "exec")
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)
        return buffer.getvalue(), None
    except BaseException:  # noqa: BLE001 - reported per block
        return buffer.getvalue(), traceback.format_exc()


def _fresh_namespace(**names) -> dict:
    return {"__name__": "__main__", "__builtins__": __builtins__, **names}


def run_on_ranks(mesh, block_dicts: list[dict]) -> list[dict]:
    """Every rank runs the blocks in order; after each, the ranks agree whether it failed anywhere."""
    import torch
    import torch.distributed as dist

    results = []
    for data in block_dicts:
        block = Block(**data)
        torch.manual_seed(0)
        output, error = _exec(block, _fresh_namespace(mesh=mesh))
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        results.append({"output": output, "errors": failed})
    return results


def _single_process_main() -> None:
    """``python -m tests.notebooks._snippets``: run the JSON list of blocks on stdin, one fresh namespace each."""
    import torch
    import torch.distributed as dist

    results = []
    for data in json.load(sys.stdin):
        block = Block(**data)
        torch.manual_seed(0)
        start = time.perf_counter()
        output, error = _exec(block, _fresh_namespace())
        sys.__stderr__.write(f"{block.where}: {time.perf_counter() - start:.1f} s\n")
        if dist.is_initialized():  # a block that joined a process group of one: the next starts clean
            dist.destroy_process_group()
        results.append({"output": output, "errors": {} if error is None else {0: error}})
    sys.__stdout__.write("\n@@RESULTS@@" + json.dumps(results) + "\n")


def as_dicts(items: list[Block]) -> list[dict]:
    return [asdict(b) for b in items]


if __name__ == "__main__":
    _single_process_main()
