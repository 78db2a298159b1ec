"""Render the tutorials of ``notebooks/`` as pages of the documentation site, with their outputs.

    .venv/bin/python tools/render_notebooks.py                 # all four, about a minute each
    .venv/bin/python tools/render_notebooks.py 02_cnn_on_sharded_field   # one notebook (its stem)

Each notebook is executed with ``nbclient`` the way ``tests/notebooks/test_notebooks.py`` runs it
(a fresh ``python3`` kernel running this interpreter, a temporary working directory, the repository
on ``PYTHONPATH``, ``MPLBACKEND=Agg``) and written to ``docs/notebooks/<stem>.md``: markdown cells as
they are, code cells as ```` ```python ```` blocks (marked ``run: skip`` for the docs-snippet test,
since the notebook test runs them), text outputs as ```` ```text ```` blocks (ANSI codes stripped,
long outputs shortened), pictures as ``docs/images/notebooks/<stem>_<n>.png`` linked from the page.
The notebooks themselves stay without outputs. ``tests/notebooks/test_rendered_notebooks.py``
fails when a notebook's code no longer matches its page: re-run this script and commit the result.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PAGES = ROOT / "docs" / "notebooks"
IMAGES = ROOT / "docs" / "images" / "notebooks"
CELL_TIMEOUT = 600  # seconds per cell, as in tests/notebooks/test_notebooks.py
SKIP = "<!-- run: skip (rendered notebook output; tests/notebooks/test_notebooks.py executes the notebook) -->"
MAX_LINES = 40  # a longer text output keeps its first and last lines
MAX_IMAGE_BYTES = 200_000
TITLES = {
    "01_shardtensor_basics": "ShardTensor basics",
    "02_cnn_on_sharded_field": "A CNN on a sharded field",
    "03_datapipe": "Datapipes: a piece per rank",
    "04_training_ddp_fsdp": "Training with DDP and FSDP2",
}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def title(stem: str) -> str:
    return TITLES.get(stem) or stem.split("_", 1)[-1].replace("_", " ").capitalize()


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(path: Path):
    """The executed notebook (nbformat node), run as tests/notebooks/test_notebooks.py runs it."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "jupyter" / "kernels" / "python3"
        spec.mkdir(parents=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "render", "language": "python"}))
        env = {
            "JUPYTER_PATH": os.pathsep.join(filter(None, [str(Path(tmp) / "jupyter"), os.environ.get("JUPYTER_PATH")])),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "MPLBACKEND": "Agg",
        }
        check = f"import sys\nassert sys.executable == {sys.executable!r}, sys.executable\n"
        nb.cells.insert(0, nbformat.v4.new_code_cell(check))
        work = Path(tmp) / "work"
        work.mkdir()
        with _environ(**env):
            client = NotebookClient(
                nb, kernel_name="python3", timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(work)}}
            )
            client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
        nb.cells.pop(0)
    return nb


def clean_text(text: str, max_lines: int = MAX_LINES) -> str:
    """ANSI codes stripped, carriage-return overwrites applied, at most ``max_lines`` lines."""
    text = _ANSI.sub("", text)
    lines = [line.rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")]
    if len(lines) > max_lines:
        head, tail = max_lines * 3 // 4, max_lines // 4
        lines = [*lines[:head], f"... ({len(lines) - head - tail} lines omitted) ...", *lines[-tail:]]
    return "\n".join(line.rstrip() for line in lines)


def fence(text: str, lang: str) -> str:
    """A fenced block; the fence is longer than any run of backticks inside."""
    runs = [len(r) for r in re.findall(r"`{3,}", text)]
    ticks = "`" * max(3, *(n + 1 for n in runs)) if runs else "```"
    return f"{ticks}{lang}\n{text}\n{ticks}"


def _png(data: bytes) -> bytes:
    """The picture, downscaled if it is larger than MAX_IMAGE_BYTES."""
    if len(data) <= MAX_IMAGE_BYTES:
        return data
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    while True:
        image = image.resize((max(1, image.width * 3 // 4), max(1, image.height * 3 // 4)), Image.LANCZOS)
        out = io.BytesIO()
        image.save(out, format="PNG", optimize=True)
        if out.tell() <= MAX_IMAGE_BYTES or image.width < 200:
            return out.getvalue()


def _outputs(outputs, stem: str, images: list[str]) -> list[str]:
    """Markdown for one cell's outputs; pictures are written and their names appended to ``images``."""
    parts: list[str] = []
    stream = ""
    for out in [*outputs, None]:
        if out is not None and out.output_type == "stream":
            stream += out.text
            continue
        if stream.strip():
            parts.append(fence(clean_text(stream), "text"))
        stream = ""
        if out is None:
            break
        data = out.get("data", {})
        if out.output_type == "error":
            parts.append(fence(clean_text("\n".join(out.traceback)), "text"))
        elif "image/png" in data:
            name = f"{stem}_{len(images) + 1}.png"
            (IMAGES / name).write_bytes(_png(base64.b64decode(data["image/png"])))
            images.append(name)
            parts.append(f"![output {len(images)}](../images/notebooks/{name})")
        elif "text/plain" in data and data["text/plain"].strip():
            parts.append(fence(clean_text(data["text/plain"]), "text"))
    return parts


def render(nb, stem: str) -> tuple[str, list[str]]:
    """The page of an executed notebook, and the names of the pictures it wrote to IMAGES."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    for old in IMAGES.glob(f"{stem}_*.png"):
        old.unlink()
    images: list[str] = []
    parts = [
        f"# {title(stem)}",
        f"Notebook `notebooks/{stem}.ipynb`, rendered with its outputs by `python tools/render_notebooks.py`\n"
        "(see [the notebooks page](../notebooks.md) to run it yourself).",
    ]
    for cell in nb.cells:
        source = cell.source.rstrip("\n")
        if cell.cell_type == "markdown":
            parts.append(source)
        elif cell.cell_type == "code":
            parts.append(f"{SKIP}\n{fence(source, 'python')}")
            parts += _outputs(cell.outputs, stem, images)
    return "\n\n".join(p for p in parts if p.strip()) + "\n", images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stems", nargs="*", help="notebook stems (default: every notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.stems:
        unknown = sorted(set(args.stems) - {p.stem for p in paths})
        if unknown:
            parser.error(f"no notebook {unknown} in notebooks/; choose from {[p.stem for p in paths]}")
        paths = [p for p in paths if p.stem in args.stems]
    PAGES.mkdir(parents=True, exist_ok=True)
    for path in paths:
        start = time.monotonic()
        page, images = render(execute(path), path.stem)
        (PAGES / f"{path.stem}.md").write_text(page)
        sizes = ", ".join(f"{(IMAGES / n).stat().st_size // 1024} KB" for n in images)
        print(
            f"{path.name}: {time.monotonic() - start:.0f} s -> docs/notebooks/{path.stem}.md, {len(images)} picture(s) ({sizes})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
