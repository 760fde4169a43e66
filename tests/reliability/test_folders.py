"""Run folders: unique default names, two concurrent runs leave two complete reports, --force replaces
only regular report files, a full disk leaves summary.json saying "complete": false."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convcheck.errors import RunFailed, UsageError
from convcheck.files import atomic_write_text, check_writable_file
from convcheck.report.folder import REPORT_FILES, RunFolder, default_folder_name, safe_name
from tests.reliability.conftest import run_cli, snapshot

ROOT = Path(__file__).parents[2]
RUN = ["compare", "--model", "lenet", "--steps", "1", "--batch-size", "2", "--envelope", "0"]


def test_default_names_carry_milliseconds():
    assert default_folder_name("lenet", now=0.25) == "19700101T000000.250Z-lenet"
    assert safe_name("./my models/nets.py:build") == "nets.py_build"
    assert safe_name("..") == "model"


def test_the_same_millisecond_gives_a_new_folder(tmp_path, monkeypatch):
    import convcheck.report.folder as folder

    monkeypatch.setattr(folder.time, "time", lambda: 1_800_000_000.123)
    paths = [RunFolder.default("lenet", base=tmp_path / "reports").ensure() for _ in range(3)]
    assert [p.name for p in paths] == ["20270115T080000.123Z-lenet", "20270115T080000.123Z-lenet-2",
                                       "20270115T080000.123Z-lenet-3"]


_RACE = """
import sys, time
import convcheck.report.folder as folder
folder.time.time = lambda: 1_800_000_000.123  # both processes: the same millisecond
while time.time_ns() < int(sys.argv[1]):
    pass
print(folder.RunFolder.default("lenet").ensure())
"""


def test_two_processes_in_the_same_millisecond_get_two_folders(tmp_path):
    import time

    start = str(time.time_ns() + 1_500_000_000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, start], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    names = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert len(set(names)) == 4 and all(n.startswith("reports/20270115T080000.123Z-lenet") for n in names)
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [Path(n).name for n in names]


@pytest.mark.slow
def test_two_concurrent_runs_leave_two_complete_folders(tmp_path):
    env = {**os.environ, "CONVCHECK_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT), "CONVCHECK_TEST_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "convcheck", *RUN], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    folders = sorted((tmp_path / "reports").iterdir())
    assert len(folders) == 2
    for f in folders:
        # an ok run re-runs no remedy: every report file but verify.png
        assert sorted(p.name for p in f.iterdir()) == sorted(n for n in REPORT_FILES if n != "verify.png")
        assert json.loads((f / "summary.json").read_text())["complete"] is True
    assert {str(f.relative_to(tmp_path)) for f in folders} == {e.split()[1].rsplit("/", 1)[0] for e in errs}


def test_force_replaces_the_report_files_and_nothing_else(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("old")
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, [*RUN, "--out", str(out), "--force"])
    assert code in (0, 1), err
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert (out / "notes.txt").read_text() == "mine"


def test_out_may_hold_other_files(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stdout.json").write_text("{}")  # what scripts/device-check puts there first
    code, _, err = run_cli(capsys, [*RUN, "--out", str(out)])
    assert code in (0, 1), err
    assert (out / "stdout.json").read_text() == "{}" and (out / "report.html").is_file()


def test_out_may_not_be_a_link_to_a_folder(capsys, tmp_path):
    """Issue 47: one policy for every folder convcheck writes into (compare/diff --out, convcheck.watch(out=)): a
    symbolic link is refused, never written through."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    code, _, err = run_cli(capsys, [*RUN, "--out", str(tmp_path / "link")])
    assert code == 2 and "is a symbolic link" in err and "Traceback" not in err, err
    assert (tmp_path / "link").is_symlink() and not any((tmp_path / "real").iterdir())


def test_a_failed_run_removes_only_the_folders_it_made(capsys, tmp_path):
    (tmp_path / "kept").mkdir()
    code, _, err = run_cli(capsys, ["compare", "--model", "lenet6", "--out", str(tmp_path / "kept" / "a" / "b")])
    assert code == 2
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())


def test_disk_full_while_writing_names_what_was_written(capsys, tmp_path, monkeypatch):
    import convcheck.report.export as export

    real = export.atomic_write_bytes

    def write(path, data):
        if Path(path).name == "report.html":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(export, "atomic_write_bytes", write)
    code, out, err = run_cli(capsys, [*RUN, "--out", "run"])
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "disk full writing run/report.html" in err and "wrote summary.json (complete: false)" in err
    assert "not written: report.html" in err
    assert json.loads(Path("run/summary.json").read_text())["complete"] is False
    assert "Verdict" in out  # the result was shown before the files were written


def test_save_overwrites_a_regular_file_only_with_force(capsys, tmp_path):
    target = tmp_path / "fp.json"
    target.write_text("old")
    code, _, err = run_cli(capsys, ["env", "--save", str(target)])
    assert code == 2 and target.read_text() == "old"
    code, _, err = run_cli(capsys, ["env", "--save", str(target), "--force"])
    assert code == 0 and json.loads(target.read_text())["schema"] == "convcheck.fingerprint/1"


def test_the_atomic_writer_refuses_what_it_would_replace(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    for name in ("fifo", "link"):
        with pytest.raises(UsageError):
            atomic_write_text(tmp_path / name, "x")
    assert snapshot(tmp_path) == {"fifo": snapshot(tmp_path)["fifo"], "link": ("link", str(tmp_path / "nowhere"))}
    with pytest.raises(UsageError, match="name a file"):
        check_writable_file(str(tmp_path) + os.sep, force=True, what="--save")


def test_a_full_disk_is_a_resource_error():
    from convcheck.files import write_error

    assert isinstance(write_error(OSError(errno.ENOSPC, "No space left on device"), "x"), RunFailed)
    assert isinstance(write_error(OSError(errno.EACCES, "Permission denied"), "x"), UsageError)
