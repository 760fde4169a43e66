"""What makes ``convcheck.watch`` cheap (issue 25) keeps its numbers right: the fast statistics, the
snapshot that stores a tensor once, the size cap, settings from the environment, bounded per-step state,
and a run killed mid-way."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.errors import UsageError
from convcheck.watch import stats
from convcheck.runformat.reader import open_watched

from .loops import dataset


def _reference(t: torch.Tensor) -> dict:
    """The statistics the slow, obvious way, in float64 over the finite values."""
    x = t.detach().double().flatten()
    fin = x[torch.isfinite(x)]
    nz = fin[fin != 0].abs()
    return {"n": t.numel(), "sum": fin.sum().item(), "max_abs": fin.abs().max().item() if fin.numel() else 0.0,
            "min_nonzero": nz.min().item() if nz.numel() else None, "zeros": int((fin == 0).sum()),
            "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}


@pytest.mark.parametrize("chunk", [stats.CHUNK, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_statistics_are_exact_on_every_kind_of_tensor(dtype, chunk, monkeypatch):
    """Exact on whole tensors and through the reused buffer a large tensor is measured in (its chunks
    made 7 elements long here, so that the test's tensors take that path)."""
    monkeypatch.setattr(stats, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 20, generator=g)
    late = torch.full((40,), 3.0)
    late[33] = 2.0**-9  # the smallest nonzero magnitude in the last chunk, zeros in the first
    late[:5] = 0.0
    cases = [x, x.relu(), -x.relu(), x.t(), x[:, ::3], x * (torch.rand(30, 20, generator=g) > 0.5), late, -late,
             torch.zeros(5), torch.tensor([0.0, -0.0, 3.0]), torch.tensor([-1.0, -0.0, -3.0]),
             torch.tensor([-0.0, 0.0, 3.0, 2.0**-14]), torch.tensor([0.0, -0.0]), torch.tensor([-0.0, -2.0, 0.0]),
             torch.tensor([2.0**-20, 0.0, 5.0]), torch.tensor([float("nan"), 0.0, 1.0]),
             torch.tensor([float("inf"), -1.0, 0.0]), torch.tensor([])]
    if dtype in (torch.float32, torch.float64):
        cases.append(torch.tensor([1e-40, -3e-42, 0.0, 5.0]))  # subnormals: the smallest nonzero is one
    for c in cases:
        c = c.to(dtype)
        got, ref = stats.measure(c), _reference(c)
        for key in ("n", "max_abs", "min_nonzero", "zeros", "nan", "inf"):
            assert got[key] == ref[key], (key, c)
        assert math.isclose(got["sum"], ref["sum"], rel_tol=1e-3, abs_tol=1e-3), c


def test_the_reused_buffer_is_a_plain_cpu_tensor_whatever_mode_made_it(monkeypatch):
    """Made first under inference mode (an evaluation inside the watched block) or with another default
    device, the buffer still serves a large CPU tensor of a training step afterwards."""
    monkeypatch.setattr(stats, "_scratch", type(stats._scratch)())
    monkeypatch.setattr(stats, "CHUNK", 64)
    x = torch.randn(1000).relu()
    with torch.inference_mode():
        first = stats.measure(x)
    again = stats.measure(x)
    assert first["zeros"] == again["zeros"] == int((x == 0).sum())
    monkeypatch.setattr(stats, "_scratch", type(stats._scratch)())
    torch.set_default_device("meta")
    try:
        got = stats.measure(x)
    finally:
        torch.set_default_device("cpu")
    assert got["zeros"] == int((x == 0).sum()) and got["min_nonzero"] == float(x[x > 0].min())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True)
        self.fc = nn.Linear(6 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(self.relu(self.bn(self.conv(x))).flatten(1))


def _loop(out, steps=3, **kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, **kw) as w:
        for _ in range(steps):
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    return w


def test_a_snapshot_stores_a_tensor_seen_twice_once_and_reads_back_every_key(tmp_path):
    _loop(tmp_path / "run")
    run = open_watched(tmp_path / "run")
    entry = run["snapshots"][0]
    aliases = {a["key"]: a["same_as"] for a in entry["arrays"] if "same_as" in a}
    assert aliases["in/bn/0/0"] == "out/conv/0/0"  # the conv's output is the batch norm's input
    assert aliases["out/relu/0/0"] == "in/relu/0/0"  # in place: the ReLU's input is its output
    import zipfile

    with zipfile.ZipFile(tmp_path / "run" / entry["file"]) as z:
        assert len(z.namelist()) == len(entry["arrays"]) - len(aliases)
    snap = run.snapshot(0)
    assert set(snap) == {a["key"] for a in entry["arrays"]}
    assert (snap["in/bn/0/0"] == snap["out/conv/0/0"]).all()
    assert (snap["out/relu/0/0"] >= 0).all() and not (snap["out/bn/0/0"] >= 0).all()  # the bn's own value


def test_a_snapshot_whose_parameters_pass_the_cap_is_skipped_whole_with_one_warning(tmp_path, capsys):
    """Past the budget calls are let go (issue 48); a step whose parameters and gradients alone pass it is skipped."""
    w = _loop(tmp_path / "run", steps=3, max_bytes=20_000)  # the per-step records fit, the snapshot does not
    err = capsys.readouterr().err
    assert err.count("snapshot of step 0") == 1
    assert "not written: its parameters and gradients alone pass its budget" in err and "max_bytes=20000" in err
    run = open_watched(tmp_path / "run")
    assert run["steps"] == 3 and run["snapshots"] == [] and run.snapshot(0) is None
    (skipped,) = run["skipped_snapshots"]
    assert skipped["step"] == 0 and skipped["bytes"] > 0 and "max_bytes" in skipped["reason"]
    # never a half-written file (the model kept by value, issue 43, is not a snapshot)
    assert [f for f in os.listdir(tmp_path / "run" / "snapshots") if not f.startswith(("model.pkl", "script.py"))] == []
    assert w.taker is None or not w.taker.arrays


def test_snapshot_steps_and_the_cap_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVCHECK_SNAPSHOT_STEPS", "1, 2")
    _loop(tmp_path / "run", steps=3, snapshot_steps=(0,))
    run = open_watched(tmp_path / "run")
    assert [s["step"] for s in run["snapshots"]] == [1, 2]
    assert run["settings_from_env"] == {"snapshot_steps": [1, 2]}
    monkeypatch.setenv("CONVCHECK_WATCH_MAX_BYTES", "2MiB")
    assert convcheck.watch(nn.Linear(2, 2), out=tmp_path / "x").max_bytes == 2 * 2**20
    for var, value in (("CONVCHECK_SNAPSHOT_STEPS", "0;10"), ("CONVCHECK_SNAPSHOT_STEPS", "-1"),
                       ("CONVCHECK_WATCH_MAX_BYTES", "lots"), ("CONVCHECK_WATCH_MAX_BYTES", "0")):
        monkeypatch.setenv(var, value)
        with pytest.raises(UsageError, match=f"^{var}=") as e:
            convcheck.watch(nn.Linear(2, 2), out=tmp_path / "y")
        assert "\n" not in str(e.value)
        monkeypatch.delenv(var)


def test_nothing_accumulates_per_step(tmp_path):
    """Memory bounded: after the snapshot step, the watch's own state is the same size at step 5 and 40."""
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = dataset().tensors
    sizes = {}

    def size(w):
        return sum(len(v) for v in vars(w).values() if isinstance(v, (list, dict, set)))

    threads = torch.get_num_threads()
    with convcheck.watch(model, opt, out=tmp_path / "run") as w:
        for i in range(40):
            loss = nn.functional.cross_entropy(model(x[i % 60:i % 60 + 4]), y[i % 60:i % 60 + 4])
            assert torch.get_num_threads() == threads  # the watch never changes the thread count
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            sizes[i] = size(w)
    assert sizes[5] == sizes[39] and w.steps_file.closed
    assert open_watched(tmp_path / "run")["steps"] == 40


KILLED = textwrap.dedent("""
    import sys, time, torch, torch.nn as nn
    import convcheck
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=sys.argv[1]) as w:
        for step in range(10**6):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 10)), torch.randint(0, 2, (4,)))
            opt.zero_grad(); loss.backward(); opt.step(); w.step(loss)
            if step == 3:
                print("ready", flush=True)
                time.sleep(600)
""")


@pytest.mark.slow  # ~5 s: a process really killed mid-run
def test_a_run_killed_mid_way_is_refused_by_diff_never_diagnosed(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for name in ("a", "b"):
        p = subprocess.Popen([sys.executable, str(script), str(tmp_path / name)], stdout=subprocess.PIPE,
                             env=env, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        assert p.returncode == -signal.SIGKILL
        assert json.loads((tmp_path / name / "manifest.json").read_text())["complete"] is False
        assert len((tmp_path / name / "steps.jsonl").read_text().splitlines()) == 4  # a readable prefix
    code = main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--no-save"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "is incomplete" in err
