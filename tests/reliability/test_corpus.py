"""The reliability corpus (issue 11): bad inputs and faults, as a careless or hostile user makes them.

One parametrised test per class. Every case must end with its documented exit
code and one line on stderr (no traceback), and leave every path that was
there before exactly as it was (a run may only add what its case names).

    2  usage: bad numbers and specs                         USAGE
    2  the user's own model code failing                    USER_CODE
    2  unreadable, hostile or malformed input files         INPUT_FILES
    2  output paths that must not be destroyed              NEVER_DESTROY
    3  the machine's limits: memory, disk, interrupt        RESOURCE
    4  a bug in convcheck: traceback plus one line          INTERNAL
"""

from __future__ import annotations

import errno
import gzip
import json
import operator
import os
import stat
from pathlib import Path

import pytest

from tests.reliability.conftest import (
    DATA,
    TINY,
    Case,
    assert_one_error_line,
    bad,
    run_cli,
    snapshot,
)

# --- 2: usage ---------------------------------------------------------------------------------


def _compare(*extra):
    return lambda p: ["compare", "--model", "lenet", "--steps", "1", "--batch-size", "2", "--envelope", "0", *extra]


USAGE = [
    Case("bound-factor-nan", _compare("--bound-factor", "nan"), 2, "bound_factor"),
    Case("bound-factor-negative", _compare("--bound-factor", "-1"), 2, "bound_factor"),
    Case("bound-factor-inf", _compare("--bound-factor", "inf"), 2, "bound_factor"),
    Case("min-error-nan", _compare("--min-error", "nan"), 2, "min_error"),
    Case("min-error-negative", _compare("--min-error", "-1"), 2, "min_error"),
    Case("both-tolerances-negative", _compare("--bound-factor", "-1", "--min-error", "-1"), 2, "tolerance"),
    Case("lr-nan", _compare("--lr", "nan"), 2, "learning rate"),
    Case("lr-zero", _compare("--lr", "0"), 2, "learning rate"),
    Case("lr-inf", _compare("--lr", "inf"), 2, "learning rate"),
    Case("steps-zero", _compare("--steps", "0"), 2, "steps"),
    Case("steps-negative", _compare("--steps", "-3"), 2, "steps"),
    Case("steps-text", _compare("--steps", "many"), 2, "--steps"),
    Case("batch-size-zero", _compare("--batch-size", "0"), 2, "batch size"),
    Case("envelope-negative", _compare("--envelope", "-1"), 2, "envelope"),
    Case("seed-negative", _compare("--seed", "-1"), 2, "seed"),
    Case("seed-2^63", _compare("--seed", str(2**63)), 2, "seed"),
    Case("seed-float", _compare("--seed", "1.5"), 2, "--seed"),
    Case("weight-decay-negative", _compare("--weight-decay", "-1"), 2, "weight decay"),
    Case("momentum-nan", _compare("--optimizer", "sgd", "--momentum", "nan"), 2, "momentum"),
    Case("warmup-negative", _compare("--warmup", "-1"), 2, "warmup"),
    Case("unknown-optimizer", _compare("--optimizer", "nosuch"), 2, "nosuch"),
    Case("unknown-mode", _compare("--targets", "cpu,cpu:fp8"), 2, "fp8"),
    Case("unknown-device", _compare("--targets", "gpu,cpu"), 2, "gpu"),
    Case("one-target", _compare("--targets", "cpu"), 2, "two"),
    Case("empty-targets", _compare("--targets", ""), 2, "target"),
    Case("judge-not-float64", _compare("--judge", "cpu"), 2, "float64"),
    Case("unknown-model", _compare("--model", "lenet6"), 2, "lenet6"),
    Case("malformed-model-spec", _compare("--model", "::"), 2, "::"),
    Case("short-input-shape", _compare("--input-shape", "1,28"), 2, "C,H,W"),
    Case("zero-input-shape", _compare("--input-shape", "0,28,28"), 2, "C,H,W"),
    Case("unknown-data-source", _compare("--data", "imagenet:/data"), 2, "imagenet"),
    Case("unknown-option", _compare("--bound-facter", "2"), 2, "--bound-facter"),
    Case("env-from-without-file", lambda p: ["env", "--from"], 2, "--from"),
]


@pytest.mark.parametrize("case", USAGE, ids=[c.id for c in USAGE])
def test_usage(case, capsys, tmp_path):
    _check(case, capsys, tmp_path)


# --- 2: the user's own model code -------------------------------------------------------------

def _model(name, *extra, steps="1"):
    return lambda p: ["compare", "--model", bad(name), *TINY, "--steps", steps, *extra]


def _write(name, text):
    return lambda p: (p / name).write_text(text)


USER_CODE = [
    Case("no-parameters", _model("no_parameters"), 2, "no parameters"),
    Case("frozen", _model("frozen"), 2, "frozen"),
    Case("integer-output", _model("integer_output"), 2, "int64 output"),
    Case("detached-output", _model("detached_output"), 2, "does not depend on any trainable parameter"),
    Case("tuple-output", _model("tuple_output"), 2, "not a tensor"),
    Case("batchnorm1d-batch-1", _model("batchnorm1d", "--batch-size", "1"), 2,
         "in layer '2' (BatchNorm1d): ValueError: Expected more than 1 value"),
    Case("raises-in-a-nested-layer", _model("nested"), 2,
         "a block that cannot train in layer 'encoder.1', _Block.forward ("),
    Case("factory-returns-42", _model("returns_42"), 2, "returned int"),
    Case("factory-returns-none", _model("returns_none"), 2, "returned NoneType"),
    Case("factory-raises", _model("raises"), 2, "the weights file is missing"),
    Case("factory-needs-an-argument", _model("needs_an_argument"), 2, "missing 1 required positional argument"),
    Case("factory-raises-on-second-build", _model("raises_on_second_build"), 2, "only one model per process"),
    Case("wrong-input-shape", _model("wrong_shape"), 2, "rejects input shape 1x4x4"),
    Case("raises-at-step-3", _model("raises_at_step_3", steps="5"), 2,
         "ValueError: the user's model broke at a later step in FailsAtStep3.forward"),
    Case("not-callable", _model("not_callable"), 2, "not a callable"),
    Case("no-such-factory", _model("nope"), 2, "nope"),
    Case("syntax-error", lambda p: ["compare", "--model", f"{p / 'broken.py'}:f", *TINY], 2, "SyntaxError",
         setup=_write("broken.py", "def f(:\n    pass\n")),
    Case("import-error", lambda p: ["compare", "--model", f"{p / 'imports.py'}:f", *TINY], 2, "no_such_module",
         setup=_write("imports.py", "import no_such_module\n")),
    Case("raises-on-import", lambda p: ["compare", "--model", f"{p / 'boom.py'}:f", *TINY], 2, "boom at import",
         setup=_write("boom.py", "raise RuntimeError('boom at import')\n")),
    Case("not-a-python-file", lambda p: ["compare", "--model", f"{p / 'model.txt'}:f", *TINY], 2, "model.txt",
         setup=_write("model.txt", "x")),
]


@pytest.mark.parametrize("case", USER_CODE, ids=[c.id for c in USER_CODE])
def test_user_code(case, capsys, tmp_path):
    line = _check(case, capsys, tmp_path)
    if case.id == "raises-at-step-3":  # names the file, line, function and the step
        assert "bad_models.py:" in line and "during training step 3 of 5" in line


# --- 2: input files -----------------------------------------------------------------------------

def _fingerprint(**sections) -> str:
    return json.dumps({"schema": "convcheck.fingerprint/1", **sections})


def _env_from(name):
    return lambda p: ["env", "--from", str(p / name)]


def _mnist(images_header: bytes, trailing: int = 0, images_gz: bool = True):
    def setup(p: Path):
        d = p / "mnist"
        d.mkdir()
        body = images_header + bytes(trailing)
        (d / ("train-images-idx3-ubyte" + (".gz" if images_gz else ""))).write_bytes(
            gzip.compress(body, 1) if images_gz else body)
        (d / "train-labels-idx1-ubyte").write_bytes((2049).to_bytes(4, "big") + (10).to_bytes(4, "big") + bytes(10))
    return setup


def _idx_header(n, rows=28, cols=28):
    return b"".join(v.to_bytes(4, "big") for v in (2051, n, rows, cols))


INPUT_FILES = [
    Case("missing-file", _env_from("missing.json"), 2, "cannot read"),
    Case("empty-file", _env_from("empty.txt"), 2, "empty", setup=_write("empty.txt", "")),
    Case("directory", lambda p: ["env", "--from", str(p)], 2, "cannot read"),
    Case("dev-zero", lambda p: ["env", "--from", "/dev/zero"], 2, "larger than"),
    Case("fifo-without-writer", _env_from("fifo"), 2, "empty", setup=lambda p: os.mkfifo(p / "fifo")),
    Case("binary-garbage", _env_from("garbage.bin"), 2, "neither",
         setup=lambda p: (p / "garbage.bin").write_bytes(bytes(range(256)) * 40)),
    Case("five-megabytes", _env_from("big.txt"), 2, "larger than",
         setup=lambda p: (p / "big.txt").write_text("PyTorch version: 2.4\n" * 250_000)),
    Case("invalid-json", _env_from("bad.json"), 2, "invalid JSON", setup=_write("bad.json", "{broken")),
    Case("deeply-nested-json", _env_from("deep.json"), 2, "unreadable JSON",
         setup=_write("deep.json", "{\"a\":" + "[" * 100_000 + "]" * 100_000 + "}")),
    Case("5000-digit-number", _env_from("digits.json"), 2, "JSON",
         setup=_write("digits.json", "{\"schema\": " + "9" * 5000 + "}")),
    Case("json-list", _env_from("list.json"), 2, "neither", setup=_write("list.json", "[1, 2]")),
    Case("wrong-schema", _env_from("schema.json"), 2, "schema",
         setup=_write("schema.json", json.dumps({"schema": "other/1"}))),
    Case("arch-list-numbers", _env_from("fp.json"), 2, "torch.arch_list[0]",
         setup=_write("fp.json", _fingerprint(torch={"arch_list": [90, 80]}))),
    Case("capability-one-number", _env_from("fp.json"), 2, "gpus[0].capability",
         setup=_write("fp.json", _fingerprint(gpus=[{"name": "x", "capability": [8]}]))),
    Case("clock-reasons-text", _env_from("fp.json"), 2, "gpus[0].clock_event_reasons",
         setup=_write("fp.json", _fingerprint(gpus=[{"clock_event_reasons": "0x40"}]))),
    Case("cudnn-version-text", _env_from("fp.json"), 2, "torch.cudnn_version",
         setup=_write("fp.json", _fingerprint(torch={"cudnn_version": "8.9.2"}))),
    Case("5000-digit-driver", _env_from("fp.json"), 2, "driver.version",
         setup=_write("fp.json", _fingerprint(driver={"version": "5" * 5000}))),
    Case("driver-not-a-version", _env_from("fp.json"), 2, "driver.version",
         setup=_write("fp.json", _fingerprint(driver={"version": "latest"}))),
    Case("gpus-not-a-list", _env_from("fp.json"), 2, "gpus", setup=_write("fp.json", _fingerprint(gpus="x"))),
    Case("power-nan", _env_from("fp.json"), 2, "gpus[0].power_w",
         setup=_write("fp.json", _fingerprint(gpus=[{"power_w": 1}]).replace("1}", "NaN}"))),
    Case("bool-for-int", _env_from("fp.json"), 2, "gpus[0].temperature_c",
         setup=_write("fp.json", _fingerprint(gpus=[{"temperature_c": True}]))),
    Case("compare-env-garbage", lambda p: _compare("--env", str(p / "g.txt"))(p), 2, "neither",
         setup=_write("g.txt", "hello")),
    Case("mnist-header-too-big", lambda p: ["compare", "--data", f"mnist:{p / 'mnist'}", "--steps", "1"], 2,
         "more than the 1 GiB", setup=_mnist(_idx_header(2_000_000))),
    Case("mnist-gzip-bomb", lambda p: ["compare", "--data", f"mnist:{p / 'mnist'}", "--steps", "1"], 2,
         "beyond what its header", setup=_mnist(_idx_header(10), trailing=64 * 2**20)),
    Case("mnist-corrupt-gzip", lambda p: ["compare", "--data", f"mnist:{p / 'mnist'}", "--steps", "1"], 2,
         "cannot read", setup=lambda p: (_mnist(_idx_header(10), 7840)(p),
                                         (p / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(
                                             b"\x1f\x8b\x08\x00" + bytes(40)))),
    Case("npz-garbage", lambda p: ["compare", "--data", f"npz:{p / 'x.npz'}", "--steps", "1"], 2, "x.npz",
         setup=lambda p: (p / "x.npz").write_bytes(b"PK\x03\x04" + bytes(100))),
]


@pytest.mark.parametrize("case", INPUT_FILES, ids=[c.id for c in INPUT_FILES])
def test_input_files(case, capsys, tmp_path):
    _check(case, capsys, tmp_path)


# --- 2: never destroy -------------------------------------------------------------------------


def _victim(p: Path):
    (p / "victim.txt").write_text("precious")


def _with(*steps):
    return lambda p: [s(p) for s in steps]


def _report_folder(p: Path):
    (p / "out").mkdir()
    (p / "out" / "summary.json").write_text("{\"mine\": true}")
    (p / "out" / "notes.txt").write_text("mine")


def _linked_summary(p: Path):
    (p / "out").mkdir()
    os.symlink(p / "victim.txt", p / "out" / "summary.json")


def _fifo_report(p: Path):
    (p / "out").mkdir()
    os.mkfifo(p / "out" / "report.html")


def _out(*extra):
    return lambda p: ["compare", "--model", "lenet", "--steps", "1", "--batch-size", "2", "--envelope", "0",
                      "--out", *[str(e(p)) if callable(e) else e for e in extra]]


NEVER_DESTROY = [
    Case("save-symlink", lambda p: ["env", "--save", str(p / "link.json")], 2, "symbolic link",
         setup=_with(_victim, lambda p: os.symlink(p / "victim.txt", p / "link.json"))),
    Case("save-symlink-force", lambda p: ["env", "--save", str(p / "link.json"), "--force"], 2, "symbolic link",
         setup=_with(_victim, lambda p: os.symlink(p / "victim.txt", p / "link.json"))),
    Case("save-dangling-symlink", lambda p: ["env", "--save", str(p / "link.json")], 2, "symbolic link",
         setup=lambda p: os.symlink(p / "nowhere", p / "link.json")),
    Case("save-fifo", lambda p: ["env", "--save", str(p / "fifo"), "--force"], 2, "FIFO",
         setup=lambda p: os.mkfifo(p / "fifo")),
    Case("save-dev-null", lambda p: ["env", "--save", "/dev/null", "--force"], 2, "character device"),
    Case("save-existing-file", lambda p: ["env", "--save", str(p / "victim.txt")], 2, "--force", setup=_victim),
    Case("save-directory", lambda p: ["env", "--save", str(p), "--force"], 2, "directory"),
    Case("save-under-a-file", lambda p: ["env", "--save", str(p / "victim.txt" / "fp.json")], 2, "not a directory",
         setup=_victim),
    Case("out-is-a-file", _out(lambda p: p / "victim.txt"), 2, "not a directory", setup=_victim),
    Case("out-is-dev-null", _out("/dev/null"), 2, "not a directory"),
    Case("out-holds-a-report", _out(lambda p: p / "out"), 2, "--force", setup=_report_folder),
    Case("out-summary-is-a-symlink", _out(lambda p: p / "out", "--force"), 2, "symbolic link",
         setup=_with(_victim, _linked_summary)),
    Case("out-report-is-a-fifo", _out(lambda p: p / "out", "--force"), 2, "FIFO", setup=_fifo_report),
    Case("out-under-a-file", _out(lambda p: p / "victim.txt" / "run"), 2, "victim.txt", setup=_victim),
    Case("failed-run-leaves-no-out-folder", lambda p: ["compare", "--model", "lenet6", "--out", str(p / "a" / "b")],
         2, "lenet6"),
]


@pytest.mark.parametrize("case", NEVER_DESTROY, ids=[c.id for c in NEVER_DESTROY])
def test_never_destroy(case, capsys, tmp_path):
    null = os.lstat("/dev/null")
    _check(case, capsys, tmp_path)
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == null.st_rdev


# --- 3: the machine's limits ------------------------------------------------------------------


def _disk_full_on_third_write(monkeypatch):
    import convcheck.report.export as export

    real, calls = export.atomic_write_bytes, {"n": 0}

    def write(path, data):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(export, "atomic_write_bytes", write)


def _oom_in_the_env_probe(monkeypatch):
    import convcheck.env as env

    def collect(*a, **k):
        raise MemoryError()

    monkeypatch.setattr(env, "collect", collect)


RESOURCE = [
    Case("cpu-allocator-out-of-memory", _model("out_of_memory_at_step_3", steps="5"), 3,
         "out of memory: [enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory",
         new_files=("reports", "reports/*", "reports/*/summary.json", "reports/*/layers.csv",
                    "reports/*/curves.csv")),
    Case("memory-error", _model("memory_error_at_step_3", "--out", "run", steps="5"), 3, "out of memory",
         new_files=("run", "run/summary.json", "run/layers.csv", "run/curves.csv")),
    Case("interrupted", _model("interrupted_at_step_3", "--out", "run", steps="5"), 3,
         "interrupted during training step 3 of 5",
         new_files=("run", "run/summary.json", "run/layers.csv", "run/curves.csv")),
    Case("disk-full-during-the-run", _model("disk_full_at_step_3", "--no-save", steps="5"), 3, "disk full"),
    Case("disk-full-writing-the-report", lambda p: ["compare", "--model", "lenet", "--steps", "1", "--batch-size",
                                                    "2", "--envelope", "0", "--out", "run"], 3,
         "disk full writing run/curves.csv", patch=_disk_full_on_third_write,
         new_files=("run", "run/summary.json", "run/layers.csv")),
    Case("out-of-memory-probing-the-env", lambda p: ["env"], 3, "out of memory", patch=_oom_in_the_env_probe),
]


@pytest.mark.parametrize("case", RESOURCE, ids=[c.id for c in RESOURCE])
def test_resource(case, capsys, tmp_path, monkeypatch):
    line = _check(case, capsys, tmp_path, monkeypatch)
    summaries = list(tmp_path.glob("**/summary.json"))
    if case.new_files:  # what was known is kept, and the line says where
        assert len(summaries) == 1
        summary = json.loads(summaries[0].read_text())
        assert summary["complete"] is False
        assert str(summaries[0].relative_to(tmp_path)) in line or "summary.json (complete: false)" in line
    if case.id == "interrupted":
        assert summary["stage"]["where"] == "training step 3 of 5" and summary["config"]["steps"] == 5
        # the one-step parity check ran before the stop: its table is kept
        layers = (summaries[0].parent / "layers.csv").read_text().splitlines()
        assert summary["parity"]["rows"] == len(layers) - 1 > 0 and summary["parity"]["file"] == "layers.csv"
        # and the training steps completed before it: steps 1 and 2 of every arm
        curves = (summaries[0].parent / "curves.csv").read_text().splitlines()
        assert summary["training"]["steps_done"] == 2 and curves[0].startswith("arm,role,target,step,loss")
        assert len(curves) - 1 == 2 * len(summary["training"]["last_loss"])


# --- 4: a bug in convcheck ------------------------------------------------------------------


def _bug_in_diagnose(monkeypatch):
    # A C-level callable: the innermost Python frame of the failure is convcheck's own, as for a real bug.
    import convcheck.diagnose as diagnose

    monkeypatch.setattr(diagnose, "diagnose", operator.itemgetter("no such key"))


def _bug_in_the_audit(monkeypatch):
    import convcheck.env as env

    monkeypatch.setattr(env, "audit", operator.itemgetter(0))


INTERNAL = [
    Case("bug-in-diagnose", _compare("--no-save"), 4, "TypeError", patch=_bug_in_diagnose),
    Case("bug-in-the-audit", lambda p: ["env", "--from", str(DATA / "h100_healthy.json")], 4, "TypeError",
         patch=_bug_in_the_audit),
]


@pytest.mark.parametrize("case", INTERNAL, ids=[c.id for c in INTERNAL])
def test_internal(case, capsys, tmp_path, monkeypatch):
    case.patch(monkeypatch)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, case.argv(tmp_path))
    assert code == 4
    assert "Traceback" in err  # the one case with a traceback: it is needed to fix the bug
    last = err.strip().splitlines()[-1]
    assert last.startswith("convcheck: internal error") and case.text in last and "bug in convcheck" in last
    assert snapshot(tmp_path) == before


# --- shared ------------------------------------------------------------------------------------


def _check(case: Case, capsys, tmp_path: Path, monkeypatch=None) -> str:
    if case.setup:
        case.setup(tmp_path)
    if case.patch:
        case.patch(monkeypatch)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, case.argv(tmp_path))
    line = assert_one_error_line(code, case.code, err, case.text)
    after = snapshot(tmp_path)
    for path, what in before.items():
        assert after.get(path) == what, f"{path} changed"
    added = set(after) - set(before)
    allowed = {p for pattern in case.new_files for p in added if Path(p).match(pattern)}
    assert added == allowed, f"unexpected new paths {sorted(added - allowed)}"
    return line


def test_corpus_size():
    """The corpus, counted (the final report quotes these numbers)."""
    sizes = {"usage": len(USAGE), "user code": len(USER_CODE), "input files": len(INPUT_FILES),
             "never destroy": len(NEVER_DESTROY), "resource": len(RESOURCE), "internal": len(INTERNAL)}
    assert all(n >= 2 for n in sizes.values()) and sum(sizes.values()) >= 100
