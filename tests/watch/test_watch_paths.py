"""``convcheck diff`` and ``convcheck.watch`` given bad paths (a new user's trial): one line each, exit 2, and
the user's runs and scripts left alone; a script without a main guard is never imported (never re-run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import convcheck
from convcheck.cli.main import main
from convcheck.errors import UsageError

from .loops import offset_run


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tree(path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paths")
    offset_run(tmp / "fp32")
    offset_run(tmp / "bf16", bf16=True)
    # a report folder of `convcheck compare --out report`: not a run
    assert main(["compare", "--steps", "1", "--batch-size", "2", "--envelope", "0", "--targets", "cpu,cpu:bf16",
                 "--judge", "cpu:float64", "--out", str(tmp / "report")]) in (0, 1)
    assert (tmp / "report" / "summary.json").is_file()
    return tmp


# --- 1. --out ----------------------------------------------------------------------------------------

def test_diff_out_refuses_a_file_a_device_an_impossible_folder_and_a_link(runs, tmp_path, capsys):
    capsys.readouterr()
    script = tmp_path / "mynet.py"
    script.write_text("print('my model')\n")
    link = tmp_path / "link"
    link.symlink_to(script)
    cases = [(script, "exists and is not a directory (it is a file)"),
             (os.devnull, "exists and is not a directory (it is a character device)"),
             (link, "exists and is not a directory (it is a symbolic link)")]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/nope", "--out /proc/nope: cannot create directory"))
    before = tree(runs)
    for out, message in cases:
        for args in ([runs / "fp32", runs / "bf16"], [runs / "fp32", "--judge", "cpu:float64"]):
            code, stdout, err = run_cli(capsys, *args, "--out", out)
            assert code == 2 and stdout == "" and message in one_line(err), (out, err)
    assert script.read_text() == "print('my model')\n" and link.is_symlink()
    assert tree(runs) == before
    assert not os.path.exists("/proc/nope")


def test_diff_out_never_writes_into_a_watched_run(runs, capsys):
    capsys.readouterr()
    before = tree(runs)
    for out, message in ((runs / "bf16", "that folder is a watched run (convcheck.watch); diff never writes into a run"),
                         (runs / "fp32" / "snapshots", f"that folder is inside the run {runs / 'fp32'}"),
                         (runs / "bf16" / "reports", f"that folder is inside the run {runs / 'bf16'}")):
        code, stdout, err = run_cli(capsys, runs / "fp32", runs / "bf16", "--out", out, "--force")
        assert code == 2 and stdout == "" and message in one_line(err)
    code, _, err = run_cli(capsys, runs / "fp32", "--judge", "cpu:float64", "--out", runs / "fp32")
    assert code == 2 and "diff never writes into a run" in one_line(err)
    # nor into a run that is not being diffed: through a link to it, or in a folder inside it
    link = runs.parent / "link_to_bf16"
    link.symlink_to(runs / "bf16")
    try:
        for out in (link, runs / "bf16" / "new" / "sub"):
            code, _, err = run_cli(capsys, runs / "fp32", runs / "fp32", "--out", out)
            assert code == 2 and "diff never writes into a run" in one_line(err), err
    finally:
        link.unlink()
    assert tree(runs) == before  # no watch_diff.json, no reports/ folder left in a run


def test_diff_out_beside_the_runs_is_written_and_replaced_only_with_force(runs, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "rep"
    assert run_cli(capsys, runs / "fp32", runs / "bf16", "--out", out)[0] == 1
    assert json.loads((out / "watch_diff.json").read_text())["verdict"]["category"] == "numerics"
    code, _, err = run_cli(capsys, runs / "fp32", runs / "bf16", "--out", out)
    assert code == 2 and "already holds a report (watch_diff.json); pass --force" in one_line(err)
    assert run_cli(capsys, runs / "fp32", runs / "bf16", "--out", out, "--force")[0] == 1


def test_diff_no_save_with_out_is_refused(runs, tmp_path, capsys):
    capsys.readouterr()
    for args in ([runs / "fp32", runs / "bf16"], [runs / "fp32", "--judge", "cpu:float64"]):
        code, stdout, err = run_cli(capsys, *args, "--no-save", "--out", tmp_path / "x")
        assert code == 2 and stdout == "" and "--no-save writes no files, --out" in one_line(err)
    assert not (tmp_path / "x").exists()


def test_watch_out_that_cannot_be_made_is_a_usage_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (tmp_path / "file").write_text("x")
    outs = [(tmp_path / "file" / "run", "a part of the path above it is a file")]
    if os.path.isdir("/proc/self"):
        outs.append(("/proc/foo", "convcheck.watch: out=/proc/foo: cannot create the folder"))
    for out, message in outs:
        with pytest.raises(UsageError, match=message):
            with convcheck.watch(model, opt, out=out):
                pass


# --- 2. what is wrong with a path given to diff ----------------------------------------------------

def test_a_bad_run_path_is_named_with_what_is_wrong(runs, tmp_path, capsys):
    capsys.readouterr()
    (tmp_path / "x.txt").write_text("notes\n")
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "nope", "no such folder"),
             (tmp_path / "x.txt", "not a watched run or a recorded bundle"),
             (tmp_path / "empty", "not a watched run or a recorded bundle (no manifest.json in it"),
             (runs / "report", "a report folder (what compare or diff wrote), not a run")]
    for path, message in cases:
        for args in ([path, runs / "fp32"], [runs / "fp32", path], [path, "--judge", "cpu:float64"]):
            code, stdout, err = run_cli(capsys, *args, "--no-save")
            line = one_line(err)
            assert code == 2 and stdout == "" and f"diff: {path}: {message}" in line, (args, line)
            assert "one run is watched" not in line
    code, _, err = run_cli(capsys, tmp_path / "nope", tmp_path / "x.txt", "--no-save")  # neither is a run
    assert code == 2 and f"diff: {tmp_path / 'nope'}: no such folder" in one_line(err)


# --- 3. a script without a main guard is not imported for the replay --------------------------------

SCRIPT = '''\
"""A whole training in one file, started with python -m {name} OUT."""
import argparse

import torch
import torch.nn as nn

import convcheck

TRACE = "trained.txt"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train(out):
    with open(TRACE, "a") as f:
        f.write(out + "\\n")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(3):
            loss = model(torch.randn(5, 4, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


'''


def _script(tmp_path, name: str, guarded: bool) -> None:
    tail = ('parser = argparse.ArgumentParser()\nparser.add_argument("out")\nargs = parser.parse_args()\n'
            "train(args.out)\n")
    if guarded:
        tail = 'if __name__ == "__main__":\n' + textwrap.indent(tail, "    ")
    (tmp_path / f"{name}.py").write_text(SCRIPT.format(name=name) + tail)
    subprocess.run([sys.executable, "-m", name, "runs/x"], cwd=tmp_path, check=True, capture_output=True,
                   timeout=300)
    assert (tmp_path / "trained.txt").read_text() == "runs/x\n"
    assert json.loads((tmp_path / "runs" / "x" / "manifest.json").read_text())["model"]["module"] == name


@pytest.mark.slow  # ~3.5 s: a user's script run as a process
def test_a_script_without_a_main_guard_is_not_imported_and_not_rerun(tmp_path, monkeypatch, capsys):
    _script(tmp_path, "inline_train", guarded=False)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, "runs/x", "--judge", "cpu:float64", "--no-save")
    assert code == 0 and err == ""
    # the script is never imported (it would train again); its layers, torch's own, are rebuilt from the run's
    # safe data (issue 43: model.leaf_specs) and replayed all the same
    assert "2 layer calls at step 0 replayed: all within their floors" in out
    assert "verdict: ok: " in out
    assert "inline_train" not in sys.modules
    assert (tmp_path / "trained.txt").read_text() == "runs/x\n"  # the training did not run again
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.slow  # ~3 s: a user's script run as a process
def test_the_same_script_with_a_main_guard_is_replayed(tmp_path, monkeypatch, capsys):
    _script(tmp_path, "guarded_train", guarded=True)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    try:
        code, out, err = run_cli(capsys, "runs/x", "--judge", "cpu:float64", "--no-save")
    finally:
        sys.modules.pop("guarded_train", None)
    assert code == 0 and err == ""
    assert "2 layer calls at step 0 replayed: all within their floors" in out
    assert (tmp_path / "trained.txt").read_text() == "runs/x\n"


def test_what_counts_as_code_on_import(tmp_path, monkeypatch):
    from convcheck.analysis.model_import import runs_code_on_import

    monkeypatch.syspath_prepend(str(tmp_path))
    # what model files do at import: none of it is a script's work
    defs = ('"""doc"""\nimport logging, math, os\nfrom functools import partial\nimport torch\nimport torch.nn as nn\n'
            'try:\n    import numpy\nexcept ImportError:\n    numpy = None\n'
            'log = logging.getLogger(__name__)\nlogging.basicConfig(level=20)\nSIZES = (1, 2) * 2\n'
            'DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")\nSCALE = math.sqrt(2)\n'
            'Norm = partial(nn.BatchNorm2d, eps=1e-3)\nHOME = os.environ.get("HOME")\nif False:\n    X = 1\n'
            'def f():\n    return g()\nclass C:\n    pass\nSPECS = (C(),)\nif __name__ == "__main__":\n    f()\n'
            'else:\n    pass\n')
    (tmp_path / "defs_only.py").write_text(defs)
    assert runs_code_on_import("defs_only") is None
    for i, (code, what) in enumerate([("f()\n", "a call of f()"), ("cfg = f()\n", "a call of f()"),
                                      ("for i in range(3):\n    pass\n", "a top-level for loop"),
                                      ("with open('x') as fh:\n    pass\n", "a top-level with block"),
                                      ("if True:\n    f()\n", "a call of f()"),
                                      ("import argparse\nargs = argparse.ArgumentParser().parse_args()\n",
                                       "parse_args()"),
                                      ("import sys\nsys.exit(0)\n", "an exit"), ("C().fit(1)\n", "fit()")]):
        (tmp_path / f"runs_{i}.py").write_text(defs + code)
        line = defs.count("\n") + 1 + (code.startswith(("import", "if")))  # the line of the call itself
        assert runs_code_on_import(f"runs_{i}") == (f"runs_{i}.py", line, what), code
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def main():\n    pass\nmain()\n")
    (pkg / "models.py").write_text(defs)
    assert runs_code_on_import("userpkg.models") == ("__init__.py", 3, "a call of main()")
    # a folder of modules with no __init__.py (a namespace package) that is not imported yet: the finder
    # cannot tell, so the import decides (it does, and the replay works)
    ns = tmp_path / "nspkg" / "sub"
    ns.mkdir(parents=True)
    (ns / "net.py").write_text(defs)
    assert runs_code_on_import("nspkg.sub.net") is None
    assert "userpkg" not in sys.modules  # found, read, never imported
