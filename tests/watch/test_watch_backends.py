"""Issue 43, item 6: a compiled run that differs from eager is bisected backend by backend. On torch 2.13's CPU
inductor, pytorch/examples' MNIST CNN at batch 64 gets its first convolution's weight gradient exactly 0; eager
and aot_eager give ~0.03. The bisection names inductor and writes a repro that shows it when run alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.analysis.backends import bisect_backends
from convcheck.report.verdict_lines import unwrapped
from convcheck.runformat.reader import open_watched


SCRIPT = '''
"""A user's script: pytorch/examples' mnist Net (dropout left out: the difference shows with or without it),
compiled with inductor, watched."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), 1)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Net()
    compiled = model if sys.argv[2:] == ["eager"] else torch.compile(model, backend="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with convcheck.watch(compiled, opt, out=sys.argv[1]) as w:
        for _ in range(2):
            x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
            loss = F.nll_loss(compiled(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
'''


def _compiled_run(tmp_path, name: str = "run", *how: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    subprocess.run([sys.executable, "train.py", str(tmp_path / name), *how], cwd=tmp_path, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})


def _inductor_works() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("clang++") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_works(), reason="inductor needs a C++ compiler")
def test_an_inductor_gradient_of_zero_is_bisected_to_inductor_with_a_repro(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "config"))
    _compiled_run(tmp_path)
    b = bisect_backends(open_watched(tmp_path / "run"))
    if b.first is None:
        pytest.skip(f"this torch's inductor ({torch.__version__}) does not reproduce the difference: {b.lines()}")
    assert b.first == "inductor" and set(b.ran) >= {"eager", "aot_eager", "inductor"}
    assert any(d.startswith("conv1.weight's gradient") and "exactly 0" in d for d in b.differs["inductor"])
    code = main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64", "--backends", "--out", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    assert "inductor is the first to change the result: conv1.weight's gradient" in out
    assert code in (1, 5)  # the verdict is the judge's; the bisection is evidence beside it
    repro = tmp_path / "rep" / "repro_backends.py"
    assert repro.is_file() and (tmp_path / "rep" / "repro_backends.pt").is_file()
    shown = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": ""})
    assert shown.returncode == 0, shown.stderr[-2000:]
    line = next(x for x in shown.stdout.splitlines() if x.startswith("conv1.weight "))
    values = dict(kv.split("=") for kv in line.split()[1:])
    assert float(values["inductor"]) == 0.0 and float(values["eager"]) > 0 and float(values["aot_eager"]) > 0


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_works(), reason="inductor needs a C++ compiler")
def test_an_eager_run_against_its_inductor_twin_names_the_zero_gradient_as_the_kernels_not_underflow(tmp_path, capsys,
                                                                                                   monkeypatch):
    """Issue 43: neither run computes in a 16-bit format, so an exactly-zero gradient is no underflow: the layer's
    compiled kernels compute something else, and the remedy is to bisect the compiler's backends."""
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "config"))
    _compiled_run(tmp_path, "eager", "eager")
    _compiled_run(tmp_path, "inductor")
    if bisect_backends(open_watched(tmp_path / "inductor")).first is None:
        pytest.skip(f"this torch's inductor ({torch.__version__}) does not reproduce the difference")
    code = main(["diff", str(tmp_path / "eager"), str(tmp_path / "inductor")])
    out = capsys.readouterr().out
    assert code == 1
    verdict = unwrapped(out)
    assert "verdict: layer: conv1.weight's gradient is exactly zero at step 0 in B where A's is not" in verdict
    assert "bf16" not in verdict and "bfloat16" not in verdict
    assert "convcheck diff A B --backends" in verdict


def test_an_eager_run_is_not_bisected(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CONVCHECK_CONFIG_DIR", str(tmp_path / "config"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        w.step(loss)
    assert bisect_backends(open_watched(tmp_path / "run")).note == "the run was not compiled (torch.compile)"
    main(["diff", str(tmp_path / "run"), "--judge", "cpu:float64", "--backends", "--no-save", "--json"])
    assert json.loads(capsys.readouterr().out)["backends"] == {}
