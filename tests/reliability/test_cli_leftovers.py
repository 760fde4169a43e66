"""Issue 47's leftovers on the command line: a model factory that leaves a non-daemon thread running does not keep
``convcheck`` alive after its report; ``convcheck`` with no command prints a short usage and the commands, not the
whole help; a mistyped command is answered with the nearest one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import TINY, run_cli

ROOT = Path(__file__).parents[2]

_THREADED = """
import threading, time
import torch.nn as nn


def build():
    threading.Thread(target=time.sleep, args=(3600,), name="users-poller").start()  # not a daemon
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
"""


@pytest.mark.slow  # ~3 s: a whole compare in a subprocess
def test_a_thread_the_users_code_leaves_running_does_not_keep_convcheck_alive(tmp_path):
    (tmp_path / "threaded.py").write_text(_THREADED)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CONVCHECK_NO_PROGRESS": "1", "NO_COLOR": "1"}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "convcheck", "compare", "--model", "threaded.py:build", *TINY,
                             "--no-save"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("convcheck compare was still running 240 s after it started: the user's thread kept "
                             "it alive") from None
    assert proc.returncode in (0, 1), err
    assert "Verdict" in out and "Traceback" not in err
    assert time.monotonic() - start < 240


def test_no_command_prints_a_short_usage_and_the_commands(capsys):
    code, out, err = run_cli(capsys, [])
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: convcheck") and len(lines) <= 12, err
    for command in ("compare", "env", "models", "targets", "record", "diff"):
        assert any(line.split()[:1] == [command] for line in lines), err


def test_a_mistyped_command_is_answered_with_the_nearest(capsys):
    code, _, err = run_cli(capsys, ["compair", "--model", "lenet"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "did you mean 'compare'?" in err
    code, _, err = run_cli(capsys, ["xyzzy"])
    assert code == 2 and "did you mean" not in err
