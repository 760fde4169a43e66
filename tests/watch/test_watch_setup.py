"""``convcheck diff`` on watched runs set up differently: a different optimizer, learning rate or schedule,
different initial weights are ``setup`` verdicts, never nondeterminism; one run whose loss explodes is a
``setup`` finding, not ok; an ``exp`` overflow in own code gets ``compare``'s remedy for exp."""

from __future__ import annotations

import json

import pytest
import torch

from convcheck.cli.main import main
from convcheck.report.verdict_lines import unwrapped

from .setup_loops import cnn_run, exp_run, regression_run


def diff(capsys, *args) -> tuple[int, str, str]:
    code = main(["diff", *map(str, args), "--no-save"])
    out, err = capsys.readouterr()
    return code, unwrapped(out), err  # the prose wrapped at 100 columns read whole


def verdict(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("verdict: "))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("setup")
    cnn_run(tmp / "adam")
    cnn_run(tmp / "adam_lr3", lr=3.0)
    cnn_run(tmp / "sgd", optimizer="sgd", lr=0.05)
    cnn_run(tmp / "sgd_lr50", optimizer="sgd", lr=50.0)
    cnn_run(tmp / "adam_seed7", model_seed=7)
    cnn_run(tmp / "adam_decay_at_2", lr_at={2: 1e-4})
    cnn_run(tmp / "adam_again")
    cnn_run(tmp / "sgd_momentum", optimizer="sgd", lr=0.05, momentum=0.9)
    cnn_run(tmp / "adam_decay", weight_decay=0.1)
    cnn_run(tmp / "adam_foreach", foreach=True)
    cnn_run(tmp / "adam_tensor_lr", lr=torch.tensor(1e-3))
    return tmp


def test_a_different_learning_rate_is_setup_not_nondeterminism(runs, capsys):
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_lr3")
    assert code == 1
    assert verdict(out) == ("verdict: setup: different learning rates: B's learning rate is 3.0 where A's is 0.001 "
                            "from step 0")
    assert "use_deterministic_algorithms" not in out and "nondeterminism" not in out
    assert "remedy: give both runs the same learning rate and schedule" in out
    code, out, _ = diff(capsys, runs / "sgd", runs / "sgd_lr50")
    assert code == 1
    assert verdict(out) == ("verdict: setup: different learning rates: B's learning rate is 50.0 where A's is 0.05 "
                            "from step 0")


def test_a_different_optimizer_is_named_before_its_learning_rate(runs, capsys):
    code, out, _ = diff(capsys, runs / "adam", runs / "sgd", "--json")
    assert code == 1
    v = json.loads(out)["verdict"]
    assert v["category"] == "setup" and v["headline"] == "different optimizers: A uses Adam, B uses SGD"
    assert "also: different learning rates: B's learning rate is 0.05 where A's is 0.001 from step 0" in v["evidence"]


def test_the_same_optimizer_with_other_hyperparameters_is_setup(runs, capsys):
    """SGD with and without momentum, Adam with and without weight decay: the same class and learning rate,
    so only the recorded settings tell them apart - never 'nondeterminism'."""
    code, out, _ = diff(capsys, runs / "sgd", runs / "sgd_momentum")
    assert code == 1
    assert verdict(out) == "verdict: setup: different SGD settings: A's momentum is 0.0, B's is 0.9"
    assert "nondeterminism" not in out
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_decay")
    assert code == 1
    assert verdict(out) == "verdict: setup: different Adam settings: A's weight_decay is 0.0, B's is 0.1"
    # the same update by another kernel (foreach=True: what a GPU run often picks) is no setup difference
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_foreach")
    assert "setup" not in verdict(out)
    # lr=torch.tensor(1e-3) is float32's 0.0010000000474974513: the same learning rate
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_tensor_lr")
    assert "learning rate" not in out


def test_a_schedule_that_differs_later_names_the_step(runs, capsys):
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_decay_at_2")
    assert code == 1
    assert verdict(out) == ("verdict: setup: different learning rates: B's learning rate is 0.0001 where A's is "
                            "0.001 from step 2 (the same before: 0.001)")


def test_different_initial_weights_are_setup_naming_the_first_parameter(runs, capsys):
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_seed7")
    assert code == 1
    assert "data: the same batches at every aligned step" in out
    assert verdict(out) == ("verdict: setup: different initial weights: conv1.weight already differs at step 0, "
                            "before any update")
    assert "remedy: seed the model's construction identically on both sides (torch.manual_seed(s)" in out
    assert "nondeterminism" not in out


def test_the_same_setup_twice_is_still_ok(runs, capsys):
    code, out, _ = diff(capsys, runs / "adam", runs / "adam_again")
    assert code == 0 and verdict(out) == "verdict: ok: the two watched runs agree within rounding at every aligned step"
    assert "setup:" not in out


def test_one_run_whose_loss_explodes_is_not_ok(runs, capsys):
    code, out, _ = diff(capsys, runs / "adam_lr3", "--judge", "cpu:float64")
    assert code == 1
    line = verdict(out)
    assert line.startswith("verdict: setup: the loss explodes: ") and " at step 1, " in line
    assert line.endswith("its first value 0.9979 (step 0)")
    assert "remedy: lower the learning rate, or clip the gradients" in out
    code, out, _ = diff(capsys, runs / "sgd_lr50", "--judge", "cpu:float64", "--json")
    v = json.loads(out)["verdict"]
    assert code == 1 and v["category"] == "setup" and v["sub_cause"] == "divergence"
    code, out, _ = diff(capsys, runs / "adam", "--judge", "cpu:float64")  # 1.00, 1.17, 1.12, 1.09: not exploding
    assert code == 0
    assert verdict(out) == "verdict: ok: every replayed layer is within its floor and the run stays finite"


def test_a_loss_that_never_falls_and_ends_far_above_its_start_is_not_ok(tmp_path, capsys):
    losses = regression_run(tmp_path / "slow", lr=0.8, steps=4)  # 18.6, 19.2, 43.9, 115: never 10x in one step
    assert max(losses) < 10 * losses[0]
    code, out, _ = diff(capsys, tmp_path / "slow", "--judge", "cpu:float64")
    assert code == 1
    assert verdict(out).startswith("verdict: setup: the loss never falls below its first value 18.57 (step 0) and "
                                   "ends at 114.9 (step 3), ")
    regression_run(tmp_path / "fine", lr=0.5, steps=4)  # 18.6, 3.05, 1.06, 0.48
    code, out, _ = diff(capsys, tmp_path / "fine", "--judge", "cpu:float64")
    assert code == 0 and verdict(out).startswith("verdict: ok: ")


def test_an_exp_overflow_in_own_code_gets_the_remedy_for_exp(tmp_path, capsys):
    exp_run(tmp_path / "fp32", half=False)
    exp_run(tmp_path / "fp16", half=True)
    code, out, _ = diff(capsys, tmp_path / "fp32", tmp_path / "fp16")
    assert code == 1
    assert verdict(out) == "verdict: numerics: B turns non-finite at step 2 in soft (module: exp, forward); A stays finite"
    remedies = [x for x in out.splitlines() if x.startswith("  remedy: ")]
    assert remedies[0].startswith("  remedy: subtract the maximum before exp")
    assert "sqrt(d)" not in out
    code, out, _ = diff(capsys, tmp_path / "fp16", "--judge", "cpu:float64")
    assert code == 1 and "remedy: subtract the maximum before exp" in out
