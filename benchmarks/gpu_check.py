"""One command for a GPU machine: everything that must hold on CUDA, in a time budget, one report.

    python -m benchmarks.gpu_check                       # on a machine with CUDA: <= 8 min on one GPU
    python -m benchmarks.gpu_check --dry-run             # print the plan and write the report, run nothing
    python -m benchmarks.gpu_check --out outputs/gpu_check --only fft attention

The plan (each step a subprocess with its own time budget, killed with its
process group when over it):

* ``diff-gloo-cuda``: the differential op families (``tests/ops``,
  ``tests/spatial``) on CUDA tensors, every rank on the one GPU there is,
  through gloo (``PDP_TEST_DEVICE=cuda PDP_TEST_BACKEND=gloo``; rank ``r`` on
  ``cuda:r % device_count``);
* ``diff-nccl``: the same with NCCL, one GPU per rank (only with 2 or more
  GPUs; layouts needing more ranks than GPUs skip);
* ``attention``: ring attention and the SDPA rules (``tests/attention``) on
  CUDA tensors, where ``F.scaled_dot_product_attention`` picks the CUDA
  kernels (flash, memory-efficient, cuDNN);
* ``fft``: the distributed FFTs (``tests/fft``) on cuFFT;
* ``datapipe``: the domain pipe's background reads moved to the device
  (``tests/datapipes/test_pipe_distributed.py``, ``test_pipe_buffers.py``);
* ``benchmarks``: ``python -m benchmarks.run --backend nccl`` on as many ranks
  as there are GPUs (1, 2, 4), its figures copied into this report.

Without a CUDA device (or with ``--dry-run``) it prints ``no CUDA device: dry
run``, lists each step's command, environment and budget, writes the report
with every step ``skipped`` and exits 0. Otherwise the exit code is 1 if a
step failed or ran over its budget. The report is ``gpu_check.json`` (steps,
commands, seconds, pytest counts, the benchmark figures, the CUDA set-up) and
``gpu_check.txt`` (a table: step, status, seconds, figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_ONE_GPU = 480  # seconds: the budgets of the steps that run on one GPU add up to at most this
DIFFERENTIAL = ("tests/ops", "tests/spatial")
BENCH_SUITES = ("comm_volume", "dispatch_overhead", "memory_scaling", "throughput_scaling", "scaling_curves")


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]
    budget: float  # seconds; the step is killed past it
    env: dict[str, str] = field(default_factory=dict)
    gpus: int = 1  # GPUs the step needs
    kind: str = "pytest"  # or "benchmark"
    # filled in by run_step
    status: str = "planned"  # passed | failed | timeout | skipped
    seconds: float = 0.0
    reason: str = ""
    figures: dict = field(default_factory=dict)
    log: str = ""

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def _pytest(paths, junit: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]


def plan(out: Path, device_count: int) -> list[Step]:
    """The steps for a machine with ``device_count`` GPUs (all listed; those needing more GPUs are skipped)."""
    cuda_gloo = {"PDP_TEST_DEVICE": "cuda", "PDP_TEST_BACKEND": "gloo"}
    bench_world = [w for w in (1, 2, 4) if w <= max(device_count, 1)]  # NCCL: one GPU per rank, never two
    return [
        Step("diff-gloo-cuda", "op families (ops, spatial) on CUDA tensors, ranks sharing the GPU through gloo",
             _pytest(DIFFERENTIAL, out / "diff-gloo-cuda.xml"), 150, cuda_gloo),
        Step("diff-nccl", "op families (ops, spatial) with NCCL, one GPU per rank",
             _pytest(DIFFERENTIAL, out / "diff-nccl.xml"), 120, {"PDP_TEST_BACKEND": "nccl"}, gpus=2),
        Step("attention", "ring attention and the SDPA rules with the CUDA kernels (flash, efficient, cuDNN)",
             _pytest(["tests/attention"], out / "attention.xml"), 75, cuda_gloo),
        Step("fft", "distributed FFTs on cuFFT", _pytest(["tests/fft"], out / "fft.xml"), 45, cuda_gloo),
        Step("datapipe", "domain pipe: background reads moved to the device",
             _pytest(["tests/datapipes/test_pipe_distributed.py", "tests/datapipes/test_pipe_buffers.py"],
                     out / "datapipe.xml"), 45, cuda_gloo),
        Step("benchmarks", f"benchmark figures with --backend nccl, world sizes {bench_world}",
             [sys.executable, "-m", "benchmarks.run", "--backend", "nccl", "--world-sizes", *map(str, bench_world),
              "--suites", *BENCH_SUITES, "--out", str(out / "benchmarks")], 150, kind="benchmark"),
    ]  # fmt: skip


def one_gpu_budget(steps: list[Step]) -> float:
    """Seconds the steps that run on a one-GPU machine may take in all (at most ``MAX_ONE_GPU``)."""
    return sum(s.budget for s in steps if s.gpus <= 1)


def _kill_group(process: subprocess.Popen) -> None:
    """Stop a step and everything it started (its own session: pytest's rank pools, benchmark ranks)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(3)
            return
        except subprocess.TimeoutExpired:
            continue


def _pytest_counts(junit: Path) -> dict:
    if not junit.exists():
        return {}
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _benchmark_figures(folder: Path) -> dict:
    path = folder / "report.json"
    if not path.exists():
        return {}
    results = json.loads(path.read_text())["results"]
    return {
        "met": sum(r["met"] is True for r in results),
        "missed": sum(r["met"] is False for r in results),
        "results": [{k: r[k] for k in ("suite", "case", "world_size", "ratio", "target", "met") if k in r}
                    for r in results],
    }  # fmt: skip


def run_step(step: Step, out: Path) -> Step:
    """Run ``step`` in its own session with its budget; fill in status, seconds, figures and the log's tail."""
    log_path = out / f"{step.name}.log"
    env = {
        **os.environ,
        **step.env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(step.budget)
        except subprocess.TimeoutExpired:
            code = None
        except BaseException:  # Ctrl-C: leave nothing running
            _kill_group(process)
            raise
        _kill_group(process)  # a timed-out step, and anything a finished one left behind
    step.seconds = round(time.monotonic() - start, 1)
    if code is None:
        step.status, step.reason = "timeout", f"over its budget of {step.budget:g} s"
    else:
        step.status = "passed" if code == 0 else "failed"
        step.reason = "" if code == 0 else f"exit code {code}"
    junit = next((Path(a.split("=", 1)[1]) for a in step.argv if a.startswith("--junitxml=")), None)
    if step.kind == "benchmark":
        step.figures = _benchmark_figures(out / "benchmarks")
    elif junit is not None:
        step.figures = _pytest_counts(junit)
    if step.status != "passed":
        step.log = log_path.read_text(errors="replace")[-4000:]
    return step


def _cuda_setup() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}  # fmt: skip
    if info["cuda_available"]:
        info["cuda"] = torch.version.cuda
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
        info["cudnn"] = torch.backends.cudnn.version()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
        info["sdp_backends_enabled"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    return info


def table(steps: list[Step]) -> str:
    rows = [f"{'step':<16} {'status':<8} {'seconds':>8} {'budget':>7}  figures"]
    for s in steps:
        if s.kind == "benchmark" and s.figures:
            fig = f"{s.figures['met']} targets met, {s.figures['missed']} missed"
        elif s.figures:
            f = s.figures
            fig = f"{f['passed']} passed, {f['failures'] + f['errors']} failed, {f['skipped']} skipped"
        else:
            fig = s.reason
        rows.append(f"{s.name:<16} {s.status:<8} {s.seconds:>8.1f} {s.budget:>7g}  {fig}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="physicsnemo_dp on a GPU: tests on CUDA tensors and NCCL figures")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu_check"), help="report folder")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write the report, run nothing")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps (names as in the plan)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    setup = _cuda_setup()
    steps = plan(out, setup["device_count"])
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in steps})
        if unknown:
            parser.error(f"--only: unknown steps {unknown}; the plan has {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in args.only]
    dry = args.dry_run or not setup["cuda_available"]
    if dry:
        why = "--dry-run" if args.dry_run else f"torch {setup['torch']}: torch.cuda.is_available() is False"
        print(f"{'dry run' if args.dry_run else 'no CUDA device: dry run'} ({why}); would run "
              f"(budget {one_gpu_budget(steps):g} s on one GPU):", flush=True)  # fmt: skip
    started = time.monotonic()
    for step in steps:
        if dry:
            step.status, step.reason = "skipped", "dry run"
            print(f"  [{step.name}] {step.what} (budget {step.budget:g} s, needs {step.gpus} GPU(s))\n"
                  f"      {step.command}", flush=True)  # fmt: skip
        elif setup["device_count"] < step.gpus:
            step.status, step.reason = "skipped", f"needs {step.gpus} GPUs, found {setup['device_count']}"
        else:
            print(f"[{step.name}] {step.command}", flush=True)
            run_step(step, out)
            print(f"[{step.name}] {step.status} in {step.seconds:.1f} s {step.reason}", flush=True)
    report = {
        "meta": {**setup, "dry_run": dry, "python": platform.python_version(), "host": platform.node(),
                 "seconds": round(time.monotonic() - started, 1), "budget_one_gpu": one_gpu_budget(steps)},
        "steps": [{**asdict(s), "command": s.command} for s in steps],
    }  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = table(steps)
    (out / "gpu_check.txt").write_text(text + "\n")
    print(text)
    print(f"report: {out / 'gpu_check.json'} and {out / 'gpu_check.txt'}")
    return 1 if any(s.status in ("failed", "timeout") for s in steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
