#!/usr/bin/env python3
"""Bootstrap: set up the project's virtual environment and run the demo or the tests.

    python3 run.py setup            create .venv and install the project (if needed)
    python3 run.py main [ARGS...]   run the main job: the U-Net example on 4 CPU ranks (ARGS go to it)
    python3 run.py test [ARGS...]   run the test suite; ARGS go to pytest (e.g. -k foo -x)

Only the standard library is used, so this runs on any Python >= 3.10 before
anything is installed.

torch is installed on its own, pinned, *before* the project: the project only
asks for ``torch>=2.13,<2.15``, and letting pip resolve that bare requirement
can pull a multi-GB CUDA build. Installation is skipped when the stamp file in
.venv records the same pyproject.toml, so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

TORCH = "torch==2.13.0"
EXTRAS = "test,plot,graph,spectral"
ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".physicsnemo-dp-installed"
USAGE = "usage: python3 run.py {setup | main [ARGS...] | test [PYTEST ARGS...]}"


def say(message: str) -> None:
    print(f"[run.py] {message}", flush=True)


def venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def wanted_stamp() -> str:
    """What the installed environment must match: the torch pin, the extras and pyproject.toml."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return f"{TORCH} extras={EXTRAS} pyproject.toml sha256={digest}\n"


def pip_install(step: str, *args: str) -> None:
    """One install step: says what it installs, lets pip print its own progress, then says how long it took."""
    say(step)
    start = time.monotonic()
    # Not -q: pip's "Collecting ..." lines and download bars are the progress of a step that takes minutes.
    command = [str(venv_python()), "-m", "pip", "install", "--disable-pip-version-check", *args]
    if subprocess.call(command, cwd=ROOT) != 0:
        sys.exit(f"[run.py] failed: {' '.join(command)}")
    say(f"done in {time.monotonic() - start:.0f} s")


def setup() -> None:
    if sys.version_info < (3, 10):
        sys.exit(f"[run.py] Python >= 3.10 is required, this is {sys.version.split()[0]}")
    if not venv_python().exists():
        say("creating virtual environment in .venv")
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = wanted_stamp()
    if STAMP.exists() and STAMP.read_text() == stamp:
        say("environment up to date (pyproject.toml unchanged)")
        return
    pip_install(f"step 1/2: installing {TORCH} (CPU wheels by default; this can take minutes)", TORCH)
    # The `graph` and `spectral` extras (torch_geometric, neuraloperator) are installed too, so the tests of
    # third-party model code run by default. Their requirements may ask for another torch: the constraint file
    # keeps the pinned one (pip refuses rather than replacing it).
    constraint = VENV / "torch-constraint.txt"
    constraint.write_text(TORCH + "\n")
    pip_install(
        f'step 2/2: installing the project and its extras: pip install -e ".[{EXTRAS}]" -c {constraint.name}',
        "-e",
        f".[{EXTRAS}]",
        "-c",
        str(constraint),
    )
    STAMP.write_text(stamp)
    say("environment ready")


def run_in_venv(*args: str) -> int:
    """Run the venv's Python; Ctrl-C reaches the child, which decides how to stop."""
    process = subprocess.Popen([str(venv_python()), *args], cwd=ROOT)
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("setup", "main", "test"):
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    setup()
    if command == "setup":
        return 0
    if command == "main":
        # The whole workflow: synthetic Darcy data in HDF5, the datapipe, a U-Net on a (ddp 2, domain 2)
        # mesh with DDP, checkpoints and plots in outputs/unet_darcy. The one-minute tour of ShardTensor
        # alone is `python -m physicsnemo_dp.demo`.
        job = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "examples/unet_darcy.py"]
        say("running the main job: " + " ".join(["python", *job, *rest]))
        say("(the short ShardTensor tour is: .venv/bin/python -m physicsnemo_dp.demo)")
        return run_in_venv(*job, *rest)
    say("running the tests: python -m pytest " + " ".join(rest))
    return run_in_venv("-m", "pytest", *rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
