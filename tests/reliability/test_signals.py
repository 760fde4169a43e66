"""Stop signals delivered to a real ``convcheck compare`` process at several points (issue 27).

The user's model (``user/stoppable.py``) writes a marker file at the chosen point and waits there; the test
waits for the marker, sends the signal, and reads the exit code, the one line and the folder left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import TINY

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")

STOPPABLE = Path(__file__).parent / "user" / "stoppable.py"
ROOT = Path(__file__).resolve().parents[2]


def _default_stop_signals() -> None:
    """The child's stop signals as a terminal's foreground command has them. A test runner started with ``nohup`` or
    in the background of a script inherits SIGHUP or SIGINT ignored, and passes that on to the child - which then,
    as convcheck should (``cli/signals.py`` keeps a signal its caller ignores), does not stop on it."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def _start(tmp_path: Path, at: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    mark = tmp_path / "mark"
    env = {**os.environ, "CC_MARK": str(mark), "CC_AT": at, "CONVCHECK_NO_PROGRESS": "1", "NO_COLOR": "1",
           "PYTHONPATH": str(ROOT)}
    # --threads 1: no thread-choice probe, whose bare steps (a number that depends on the timing) would
    # move the model's forward calls, and with them the point it waits at, out of training
    argv = [sys.executable, "-m", "convcheck", "compare", "--model", f"{STOPPABLE}:make", *TINY,
            "--steps", "3", "--threads", "1", *extra]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_stop_signals)
    while not mark.exists():  # the model reached its point (or the run ended without reaching it)
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended ({proc.returncode}) before the model waited: {err}")
        time.sleep(0.05)
    return proc, mark


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_stop_before_measuring_exits_3_and_removes_the_folder_it_made(tmp_path, sig):
    proc, _ = _start(tmp_path, "factory", "--out", "made/run")
    proc.send_signal(sig)
    code, out, err = _finish(proc)
    line = _one_line(err)
    assert code == 3, err
    assert line.startswith("convcheck: error: interrupted"), line
    if sig != signal.SIGINT:
        assert signal.Signals(sig).name in line, line
    assert not (tmp_path / "made").exists()  # both folders this run created, removed while empty


@pytest.mark.slow  # ~3 s (a whole compare up to training): the stop before measuring keeps SIGTERM in the fast suite
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_while_training_keeps_a_partial_summary(tmp_path, sig):
    proc, _ = _start(tmp_path, "18", "--out", "run")
    proc.send_signal(sig)
    code, out, err = _finish(proc)
    line = _one_line(err)
    assert code == 3, err
    assert f"interrupted ({signal.Signals(sig).name})" in line and "complete: false" in line, line
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"] is False
    assert signal.Signals(sig).name in summary["stopped"]


@pytest.mark.slow  # ~4 s: two real runs, one stopped by a signal
def test_a_stopped_run_replacing_a_report_with_force_leaves_no_file_of_the_old_one(tmp_path):
    """``--out run --force`` over a finished report, stopped while training: the folder holds the new
    run's partial summary, layers and curves only, never the old run's plots, HTML and env beside them (a
    folder describing two runs); files that are not a report's are left alone."""
    run = tmp_path / "run"
    run.mkdir()
    old = {"report.html": "<html>old</html>", "loss.png": "png", "layers.png": "png", "env.json": "{}",
           "layers.csv": "old", "summary.json": '{"complete": true}'}
    for name, text in old.items():
        (run / name).write_text(text)
    (run / "notes.txt").write_text("mine")
    proc, _ = _start(tmp_path, "18", "--out", "run", "--force")
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    assert code == 3 and "complete: false" in _one_line(err), err
    assert sorted(os.listdir(run)) == ["curves.csv", "layers.csv", "notes.txt", "summary.json"]
    assert (run / "layers.csv").read_text() != "old"  # the new run's one-step check, measured before the stop
    assert json.loads((run / "summary.json").read_text())["complete"] is False
    assert (run / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_three_ctrl_c_in_a_row_still_exit_3_with_one_line(tmp_path):
    proc, _ = _start(tmp_path, "18", "--out", "run")
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc)
    line = _one_line(err)
    assert code == 3, err
    assert line.startswith("convcheck: error: interrupted"), line
    run = tmp_path / "run"
    assert not run.exists() or json.loads((run / "summary.json").read_text())["complete"] is False


@pytest.mark.slow
def test_an_ignored_hangup_stays_ignored(tmp_path):
    """``nohup convcheck ...``: SIGHUP was ignored by the caller and convcheck leaves it so."""
    mark = tmp_path / "mark"
    env = {**os.environ, "CC_MARK": str(mark), "CC_AT": "5", "CONVCHECK_NO_PROGRESS": "1", "NO_COLOR": "1",
           "PYTHONPATH": str(ROOT)}
    code = ("import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
            "from convcheck.cli.main import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", code, "compare", "--model", f"{STOPPABLE}:make", *TINY,
                             "--no-save"], cwd=tmp_path, env={**env, "CC_AT": "factory"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)  # ignored: the model's wait goes on until TERM
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    assert code == 3 and "interrupted (SIGTERM)" in _one_line(err), err


@pytest.mark.slow  # ~5 s: a whole run, then the signal
def test_a_ctrl_c_after_the_report_is_written_changes_nothing(tmp_path):
    env = {**os.environ, "CONVCHECK_NO_PROGRESS": "1", "NO_COLOR": "1", "PYTHONPATH": str(ROOT), "CC_AT": ""}
    proc = subprocess.run([sys.executable, "-m", "convcheck", "compare", "--model",
                           f"{STOPPABLE}:make_then_ctrl_c_at_exit", *TINY, "--out", "run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    assert "interrupted" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["complete"] is True
