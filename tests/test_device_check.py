"""scripts/device-check: the prepared GPU-machine run, tested here on its CPU-only path.

The end-to-end test runs the real script (small CPU-side steps only) into a
temporary folder; the others load the script as a module and drive its runner
with tiny commands: timeouts, budget exhaustion, exit-code meaning, packing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "device-check"


def _load_script():
    loader = importlib.machinery.SourceFileLoader("device_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("device_check", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up by name
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dc():
    return _load_script()


def _env_without_out() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.pop("DEVICE_CHECK_BUDGET", None)
    return env


def test_script_is_executable_with_a_python_shebang():
    assert SCRIPT.is_file()
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: run scripts/device-check itself there")
def test_cpu_only_run_says_no_gpu_records_every_step_and_exits_0(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], cwd=tmp_path, env=_env_without_out(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "no CUDA GPU: skipping GPU steps" in proc.stdout

    # Only a few files, directly in the output folder (the device tool returns at most 8).
    assert sorted(p.name for p in out.iterdir()) == ["fingerprint.json", "log.txt", "results.tar.gz", "steps.json"]

    summary = json.loads((out / "steps.json").read_text())
    assert summary["schema"] == "convcheck.device-check/1"
    assert summary["gpu"] is False
    assert summary["elapsed_s"] < summary["budget_s"]
    steps = {s["name"]: s for s in summary["steps"]}
    for s in summary["steps"]:
        assert set(s) >= {"name", "command", "exit_code", "seconds", "status"}
        assert s["status"] in ("ok", "diagnosed", "skipped", "unavailable"), s
    assert steps["probe"]["status"] == "ok"
    assert steps["probe"]["results"]["cuda_available"] is False
    assert steps["env-json"]["status"] in ("ok", "diagnosed")
    assert steps["env-json"]["results"]["torch"]["version"] == torch.__version__
    assert steps["env-report"]["status"] in ("ok", "diagnosed")
    # The CPU-side comparisons ran; exit 1 (a diagnosed discrepancy) is a result, not a failure.
    for name in ("compare-lenet-cpu_emulate-tf32", "compare-cifar_cnn-cpu_emulate-tf32"):
        s = steps[name]
        assert s["status"] in ("ok", "diagnosed"), s
        assert s["exit_code"] in (0, 1)
        assert "--json" in s["argv"] and "--out" in s["argv"]
        assert s["results"]["targets"][1] == "cpu:emulate-tf32"
        assert any(o.endswith("summary.json") for o in s["outputs"])
    # The compare against its bare run (issue 14, item 3): wall time and stages over the bare steps.
    bare = steps["bench-lenet-bare"]
    assert bare["status"] == "ok", bare
    assert bare["results"]["steps"] == 3 and bare["results"]["batch_size"] == 8
    assert 0 < bare["results"]["warm_s"] <= bare["results"]["cold_s"]
    (bench,) = summary["benchmarks"]
    assert bench["compare"] == "compare-lenet-cpu_emulate-tf32" and bench["goal_x"] is None
    assert bench["x_bare"] == round(steps["compare-lenet-cpu_emulate-tf32"]["seconds"] / bare["results"]["warm_s"], 2)
    assert set(bench["stages_x_bare"]) >= {"parity_s", "train_s"}
    assert "benchmark compare-lenet-cpu_emulate-tf32: " in proc.stdout
    # Every GPU step is listed, skipped, with the reason.
    gpu_steps = [s for s in summary["steps"] if s["gpu"]]
    assert {s["name"] for s in gpu_steps} >= {
        "compare-lenet-cpu_cuda", "compare-lenet-tf32_no-tf32", "compare-lenet-cuda_amp-fp16",
        "compare-lenet-cuda_amp-bf16", "compare-cifar_cnn-tf32_emulate-tf32", "compare-resnet50-cpu_cuda",
        "compare-resnet50-gpu-judge", "bench-resnet50-bare",
    }
    assert "--judge cuda:float64" in steps["compare-resnet50-gpu-judge"]["command"]
    assert all(s["status"] == "skipped" and "no CUDA GPU" in s["detail"] for s in gpu_steps)
    assert "cuda:tf32,cpu:emulate-tf32" in steps["compare-cifar_cnn-tf32_emulate-tf32"]["command"]
    assert steps["pytest-gpu"]["status"] in ("ok", "unavailable")
    if steps["pytest-gpu"]["status"] == "ok":  # the GPU tests collect, and skip, here
        assert " -m gpu " in steps["pytest-gpu"]["command"]
    assert steps["nvidia-smi"]["status"] in ("ok", "unavailable")
    # issue 29: the rounding check ran on the CPU emulations (the GPU targets join where there is one)
    rounding = steps["tf32-rounding"]
    assert rounding["status"] == "ok" and not rounding["gpu"], rounding
    summary29 = rounding["results"]["summary"]
    assert summary29["cpu:emulate-tf32"]["matched"] == ["RNA"] and summary29["cpu:emulate-tf32-rz"]["matched"] == ["RZ"]
    assert summary29["cpu:emulate-tf32"]["1024.5 @ 1.0"] == 1025.0 and summary29["cpu"]["matched"] == ["float32"]
    assert "tf32-rounding (no GPU): cpu:emulate-tf32 1024.5@1.0=1025 matched RNA" in proc.stdout

    log = (out / "log.txt").read_text()
    assert "no CUDA GPU: skipping GPU steps" in log
    assert "===== env-report" in log

    with tarfile.open(out / "results.tar.gz") as tar:
        names = set(tar.getnames())
    for member in ("probe.json", "env.json", "env.txt", "fingerprint.json", "steps.json", "log.txt",
                   "compare-lenet-cpu_emulate-tf32/summary.json", "compare-lenet-cpu_emulate-tf32/layers.csv",
                   "compare-lenet-cpu_emulate-tf32/curves.csv", "tf32-rounding.json"):
        assert f"device-check/{member}" in names, sorted(names)
    assert all(n.startswith("device-check") for n in names)
    from convcheck.env import load

    assert load(out / "fingerprint.json").torch.version == torch.__version__


def test_no_output_folder_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=_env_without_out(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "$OUT" in proc.stderr


def test_exit_codes_mean_results_or_failures(dc):
    compare = dc.Step("c", [], 10, kind="compare")
    env = dc.Step("e", [], 10, kind="env")
    pytest_step = dc.Step("p", [], 10, kind="pytest")
    tool = dc.Step("t", [], 10)
    assert dc._status(compare, 0, False, 10)[0] == "ok"
    assert dc._status(compare, 1, False, 10)[0] == "diagnosed"
    assert dc._status(compare, 2, False, 10)[0] == "failed"
    assert dc._status(compare, 3, False, 10)[0] == "failed"
    assert dc._status(env, 1, False, 10)[0] == "diagnosed"
    assert dc._status(pytest_step, 1, False, 10)[0] == "failed"
    assert dc._status(pytest_step, 5, False, 10)[0] == "ok"
    assert dc._status(tool, 1, False, 10)[0] == "failed"
    assert dc._status(tool, -9, True, 3) == ("timeout", "killed after 3s")


@pytest.mark.slow  # ~6 s: a step really runs into its timeout
def test_runner_kills_a_step_at_its_timeout_and_keeps_going(dc, tmp_path):
    runner = dc.Runner(tmp_path, budget=120, python=sys.executable)
    try:
        slow = dc.Step("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], 1)
        slow.timeout = dc.MIN_STEP_S + 1
        rec = runner.run(slow)
        assert rec["status"] == "timeout" and rec["seconds"] < 30
        ok = runner.run(dc.Step("hello", [sys.executable, "-c", "print('hello')"], 30, stdout_name="hello.txt"))
        assert ok["status"] == "ok" and ok["exit_code"] == 0
        bad = runner.run(dc.Step("broken", [sys.executable, "-c", "raise SystemExit(4)"], 30))
        assert bad["status"] == "failed" and bad["exit_code"] == 4
        missing = runner.run(dc.Step("nope", ["/nonexistent/tool"], 30))
        assert missing["status"] == "failed" and "could not start" in missing["detail"]
    finally:
        runner.close()
    summary = json.loads((tmp_path / "steps.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["timeout", "ok", "failed", "failed"]
    assert summary["counts"] == {"timeout": 1, "ok": 1, "failed": 2}
    assert "hello" in (tmp_path / "log.txt").read_text()
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert tar.extractfile("device-check/hello.txt").read().strip() == b"hello"


def test_runner_skips_steps_once_the_budget_is_spent(dc, tmp_path):
    runner = dc.Runner(tmp_path, budget=dc.PACK_RESERVE_S + 1, python=sys.executable)
    try:
        rec = runner.run(dc.Step("late", [sys.executable, "-c", "pass"], 30))
    finally:
        runner.close()
    assert rec["status"] == "skipped" and "budget exhausted" in rec["detail"]
    assert rec["exit_code"] is None


def test_gpu_plan_has_every_step_the_issue_lists(dc):
    names = {s.name: s for s in dc.plan(True, [])}
    commands = {n: " ".join(s.argv) for n, s in names.items()}
    for targets in ("cpu,cuda", "cuda:tf32,cuda:no-tf32", "cuda,cuda:amp-fp16", "cuda,cuda:amp-bf16"):
        assert any(f"--model lenet --targets {targets} " in c for c in commands.values()), targets
    assert any("--model cifar_cnn --targets cuda:tf32,cpu:emulate-tf32" in c for c in commands.values())
    assert any("--model lenet --targets cuda,ddp:cuda:1 " in c for c in commands.values())  # NCCL (issue 12)
    resnet = commands["compare-resnet50-cpu_cuda"]
    assert "--targets cpu,cuda" in resnet and "--steps 3" in resnet and "--batch-size 4" in resnet
    assert all("--json" in s.argv and "--out" in s.argv for s in names.values() if s.kind == "compare")
    assert "env --json" in commands["env-json"] and commands["env-report"].startswith("{python} -m convcheck env")
    assert "-m pytest -m gpu" in commands["pytest-gpu"]
    assert commands["nvidia-smi"] == "nvidia-smi -q"
    assert sum(s.timeout for s in names.values() if s.kind == "compare") < 900
    # the bare run of the GPU-judge compare's steps, before it (issue 14, item 3)
    bare, judged = commands["bench-resnet50-bare"], commands["compare-resnet50-gpu-judge"]
    assert "benchmarks/bare_steps.py resnet50 --target cuda --steps 10 --batch-size 32" in bare
    assert "--steps 10" in judged and "--batch-size 32" in judged
    order = [s.name for s in dc.plan(True, [])]
    assert order.index("bench-resnet50-bare") < order.index("compare-resnet50-gpu-judge")
    assert ("compare-resnet50-gpu-judge", "bench-resnet50-bare") in dc.BENCH_PAIRS


# --- issue 29: which rounding TF32 uses ------------------------------------------------------------

def test_both_plans_check_the_tf32_rounding_before_the_compares(dc):
    for gpu in (True, False):
        order = [s.name for s in dc.plan(gpu, [])]
        step = next(s for s in dc.plan(gpu, []) if s.name == "tf32-rounding")
        assert step.kind == "rounding" and not step.gpu and "scripts/tf32_rounding.py" in step.argv
        assert order.index("tf32-rounding") < min(i for i, n in enumerate(order) if n.startswith("compare-"))


def _rounding_script():
    loader = importlib.machinery.SourceFileLoader("tf32_rounding", str(REPO / "scripts" / "tf32_rounding.py"))
    spec = importlib.util.spec_from_loader("tf32_rounding", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_rounding_check_names_each_emulations_rounding_element_by_element(capsys):
    script = _rounding_script()
    assert script.main(["--targets", "cpu:emulate-tf32,cpu:emulate-tf32-rz,cpu", "--size", "32"]) == 0
    report = json.loads(capsys.readouterr().out)
    s = report["summary"]
    assert s["cpu:emulate-tf32"]["1024.5 @ 1.0"] == 1025.0 and s["cpu:emulate-tf32"]["matched"] == ["RNA"]
    assert s["cpu:emulate-tf32-rz"]["1024.5 @ 1.0"] == 1024.0 and s["cpu:emulate-tf32-rz"]["matched"] == ["RZ"]
    assert s["cpu"]["1024.5 @ 1.0"] == 1024.5 and s["cpu"]["matched"] == ["float32"]
    rz = report["targets"]["cpu:emulate-tf32-rz"]["cases"]
    # the exact cases tell the roundings apart (a third of their values are ties, another third near ties)
    assert all(rz[n]["exact_fraction"]["RNE"] < 0.9 and rz[n]["exact_fraction"]["RNA"] < 0.9
               for n in rz if rz[n]["kind"] == "exact")
    # one term per output: truncation shrinks every result, ties away never does
    ties = report["targets"]["cpu:emulate-tf32"]["cases"]
    assert all(rz[n]["mean_signed_rel_error"] < 0 < ties[n]["mean_signed_rel_error"]
               for n in rz if rz[n]["kind"] == "exact")
    assert all(c["closest"] == ["RZ"] for c in rz.values() if c["kind"] == "random")


def test_the_rounding_check_refuses_a_target_it_cannot_run_in_one_line(capsys):
    script = _rounding_script()
    assert script.main(["--targets", "cpu:nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tf32_rounding: target 'cpu:nonsense': unknown mode") and err.count("\n") == 1


def test_the_digest_says_which_rounding_each_target_matched(dc):
    rec = {"name": "tf32-rounding", "kind": "rounding", "results": {
        "gpu": "NVIDIA H200", "summary": {"cuda:tf32": {"1024.5 @ 1.0": 1025.0, "matched": ["RNA"]},
                                          "cuda:no-tf32": {"1024.5 @ 1.0": 1024.5, "matched": ["float32"]}}}}
    (line,) = dc.digest([rec])
    assert line == ("tf32-rounding (NVIDIA H200): cuda:tf32 1024.5@1.0=1025 matched RNA; "
                    "cuda:no-tf32 1024.5@1.0=1024.5 matched float32")
