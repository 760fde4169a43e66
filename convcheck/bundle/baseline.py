"""pytest baselines (``--convcheck-record DIR`` / ``--convcheck-against DIR``), the way pytest-regressions
keeps its files: record a bundle per test once, then diagnose later runs against it.

A missing baseline fails the test with how to create it; it never passes silently.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from convcheck.plan.config import CompareConfig


def baseline_path(root: str, nodeid: str, target: str, name: str | None) -> Path:
    key = name or re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")
    return Path(root) / f"{key}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', target)}"


def run_baseline(model: str, target: str, config: CompareConfig, *, record_dir: str | None, against_dir: str | None,
                 nodeid: str, name: str | None = None, fail, skip, input_shape=None, num_classes=None):
    """``nodeid``: the test's module stem and name (not pytest's node id, which moves with the rootdir).
    Record (then ``skip`` saying where) or diff against the recorded baseline (returns the
    ``CompareResult``); ``fail`` when neither option is given or the baseline is missing."""
    from convcheck.bundle.diff import DifferentInputs, config_of, diff_bundles
    from convcheck.bundle.reader import open_bundle
    from convcheck.bundle.record import record_run
    from convcheck.bundle.writer import prepare_folder

    if record_dir:
        path = baseline_path(record_dir, nodeid, target, name)
        folder, _ = prepare_folder(path, force=True)
        try:
            record_run(model, target, config, folder, snapshot_steps=None, input_shape=input_shape,
                       num_classes=num_classes)
        except BaseException:
            _remove_if_empty(folder)  # a record that failed leaves no empty baseline folder behind
            raise
        skip(f"convcheck: recorded the baseline {path}; run with --convcheck-against {record_dir} to check against it")
    if not against_dir:
        fail("convcheck: no baseline given: record one with 'pytest --convcheck-record DIR', then check against it "
             "with 'pytest --convcheck-against DIR'")
    path = baseline_path(against_dir, nodeid, target, name)
    if not (path / "manifest.json").exists():
        fail(f"convcheck: no baseline at {path}; create it with 'pytest --convcheck-record {against_dir}' "
             "(on the machine whose run is the reference)")
    recorded = open_bundle(path)
    with tempfile.TemporaryDirectory(prefix="convcheck-here-") as tmp:
        here = Path(tmp) / "here"
        here.mkdir()
        m = recorded["model"]
        record_run(m["spec"], target, config_of(recorded, None, config.judge), here,
                   input_shape=tuple(m["input_shape"]) if m.get("input_shape") else input_shape,
                   num_classes=m.get("num_classes") or num_classes)
        try:
            result, _, _ = diff_bundles(path, here, labels=("baseline", "here"))
        except DifferentInputs as found:  # the baseline saw other data or weights: the test fails, saying so
            v = found.verdict
            fail(f"convcheck: {v.category}: {v.headline.replace(str(here), 'here')} (baseline {path}); "
                 f"remedy: {v.remedies[0]}")
    return result


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only an empty folder: anything written there is kept
    except OSError:
        pass
