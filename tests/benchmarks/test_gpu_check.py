"""``python -m benchmarks.gpu_check``: its plan, its dry run on this CPU machine, and how it runs a step."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[2]
STEPS = ["diff-gloo-cuda", "diff-nccl", "attention", "fft", "datapipe", "benchmarks"]


def test_dry_run_lists_the_plan_skips_every_step_and_writes_the_report(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dry run" in done.stdout.splitlines()[0]
    for name in STEPS:
        assert f"[{name}]" in done.stdout
    assert "PDP_TEST_BACKEND=gloo PDP_TEST_DEVICE=cuda" in done.stdout and "--backend nccl" in done.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["dry_run"] is True
    assert [s["name"] for s in report["steps"]] == STEPS
    assert all(s["status"] == "skipped" and s["command"] for s in report["steps"])
    text = (tmp_path / "gpu_check.txt").read_text().splitlines()
    assert text[0].split()[:3] == ["step", "status", "seconds"] and len(text) == 1 + len(STEPS)


def test_without_cuda_it_says_so_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "_cuda_setup", lambda: {"torch": "x", "cuda_available": False, "device_count": 0})
    monkeypatch.setattr(gpu_check, "run_step", lambda *a: (_ for _ in ()).throw(AssertionError("ran a step")))
    assert gpu_check.main(["--out", str(tmp_path), "--only", "fft"]) == 0
    assert capsys.readouterr().out.startswith("no CUDA device: dry run")


def test_plan_fits_eight_minutes_on_one_gpu_and_uses_every_gpu_for_nccl(tmp_path):
    one = gpu_check.plan(tmp_path, 1)
    assert [s.name for s in one] == STEPS
    assert gpu_check.one_gpu_budget(one) <= gpu_check.MAX_ONE_GPU == 480
    assert {s.name for s in one if s.gpus > 1} == {"diff-nccl"}
    bench = {s.name: s for s in gpu_check.plan(tmp_path, 4)}["benchmarks"].argv
    assert bench[bench.index("--world-sizes") + 1 : bench.index("--suites")] == ["1", "2", "4"]
    bench = {s.name: s for s in one}["benchmarks"].argv
    assert bench[bench.index("--world-sizes") + 1 : bench.index("--suites")] == ["1"]  # NCCL: one GPU per rank


def _step(tmp_path, code: str, budget: float) -> gpu_check.Step:
    junit = tmp_path / "x.xml"
    junit.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>')
    return gpu_check.Step("x", "x", [sys.executable, "-c", code, f"--junitxml={junit}"], budget)


def test_a_step_passes_fails_or_is_stopped_at_its_budget(tmp_path):
    ok = gpu_check.run_step(_step(tmp_path, "print('fine')", 30), tmp_path)
    assert ok.status == "passed" and ok.log == ""
    assert ok.figures == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2, "passed": 2}
    bad = gpu_check.run_step(_step(tmp_path, "import sys; print('boom'); sys.exit(3)", 30), tmp_path)
    assert bad.status == "failed" and bad.reason == "exit code 3" and "boom" in bad.log
    slow = gpu_check.run_step(_step(tmp_path, "import time; time.sleep(60)", 0.5), tmp_path)
    assert slow.status == "timeout" and slow.seconds < 10 and "budget of 0.5 s" in slow.reason
    assert "passed" in gpu_check.table([ok, bad, slow]) and "timeout" in gpu_check.table([ok, bad, slow])
