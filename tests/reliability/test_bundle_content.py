"""Tampered bundles (content, not structure): ``diff`` and ``compare --against`` refuse what a writer never
writes, instead of "every layer within its floor's bound" and exit 0 (issue 27)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from convcheck.plan.config import CompareConfig
from tests.reliability.conftest import assert_one_error_line, run_cli


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from convcheck.bundle.record import record_run

    tmp = tmp_path_factory.mktemp("recorded")
    out = {}
    for name, target in (("A", "cpu"), ("B", "cpu:bf16")):
        (tmp / name).mkdir()
        record_run("lenet", target, CompareConfig(steps=2, batch_size=4, envelope=0), tmp / name)
        out[name] = tmp / name
    return out


@pytest.fixture
def a_copy(recorded, tmp_path):
    dst = tmp_path / "A"
    shutil.copytree(recorded["A"], dst)
    return dst


def _manifest(b: Path) -> dict:
    return json.loads((b / "manifest.json").read_text())


def _save_manifest(b: Path, m: dict) -> None:
    (b / "manifest.json").write_text(json.dumps(m))


def _rewrite(b: Path, rel: str, fn) -> None:
    with np.load(b / rel) as z:
        arrays = {k: fn(z[k].copy()) for k in z.files}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    (b / rel).write_bytes(buf.getvalue())


def _nan(a):
    a.flat[0] = np.nan
    return a


def _without_hashes(b: Path) -> None:
    """As a bundle written before the per-array hashes."""
    m = _manifest(b)
    for group in ("forward", "grads", "snapshots"):
        for e in m["arrays"][group]:
            e.pop("sha256", None)
    _save_manifest(b, m)


def _diff(capsys, a: Path, b: Path, tmp_path: Path):
    return run_cli(capsys, ["diff", str(a), str(b), "--out", str(tmp_path / "report")])


def test_the_writer_records_a_hash_per_array(recorded):
    m = _manifest(recorded["A"])
    assert all(len(e["sha256"]) == 64 for g in ("forward", "grads", "snapshots") for e in m["arrays"][g])


@pytest.mark.parametrize("group", ["forward", "grads", "snapshots"])
@pytest.mark.parametrize("hashed", [True, False])
def test_a_nan_array_is_refused(capsys, a_copy, recorded, tmp_path, group, hashed):
    rel = _manifest(a_copy)["arrays"][group][0]["file"]
    _rewrite(a_copy, rel, _nan)
    if not hashed:
        _without_hashes(a_copy)
    code, _, err = _diff(capsys, a_copy, recorded["B"], tmp_path)
    text = "does not hash to the SHA-256" if hashed else "holds NaN/Inf"
    line = assert_one_error_line(code, 2, err, text)
    assert rel in line
    assert not (tmp_path / "report").exists()


def test_two_same_shaped_arrays_swapped_are_refused(capsys, a_copy, recorded, tmp_path):
    m = _manifest(a_copy)
    same = [e for e in m["arrays"]["forward"] if e["shape"] == m["arrays"]["forward"][0]["shape"]]
    assert len(same) >= 2  # conv1 and relu1 have one shape
    first, second = a_copy / same[0]["file"], a_copy / same[1]["file"]
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)
    code, _, err = _diff(capsys, a_copy, recorded["B"], tmp_path)
    assert_one_error_line(code, 2, err, "does not hash to the SHA-256 its index records")


@pytest.mark.parametrize("edit, text", [
    (dict(local=1e9, flagged=False), ".flagged is False but its local error 1e+09"),
    (dict(local=float("nan")), ".local is nan"),
    (dict(floor=float("nan"), bound=float("nan")), ".floor is nan"),
])
def test_an_edited_parity_row_is_refused(capsys, a_copy, recorded, tmp_path, edit, text):
    m = _manifest(a_copy)
    m["parity"]["rows"][0].update(edit)
    _save_manifest(a_copy, m)
    code, _, err = _diff(capsys, a_copy, recorded["B"], tmp_path)
    line = assert_one_error_line(code, 2, err, text)
    assert "parity.rows[0]" in line


def test_a_nan_loss_curve_not_marked_is_refused(capsys, a_copy, recorded, tmp_path):
    m = _manifest(a_copy)
    m["training"]["curves"][1]["loss"] = float("nan")
    _save_manifest(a_copy, m)
    code, _, err = _diff(capsys, a_copy, recorded["B"], tmp_path)
    assert_one_error_line(code, 2, err, "nonfinite_loss false")


def test_compare_against_a_tampered_bundle_is_refused(capsys, a_copy, tmp_path):
    m = _manifest(a_copy)
    m["parity"]["rows"][2].update(local=1e9, flagged=False)
    _save_manifest(a_copy, m)
    code, _, err = run_cli(capsys, ["compare", "--against", str(a_copy), "--targets", "cpu:bf16", "--no-save"])
    assert_one_error_line(code, 2, err, "the row was edited")


def test_a_bundle_without_hashes_still_diffs(capsys, a_copy, recorded, tmp_path):
    _without_hashes(a_copy)
    code, _, err = _diff(capsys, a_copy, recorded["B"], tmp_path)
    assert code in (0, 1), err
    assert "error" not in err


def test_a_manifest_that_lies_about_its_initial_weights_is_refused(capsys, a_copy, recorded, tmp_path):
    """Issue 47: init_sha256 edited while the step-0 parameters recorded are the run's own: a damaged bundle
    (exit 2), not a setup verdict that the runs started from other weights."""
    m = _manifest(a_copy)
    m["init_sha256"] = "0" * 64
    _save_manifest(a_copy, m)
    code, _, err = _diff(capsys, a_copy, recorded["B"], tmp_path)
    line = assert_one_error_line(code, 2, err, "init_sha256")
    assert "edited or damaged" in line
    assert not (tmp_path / "report").exists()


def _altered(value):
    """Another value for a manifest field: of another kind, or the same kind changed."""
    if isinstance(value, bool):
        return [not value, "yes"]
    if isinstance(value, (int, float)):
        return [-1, 1e308, "1", None]
    if isinstance(value, str):
        return ["", value[::-1] + "x", 5]
    if isinstance(value, list):
        return [[], value[:1] * 3, {"a": 1}]
    if isinstance(value, dict):
        return [{}, [], None]
    return [5, "x"]


_FIELDS = ["schema", "convcheck_version", "created", "model", "target", "judge", "judge_reason", "config",
           "tolerances", "layers_pattern", "code_sha256", "versions", "fingerprint", "init_sha256", "batch_sha256",
           "batches_sha256", "data_source", "data_stats", "notes", "parity", "training", "arrays"]


@pytest.mark.slow  # the generated family: 22 bundles, ~18 s (the slow pass runs it; the lying manifest stays fast)
@pytest.mark.parametrize("field", _FIELDS)
def test_every_manifest_field_altered_no_traceback_nothing_written(capsys, recorded, tmp_path, field):
    """Issue 47's family: each field of the manifest altered, one at a time: ``diff`` answers (exit 0/1) or refuses
    in one line (exit 2), never a traceback; nothing is written outside --out, nothing of the bundles changes."""
    from tests.reliability.conftest import snapshot

    original = _manifest(recorded["A"])
    assert field in original
    for i, value in enumerate(_altered(original[field]) + [None]):
        run = tmp_path / f"A{i}"
        shutil.copytree(recorded["A"], run)
        m = dict(original)
        m[field] = value
        _save_manifest(run, m)
        before = snapshot(tmp_path)
        code, _, err = run_cli(capsys, ["diff", str(run), str(recorded["B"]), "--out", str(tmp_path / f"r{i}")])
        assert "Traceback" not in err and code in (0, 1, 2), (field, value, code, err)
        if code == 2:
            assert_one_error_line(code, 2, err, "")
        after = snapshot(tmp_path)
        assert {k: v for k, v in after.items() if not k.startswith(f"r{i}")} == before, (field, value)
