"""Issue 47: ``convcheck.watch``'s own inputs. Every public argument and every ``CONVCHECK_WATCH_*`` /
``CONVCHECK_SNAPSHOT_STEPS`` variable fed the wrong kind, unicode digits, empty, huge and negative values is one
``UsageError`` line naming the argument or variable (or a value taken as documented); nothing is written outside
the run folder, nothing of an earlier run there is destroyed. Two and four processes racing on one folder with
``force=True``: one run whole, every other told in one line that the folder is taken."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.errors import UsageError
from convcheck.watch.selection import MAX_STEP, selection
from tests.reliability.conftest import snapshot

ROOT = Path(__file__).parents[2]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _loop(out, n: int = 2, **kwargs) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with convcheck.watch(model, opt, out=out, **kwargs):
        for _ in range(n):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 3, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.fixture
def earlier(tmp_path):
    """An earlier watched run in ``run/`` and a bystander file beside it: what must survive a refused call."""
    _loop(tmp_path / "run")
    (tmp_path / "keep.txt").write_text("the user's own file\n")
    return tmp_path


def _refused(tmp_path, call, name: str) -> str:
    """``call()`` raises one ``UsageError`` line naming ``name``; the folder tree is as it was."""
    before = snapshot(tmp_path)
    with pytest.raises(UsageError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and name in message, message
    assert snapshot(tmp_path) == before
    return message


# --- the environment's selections (the cases seen) -------------------------------------------------------


@pytest.mark.parametrize("var, value", [("CONVCHECK_WATCH_STEPS", "²"), ("CONVCHECK_WATCH_EVERY", "²"),
                                        ("CONVCHECK_SNAPSHOT_STEPS", "²"), ("CONVCHECK_WATCH_MAX_BYTES", "²"),
                                        ("CONVCHECK_WATCH_STEPS", "0-²"), ("CONVCHECK_WATCH_STEPS", "٣")])
def test_unicode_digits_in_a_variable_are_one_line_naming_it(earlier, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    _refused(earlier, lambda: _loop(earlier / "run", force=True), var)


def test_a_huge_every_is_echoed_as_given_not_none(monkeypatch):
    monkeypatch.setenv("CONVCHECK_WATCH_EVERY", "9" * 40)
    with pytest.raises(UsageError) as info:
        selection()
    assert "9" * 20 in str(info.value) and "None" not in str(info.value)


def test_an_open_window_is_every_step_from_its_start(tmp_path, monkeypatch):
    """``CONVCHECK_WATCH_STEPS='1-'`` recorded step 1 only, silently; it is step 1 on."""
    from convcheck.runformat.reader import open_watched

    monkeypatch.setenv("CONVCHECK_WATCH_STEPS", "1-")
    assert selection()[0].steps == ((1, MAX_STEP),)
    _loop(tmp_path / "run", n=4)
    steps = open_watched(tmp_path / "run").steps
    assert [s.get("layers_recorded", True) for s in steps] == [False, True, True, True]


# --- arguments of the wrong kind ------------------------------------------------------------------------


def test_steps_given_a_count_is_one_line_naming_steps(earlier):
    message = _refused(earlier, lambda: _loop(earlier / "run", force=True, steps=5), "steps=5")
    assert "range(5)" in message


def test_scaler_given_the_class_is_one_line_naming_scaler(earlier):
    message = _refused(earlier, lambda: _loop(earlier / "run", force=True, scaler=torch.amp.GradScaler), "scaler=")
    assert "instance" in message


WRONG = {  # every public argument of convcheck.watch, fed what it does not take
    "model": [None, 5, "model", Tiny, [Tiny()]],
    "optimizer": [5, "sgd", torch.optim.SGD],
    "out": [None, 5, 2.5, b"run", "", "   ", "run\0x", ["run"]],
    "scaler": [5, "scaler", torch.amp.GradScaler, object()],
    "snapshot_steps": [5, 2.5, "²", "-1", [-1], [2.5], [True], ["x"], [10**12], {"a": 1}, range(-3, 2),
                       range(10**9)],
    "snapshot_nonfinite": [None, 1, "yes", 2.5],
    "max_bytes": [0, -1, 2.5, "500M", None, True, 10**6 * 1.0],
    "force": [None, 1, "yes", 2.5],
    "layers": [5, 2.5, "", ",", [], [5], {"fc1": 1}, ["x" * 300], "no_such_layer"],
    "steps": [5, -1, 2.5, "", "²", "٣", "-5", "5-2", "1-2-3", "x", [-1], [2.5], [True], range(0), range(0, 10, 2),
              range(-2, 3), str(10**12), 10**30, b"0-9"],
    "every": [0, -1, 2.5, "", "²", "٣", "x", None, True, 10**30, "9" * 40, [2]],
    "sync": [None, 5, "", "fast", ["step"], b"step"],
}
CASES = [(arg, value) for arg, values in WRONG.items() for value in values]


def _call(tmp_path, arg, value):
    torch.manual_seed(0)
    model = Tiny()
    kwargs = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "out": tmp_path / "run", "force": True}
    if arg == "model":
        model = value
    else:
        kwargs[arg] = value
    optimizer = kwargs.pop("optimizer")
    with convcheck.watch(model, optimizer, **kwargs):
        pass


@pytest.mark.parametrize("arg, value", CASES, ids=[f"{a}={v!r:.20}" for a, v in CASES])
def test_every_argument_of_the_wrong_kind_is_one_line_naming_it(earlier, arg, value):
    _refused(earlier, lambda: _call(earlier, arg, value), "layers pattern" if value == "no_such_layer" else arg)


VARIABLES = {
    "CONVCHECK_WATCH_STEPS": ["", " ", "²", "٣", "-1", "x", "5-2", "1-2-3", ",", str(10**12), "9" * 40, "0x10"],
    "CONVCHECK_WATCH_EVERY": ["", " ", "0", "²", "٣", "-1", "x", "2.5", str(10**12), "9" * 40, "0x10"],
    "CONVCHECK_WATCH_LAYERS": ["", ",", " , ", "no_such_layer", "x" * 300],
    "CONVCHECK_WATCH_SYNC": ["", "fast", "²", "-1"],
    "CONVCHECK_SNAPSHOT_STEPS": ["²", "٣", "-1", "x", "1-3", str(10**12), "9" * 40, "1,,2"],
    "CONVCHECK_WATCH_MAX_BYTES": ["", "0", "²", "٣", "-1", "x", "1.5G", "9" * 40, "5X"],
}
ENV_CASES = [(var, value) for var, values in VARIABLES.items() for value in values]


@pytest.mark.parametrize("var, value", ENV_CASES, ids=[f"{a}={v!r:.20}" for a, v in ENV_CASES])
def test_every_variable_of_the_wrong_kind_is_one_line_naming_it(earlier, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    _refused(earlier, lambda: _loop(earlier / "run", force=True),
             "layers pattern" if value == "no_such_layer" else var)


@pytest.mark.parametrize("var, value, field, expected", [
    ("CONVCHECK_WATCH_STEPS", " 0-1 , 3 ", "steps", ((0, 1), (3, 3))),
    ("CONVCHECK_WATCH_STEPS", "2-", "steps", ((2, MAX_STEP),)),
    ("CONVCHECK_WATCH_EVERY", str(MAX_STEP), "every", MAX_STEP),
    ("CONVCHECK_WATCH_SYNC", " Step ", "sync", "step")])
def test_good_values_are_taken_as_documented(monkeypatch, var, value, field, expected):
    monkeypatch.setenv(var, value)
    assert getattr(selection()[0], field) == expected


# --- two writers, one folder ------------------------------------------------------------------------------

_RACER = """
import sys, time
import torch, torch.nn as nn
import convcheck
from convcheck.errors import UsageError
from tests.reliability.test_watch_inputs import Tiny

start, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = Tiny()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
while time.time_ns() < start:
    pass
try:
    with convcheck.watch(model, opt, out=out, force=True):
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 3, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.3)  # the others start while this one writes
except UsageError as exc:
    print(f"convcheck: error: {exc}", file=sys.stderr)
    sys.exit(2)
print("recorded")
"""


@pytest.mark.slow  # two writers ~5 s, four ~6 s: the slow pass (the README's command stays under 3 minutes)
@pytest.mark.parametrize("n", [2, 4])
def test_racing_writers_with_force_one_run_whole_the_others_told(earlier, n):
    from convcheck.runformat.reader import open_watched

    start = str(time.time_ns() + 3_000_000_000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, start, str(earlier / "run")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    for code, out, err in results:
        assert "Traceback" not in err and "FileNotFoundError" not in err, err
        assert (code, out.strip()) == (0, "recorded") or (code == 2 and len(err.strip().splitlines()) == 1
                                                         and "is taken" in err), (code, out, err)
    assert any(code == 0 for code, _, _ in results)
    run = open_watched(earlier / "run")  # whole: complete, every hash checked
    assert len(run.steps) == 3
    assert (earlier / "keep.txt").read_text() == "the user's own file\n"


def test_a_second_watch_in_this_process_is_refused_and_the_first_stays_whole(earlier):
    from convcheck.runformat.reader import open_watched

    torch.manual_seed(0)
    first, second = Tiny(), Tiny()
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    with convcheck.watch(first, opt, out=earlier / "run", force=True):
        with pytest.raises(UsageError, match="is taken"):
            with convcheck.watch(second, torch.optim.SGD(second.parameters(), lr=0.1), out=earlier / "run",
                                 force=True):
                pass
        loss = nn.functional.cross_entropy(first(torch.randn(4, 4)), torch.randint(0, 3, (4,)))
        loss.backward()
        opt.step()
    assert len(open_watched(earlier / "run").steps) == 1
    _loop(earlier / "run", force=True)  # the folder let go at the block's end: a later watch takes it


# --- one policy for a symlinked output folder ---------------------------------------------------------------


def test_the_watch_and_diff_out_refuse_a_linked_folder_alike(earlier, capsys):
    """Issue 47: ``diff --out`` wrote through a symlinked folder while the watch refused one: both refuse it."""
    from tests.reliability.conftest import run_cli

    (earlier / "real").mkdir()
    (earlier / "link").symlink_to(earlier / "real")
    watch_error = _refused(earlier, lambda: _loop(earlier / "link"), "is a symbolic link")
    before = snapshot(earlier)
    code, out, err = run_cli(capsys, ["diff", str(earlier / "run"), str(earlier / "run"), "--out",
                                      str(earlier / "link")])
    assert code == 2 and "is a symbolic link" in err and "Traceback" not in err, err
    assert snapshot(earlier) == before
    assert watch_error.split("is a symbolic link")[1] == err.strip().split("is a symbolic link")[1]


# --- the data-parallel variables -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", " ", "²", "٣", "-1", "0", "x", "inf", "nan", "1e400", "9" * 40])
def test_a_bad_ddp_timeout_is_one_line_naming_it(monkeypatch, value):
    """``CONVCHECK_DDP_TIMEOUT='inf'`` overflowed torch's timedelta; '²', '-1' fell back to 300 s silently."""
    from convcheck.ddp.rank_pool import collective_timeout

    monkeypatch.setenv("CONVCHECK_DDP_TIMEOUT", value)
    with pytest.raises(UsageError, match="CONVCHECK_DDP_TIMEOUT") as info:
        collective_timeout()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value, expected", [("2", 2.0), (" 0.5 ", 0.5), ("300", 300.0)])
def test_a_good_ddp_timeout_is_taken(monkeypatch, value, expected):
    from convcheck.ddp.rank_pool import collective_timeout

    monkeypatch.setenv("CONVCHECK_DDP_TIMEOUT", value)
    assert collective_timeout() == expected


@pytest.mark.parametrize("value", ["spwan", "²", "1", "thread"])
def test_a_bad_ddp_start_is_one_line_naming_it(monkeypatch, value):
    from convcheck.ddp.rank_pool import start_method
    from convcheck.targets.spec import Target

    monkeypatch.setenv("CONVCHECK_DDP_START", value)
    with pytest.raises(UsageError, match="CONVCHECK_DDP_START"):
        start_method(Target.parse("ddp:cpu:2"))


# --- a watched run's manifest altered, field by field ------------------------------------------------------


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("watched")
    for name in ("A", "B"):
        _loop(tmp / name, n=3)
    return tmp


def _other_values(value):
    if isinstance(value, bool):
        return [not value, "yes"]
    if isinstance(value, (int, float)):
        return [-1, 1e308, "1"]
    if isinstance(value, str):
        return ["", value[::-1] + "x", 5]
    if isinstance(value, list):
        return [[], value[:1] * 3, {"a": 1}]
    if isinstance(value, dict):
        return [{}, [], {"x": 1}]
    return [5, "x", []]


def _fields():
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        _loop(Path(d) / "run", n=1)
        return sorted(json.loads((Path(d) / "run" / "manifest.json").read_text()))


@pytest.mark.parametrize("field", _fields())
def test_every_watched_manifest_field_altered_no_traceback_nothing_written(two_runs, tmp_path, capsys, field):
    """Issue 47's family: each field of a watched run's manifest altered (and removed), one at a time: ``diff``
    answers (exit 0/1) or refuses in one line (exit 2), never a traceback; nothing outside --out is written."""
    import json
    import shutil

    from tests.reliability.conftest import run_cli

    original = json.loads((two_runs / "A" / "manifest.json").read_text())
    for i, value in enumerate([*_other_values(original[field]), None, "<removed>"]):
        run = tmp_path / f"A{i}"
        shutil.copytree(two_runs / "A", run)
        m = dict(original)
        if value == "<removed>":
            del m[field]
        else:
            m[field] = value
        (run / "manifest.json").write_text(json.dumps(m))
        before = snapshot(tmp_path)
        code, _, err = run_cli(capsys, ["diff", str(run), str(two_runs / "B"), "--out", str(tmp_path / f"r{i}")])
        assert "Traceback" not in err and code in (0, 1, 2), (field, value, code, err)
        if code == 2:
            assert len(err.strip().splitlines()) == 1, (field, value, err)
        assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(f"r{i}")} == before, (field, value)
