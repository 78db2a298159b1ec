"""Every notebook runs top to bottom without an error, in this environment's Python.

The notebooks are executed with ``nbclient`` in a fresh ``python3`` kernel
whose kernelspec (first on ``JUPYTER_PATH``, so a user-level ``python3``
kernel cannot shadow it) runs ``sys.executable``, the interpreter of this test;
an injected first cell checks it, so a notebook never silently runs in another
environment. The kernel's working directory is a temporary folder, and the
repository is put on ``PYTHONPATH`` so an uninstalled checkout works too.
Notebooks are committed without outputs; a test keeps them so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds per cell; a whole notebook takes about a minute on an idle laptop

_CHECK_INTERPRETER = f"""
import sys
assert sys.executable == {sys.executable!r}, f"kernel runs {{sys.executable}}, not the test's Python"
"""


def test_the_four_notebooks_exist():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_"], NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_no_committed_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(tmp_path / "jupyter"), os.environ.get("JUPYTER_PATH")])))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_CHECK_INTERPRETER))
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(tmp_path)}})  # cwd: the temporary folder
    start = time.monotonic()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    print(f"{path.name}: {time.monotonic() - start:.0f} s")
