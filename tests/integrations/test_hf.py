"""``convcheck.integrations.hf.ConvcheckCallback`` against the real transformers Trainer (slow: the ``hf``
extra, installed by ``.ci/run``): ``examples/watch_hf.py`` run as a user would, diffed."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest


from convcheck.cli.main import main

pytestmark = pytest.mark.slow  # and skipped where the extra is missing (importorskip in
# the fixtures, so that collecting the fast suite never imports the framework)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "watch_hf.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("hf")
    example = runpy.run_path(str(EXAMPLE))
    results = {}
    try:
        for name, precision in (("fp32", "fp32"), ("fp32_again", "fp32"), ("bf16", "bf16")):
            mp.setenv("CONVCHECK_PRECISION", precision)
            results[name] = example["main"](str(tmp / name))
    finally:
        mp.undo()
    return tmp, results


def test_each_trainer_step_is_recorded_with_the_models_loss(runs):
    tmp, results = runs
    manifest = json.loads((tmp / "fp32" / "manifest.json").read_text())
    steps = [json.loads(line) for line in (tmp / "fp32" / "steps.jsonl").read_text().splitlines()]
    assert manifest["complete"] and manifest["steps"] == 4 and manifest["model"]["class"] == "TinyClassifier"
    params = {p["name"] for p in manifest["model"]["parameters"]}
    for s in steps:
        assert s["stepped"] and len(s["batch_sha256"]) == 1 and set(s["grad_norms"]) == params
        assert s["layers"]["q"]["dtype"] == "float32"
    # the Trainer's own train_loss is the mean of the losses it computed: the ones recorded
    mean = sum(s["loss"] for s in steps) / len(steps)
    assert mean == pytest.approx(results["fp32"].training_loss, rel=1e-6)


def test_an_accumulated_step_is_one_watched_step_with_its_micro_batches(runs, tmp_path):
    tmp, _ = runs
    example = runpy.run_path(str(EXAMPLE))
    result = example["main"](str(tmp_path / "accumulated"), steps=2, accumulate=2)
    steps = [json.loads(line) for line in (tmp_path / "accumulated" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(s["stepped"] and len(s["batch_sha256"]) == 2 for s in steps)
    assert sum(s["loss"] for s in steps) / 2 == pytest.approx(result.training_loss, rel=1e-6)


def test_two_float32_runs_agree(runs, capsys):
    tmp, _ = runs
    assert main(["diff", str(tmp / "fp32"), str(tmp / "fp32_again"), "--no-save"]) == 0
    assert "verdict: ok: the two watched runs agree within rounding" in capsys.readouterr().out


def test_float32_against_bf16_autocast_over_four_steps_is_inconclusive(runs, capsys):
    """The runs part by bfloat16's rounding and four steps are too few to see whether it changes how they end: a
    precision is judged by its outcome, so the verdict says it could not be (exit 5) and how to get one."""
    tmp, _ = runs
    assert main(["diff", str(tmp / "fp32"), str(tmp / "bf16"), "--no-save"]) == 5
    out = " ".join(capsys.readouterr().out.split())
    assert "verdict: inconclusive: the runs part at step" in out and "as their precisions can explain" in out
    assert "A's layers output float32, B's bfloat16" in out and "remedy: record at least 10 steps in each run" in out
