"""`convcheck env` as a user runs it: the messages they read and the exit codes scripts see."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from convcheck.cli.main import main
from convcheck.env import audit, load
from convcheck.report.env_text import print_env, render_env

DATA = Path(__file__).parents[1] / "data" / "env"


def run(capsys, *argv):
    code = main(["env", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_this_machine_says_no_gpu_and_cpu_only(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert "No NVIDIA GPU found" in out
    assert "is a CPU-only build" in out
    assert "Only CPU targets can run here" in out
    assert "data-parallel ddp:cpu:N" in out  # which runs here too (new-user trial 5)
    assert "Findings: none." in out
    assert out.index("Findings") < out.index("Stack")


@pytest.mark.parametrize("name,code,rule", [
    ("rtx3090_cu102.json", 1, "ARCH001"),
    ("driver470_cu121.json", 1, "DRV001"),
    ("rtx5090_cu124.json", 1, "ARCH001"),
    ("cpu_build_with_gpu.json", 1, "CUDA001"),
    ("a100_tf32.json", 0, "MATH001"),
    ("h100_healthy.json", 0, "MATH001"),
    ("collect_env_old_torch1.3.1_titanxp.txt", 1, "DRV001"),
    ("collect_env_torch1.7.1_cu110_titanxp.txt", 1, "BLAS001"),
    ("collect_env_new_torch2.4.0_cu121_wsl.txt", 0, "MATH001"),
    ("collect_env_new_torch2.6.0_cu124_rtx5090.txt", 1, "ARCH001"),
])
def test_from_file_exit_code_and_finding(capsys, name, code, rule):
    rc, out, _ = run(capsys, "--from", str(DATA / name))
    assert rc == code
    assert rule in out and "fix:" in out and "source:" in out


def test_critical_findings_come_first_with_their_remedy(capsys):
    _, out, _ = run(capsys, "--from", str(DATA / "driver470_cu121.json"))
    findings = out[out.index("Findings"):out.index("Stack")]
    assert findings.index("CRITICAL DRV001") < findings.index("WARN     CUDA002") < findings.index("INFO")
    assert "Upgrade the driver to 530.30.02 or newer" in " ".join(findings.split())
    # why not the 525.60.13 the finding calls the minimum for CUDA 12.x (new-user trial 5)
    assert ("(CUDA 12.1's own minimum; 525.60.13 would run it in minor-version compatibility mode)"
            in " ".join(findings.split()))


def test_report_shows_the_stack_and_an_anonymised_gpu_id(capsys):
    _, out, _ = run(capsys, "--from", str(DATA / "h100_healthy.json"))
    stack = " ".join(out[out.index("Stack"):].split())
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0, 80 GiB, id uuid:" in stack
    assert "ECC on" in stack and "PCIe gen5 x16 (max gen5 x16)" in stack and "clocks: idle" in stack
    assert "GPU-" not in out


def test_json_output(capsys):
    rc, out, _ = run(capsys, "--from", str(DATA / "rtx5090_cu124.json"), "--json")
    data = json.loads(out)
    assert rc == 1 and data["schema"] == "convcheck.env/1"
    assert data["fingerprint"]["schema"] == "convcheck.fingerprint/1"
    first = data["findings"][0]
    assert first["id"] == "ARCH001" and first["severity"] == "critical" and first["kind"] == "version"


def test_json_on_this_machine(capsys):
    rc, out, _ = run(capsys, "--json")
    data = json.loads(out)
    assert rc == 0 and data["findings"] == [] and data["fingerprint"]["gpus"] == []
    assert data["fingerprint"]["torch"]["cuda"] is None


def test_against_shows_numerics_differences(capsys):
    rc, out, _ = run(capsys, "--from", str(DATA / "h100_healthy.json"), "--against", str(DATA / "a100_tf32.json"))
    assert rc == 0
    diff = out[out.index("Differences that matter for numerics"):]
    assert "TF32 in effect" in diff and "on for conv  ->  on for matmul and conv" in diff
    assert "cuDNN" in diff and "9.7.1  ->  9.1.0" in diff
    assert out.count("convcheck env:") == 2  # both machines get their own findings and stack


def test_against_without_from_compares_this_machine(capsys):
    rc, out, _ = run(capsys, "--against", str(DATA / "rtx5090_cu124.json"))
    assert rc == 1  # the other machine has a critical finding
    assert "convcheck env: this machine" in out
    assert "torch CUDA build" in out and "CPU-only  ->  12.4" in out


def test_against_json(capsys):
    _, out, _ = run(capsys, "--from", str(DATA / "h100_healthy.json"), "--against",
                    str(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt"), "--json")
    data = json.loads(out)
    fields = {d["field"] for d in data["against"]["differences"]}
    assert {"torch", "GPUs", "driver"} <= fields
    assert data["against"]["fingerprint"]["math"]["recorded"] is False


def test_save_writes_a_loadable_fingerprint(capsys, tmp_path):
    target = tmp_path / "machine.json"
    rc, out, _ = run(capsys, "--save", str(target))
    assert rc == 0 and f"fingerprint saved to {target}" in out
    assert load(target).torch.cpu_only
    assert [p.name for p in tmp_path.iterdir()] == ["machine.json"]


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    ("{broken", "invalid JSON"),
    ("just some text", "neither a convcheck fingerprint"),
])
def test_unreadable_input_exits_2_with_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_text(content)
    rc, out, err = run(capsys, "--from", str(path))
    assert rc == 2 and out == ""
    assert err.startswith("convcheck: error:") and message in err and err.count("\n") == 1


def test_unreadable_against_exits_2(capsys, tmp_path):
    rc, _, err = run(capsys, "--against", str(tmp_path / "missing.json"))
    assert rc == 2 and "cannot read" in err


def test_plain_text_when_not_a_terminal_or_no_color(monkeypatch):
    fp = load(DATA / "rtx5090_cu124.json")
    text = render_env(fp, audit(fp))

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    tty = Tty()
    print_env(text, tty)
    assert "\x1b[" in tty.getvalue() and "ARCH001" in tty.getvalue()

    monkeypatch.setenv("NO_COLOR", "1")
    tty = Tty()
    print_env(text, tty)
    assert tty.getvalue() == text

    monkeypatch.delenv("NO_COLOR")
    pipe = io.StringIO()
    print_env(text, pipe)
    assert pipe.getvalue() == text
