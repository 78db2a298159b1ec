"""Every notebook runs top to bottom without an error, in this environment's Python.

The notebooks are executed with ``nbclient`` in a fresh ``python3`` kernel
whose kernelspec (first on ``JUPYTER_PATH``, so a user-level ``python3``
kernel cannot shadow it) runs ``sys.executable``, the interpreter of this test;
an injected first cell checks it, so a notebook never silently runs in another
environment. The kernel's working directory is a temporary folder, and the
repository is put on ``PYTHONPATH`` so an uninstalled checkout works too.
Notebooks are committed without outputs; a test keeps them so.

The notebooks run side by side, ``AT_ONCE`` at a time, each in its own kernel
and folder (a module fixture starts those the session selected; each
notebook's test reports its own outcome): most of a notebook's time is one
process at a time (the kernel's and its fork server's ``import torch``, one
rank's work), so two overlap on two cores. Kernels run torch on one thread
(``OMP_NUM_THREADS=1``; ``launch``'s ranks set their own): two kernels of two
busy-waiting OpenMP threads each on two cores took 30x longer for the same
small training loop.
"""

from __future__ import annotations

import asyncio
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


AT_ONCE = 2  # notebooks running at the same time (2 cores)


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """Run the notebooks whose ``test_notebook_runs`` is selected, ``AT_ONCE`` at a time; each one's error or None."""
    selected = [
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_notebook_runs" and item.module is request.module
    ]
    jupyter = tmp_path_factory.mktemp("jupyter")
    spec = jupyter / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "test", "language": "python"}))

    async def run(path, slots):
        async with slots:
            folder = tmp_path_factory.mktemp(path.stem)  # the kernel's working directory
            nb = nbformat.read(path, as_version=4)
            nb.cells.insert(0, nbformat.v4.new_code_cell(_CHECK_INTERPRETER))
            client = NotebookClient(
                nb, kernel_name="python3", timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(folder)}}
            )
            start = time.monotonic()
            try:
                await client.async_execute()  # CellExecutionError, with the cell and its traceback, if a cell fails
            except Exception as error:  # noqa: BLE001 - reported by this notebook's test
                return error, time.monotonic() - start
            return None, time.monotonic() - start

    async def run_all():
        slots = asyncio.Semaphore(AT_ONCE)
        return await asyncio.gather(*(run(path, slots) for path in selected))

    with pytest.MonkeyPatch.context() as mp:  # the kernels inherit this environment
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter), os.environ.get("JUPYTER_PATH")])))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        mp.setenv("MPLBACKEND", "Agg")
        mp.setenv("OMP_NUM_THREADS", "1")
        return dict(zip(selected, asyncio.run(run_all())))


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, executed):
    error, seconds = executed[path]
    print(f"{path.name}: {seconds:.0f} s (with {AT_ONCE - 1} other notebook(s) running beside it)")
    if error is not None:
        raise error
