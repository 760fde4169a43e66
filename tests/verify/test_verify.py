"""Verified remedies (issue 24): the failing arm re-run with each remedy applied as an action.

Each scenario is a small model, written as a user would, that really has the problem; the verify stage's
line is what the user reads (terminal, summary.json, assert_parity's message)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from convcheck import stages
from convcheck.assertions import failure_message
from convcheck.errors import UsageError
from convcheck.pipeline import compare
from convcheck.plan.config import CompareConfig
from convcheck.report.export import summary_dict
from convcheck.verify import NOT_VERIFIED, SKIPPED, VERIFIED, Context, actions_for
from convcheck.verify.actions import float32_snippet
from convcheck.verify.bisect import ddmin
from convcheck.verify.run import TRACK_MARGIN

from scenarios.verify_models import mlp, offset_norm_net, softmax_net, two_overflows_net

MNIST = dict(input_shape=(1, 28, 28), num_classes=10)

RUN = dict(steps=6, envelope=0, batch_size=16, optimizer="sgd", lr=0.1, env_findings=[], **MNIST)


@pytest.fixture(scope="module")
def softmax_run():
    return compare(softmax_net, "cpu,cpu:fp16", **RUN)


def test_keeping_the_overflowing_module_in_float32_verifies(softmax_run):
    r = softmax_run
    assert r.verdict.category == "numerics" and r.verdict.layer == "2" and r.verdict.target == "cpu:fp16"
    v = r.verification
    assert v.status == VERIFIED, v.line
    assert v.line.startswith("verified: with '2' in float32, cpu:fp16 ")
    assert "tracks the judge" in v.line
    assert [a.kind for a in v.attempts] == ["float32-module"]
    assert all(x == x for x in v.attempts[0].losses)  # every loss finite
    # shown where the user reads the verdict
    assert summary_dict(r)["schema"] == "convcheck.summary/2"
    assert summary_dict(r)["verification"]["status"] == "verified"
    assert "verified: with '2' in float32" in failure_message(r)
    # the cost of the default: one training run of one arm, measured
    assert v.cost_ratio > 0


def test_a_planted_wrong_diagnosis_does_not_verify(softmax_run):
    """The same run, its verdict pointing at the last Linear instead: keeping that one in float32 changes
    nothing, and the verification says the diagnosis is doubtful."""
    r = softmax_run
    run = stages.plan(softmax_net, r.config, **MNIST)
    wrong = dataclasses.replace(r, verdict=dataclasses.replace(r.verdict, layer="3"))
    v = stages.verify(run, wrong)
    assert v.status == NOT_VERIFIED, v.line
    assert v.line.startswith("not verified: with '3' in float32, cpu:fp16 still goes NaN/Inf at step")
    assert "the diagnosis may be wrong" in v.line


def test_no_verify_runs_nothing_extra(monkeypatch):
    import convcheck.verify.run as verify_run

    def refuse(*a, **k):
        raise AssertionError("--no-verify re-ran an arm")
    monkeypatch.setattr(verify_run, "run_training", refuse)
    r = compare(softmax_net, "cpu,cpu:fp16", verify=False, **{**RUN, "steps": 3})
    assert r.verdict.category == "numerics"
    assert r.verification.status == SKIPPED and r.verification.attempts == ()
    assert "verified" not in failure_message(r)


def test_bisection_finds_both_modules_and_its_snippet_makes_training_finite():
    r = compare(two_overflows_net, "cpu,cpu:fp16", verify=True, **{**RUN, "lr": 0.05})
    assert r.verdict.layer == "2", r.verdict.headline
    v = r.verification
    assert v.attempts[0].kind == "float32-module" and not v.attempts[0].verified  # '2' alone is not enough
    assert v.status == VERIFIED, v.line
    found = v.verified
    assert found.kind == "bisect" and "with '2', '6' in float32 (the smallest set" in found.text
    # the snippet, pasted into a plain float16 training loop, keeps it finite
    ns: dict = {}
    exec(found.snippet, ns)  # noqa: S102 - the snippet convcheck prints, run as a user would
    torch.manual_seed(0)
    model = two_overflows_net().half()
    unfixed = two_overflows_net().half()
    unfixed.load_state_dict(model.state_dict())
    model = ns["keep_in_float32"](model)
    x = torch.randn(16, 1, 28, 28).half()
    y = torch.randint(0, 10, (16,))
    for m, finite in ((unfixed, False), (model, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        loss = nn.functional.cross_entropy(m(x).float(), y)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss).item() is finite


def test_raising_adams_eps_in_a_float16_model_verifies():
    """Adam's default eps (1e-8) is 0 in float16: the first step makes weights 0/0 = NaN. Raised to 1e-4
    (the judge re-run with it too, as the recipe changed), the float16 model trains."""
    r = compare(mlp, "cpu,cpu:fp16", steps=10, envelope=0, batch_size=16, env_findings=[], verify=True, **MNIST)
    assert r.verdict.sub_cause == "non-finite weights", r.verdict.headline
    first = r.verification.attempts[0]
    assert first.kind == "optimizer-eps" and first.verified, first.line
    assert first.line.startswith("verified: with the optimizer's eps raised to 0.0001, cpu:fp16 converges")
    assert r.verification.status == VERIFIED and len(r.verification.attempts) == 1
    assert "eps=0.0001" in first.snippet


def test_by_default_a_remedy_that_needs_the_judge_rerun_is_not_run():
    r = compare(mlp, "cpu,cpu:fp16", steps=3, envelope=0, batch_size=16, env_findings=[], **MNIST)
    v = r.verification
    assert v.status == SKIPPED and v.attempts == ()
    assert "--verify runs it" in v.reason
    assert any(line.startswith("remedies not verified: 'with the optimizer's eps raised") for line in
               failure_message(r).splitlines())


def test_the_judge_is_rerun_for_a_setup_verdict():
    """An lr that makes even the float64 judge go NaN: a setup verdict; the remedies re-run the judge."""
    r = compare("lenet", "cpu,cpu:float64", steps=8, envelope=0, batch_size=16, optimizer="sgd", lr=3.0,
                env_findings=[], verify=True)
    assert r.verdict.category == "setup", r.verdict.headline
    v = r.verification
    assert v.attempts and all(a.arm == "the float64 judge" for a in v.attempts)
    # the remedies list the lower learning rate first, so it is tried first (before clipping): it converges
    assert r.verdict.remedies[0].startswith("lower the learning rate")
    assert [(a.kind, a.verified) for a in v.attempts] == [("lower-lr", True)]
    assert v.status == VERIFIED
    assert v.line.startswith("verified: with the learning rate 10x lower, the float64 judge converges")


def test_ddmin_finds_a_one_minimal_set():
    calls = []

    def passes(s):
        calls.append(s)
        return {"b", "g"} <= set(s)
    assert ddmin(list("abcdefgh"), passes) == ("b", "g")
    assert len(calls) == len(set(map(frozenset, calls)))  # each set probed once
    assert ddmin(list("abc"), lambda s: False) is None


def test_actions_fit_the_verdict_and_the_recipe():
    from convcheck.diagnose.verdict import Verdict
    from convcheck.plan.recipe import build_recipe
    from convcheck.targets.spec import Target

    fp16, model = Target.parse("cpu:fp16"), softmax_net()
    adam, sgd = build_recipe(CompareConfig()), build_recipe(CompareConfig(optimizer="sgd"))
    weights = Verdict("numerics", "h", target="cpu:fp16", layer="1", sub_cause="non-finite weights")
    kinds = [a.kind for a in actions_for(Context(weights, fp16, False, model, adam))]
    assert kinds == ["optimizer-eps", "clip-gradients", "lower-lr"]
    assert "optimizer-eps" not in [a.kind for a in actions_for(Context(weights, fp16, False, model, sgd))]
    forward = Verdict("numerics", "h", target="cpu:fp16", layer="2", sub_cause="non-finite forward")
    assert [a.kind for a in actions_for(Context(forward, fp16, False, model, sgd))] == ["float32-module"]
    # a module the model does not have, or a float32 target, is no float32 action
    assert actions_for(Context(dataclasses.replace(forward, layer="nope"), fp16, False, model, sgd)) == []
    assert actions_for(Context(forward, Target.parse("cpu"), False, model, sgd)) == []
    tf32 = Verdict("layer", "h", target="cpu:emulate-tf32", layer="1", sub_cause="own error above floor")
    (a,) = actions_for(Context(tf32, Target.parse("cpu:emulate-tf32"), False, model, sgd))
    assert a.kind == "tf32-off" and str(a.target) == "cpu"
    # the eps action changes the optimizer the recipe builds, and nothing else
    (eps,) = [a for a in actions_for(Context(weights, fp16, False, model, adam)) if a.kind == "optimizer-eps"]
    opt = eps.recipe(adam).make_optimizer([torch.zeros(1, requires_grad=True)])
    assert opt.param_groups[0]["eps"] == 1e-4 and opt.param_groups[0]["lr"] == 1e-3
    assert "keep_in_float32" in float32_snippet(("a",))


def test_verify_option_is_validated():
    with pytest.raises(UsageError, match="verify must be True, False or None"):
        CompareConfig(verify="yes")


MODELS = str(Path(__file__).resolve().parents[1] / "scenarios" / "verify_models.py")
CLI = ["compare", "--model", f"{MODELS}:softmax_net", "--input-shape", "1,28,28", "--classes", "10",
       "--targets", "cpu,cpu:fp16", "--steps", "4", "--envelope", "0", "--batch-size", "16", "--optimizer", "sgd",
       "--lr", "0.1"]


@pytest.mark.parametrize("flag", [None, "--no-verify"])
def test_the_terminal_and_summary_show_the_verification(flag, tmp_path, monkeypatch, capsys):
    from convcheck.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVCHECK_NO_PROGRESS", "1")
    code = main(CLI + ["--out", "run"] + ([flag] if flag else []))
    out = capsys.readouterr().out
    assert code == 1  # a numerics verdict: verified or not, the run still has the problem
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    page = (tmp_path / "run" / "report.html").read_text()
    if flag is None:
        assert "verified: with '2' in float32, cpu:fp16" in out
        assert summary["verification"]["status"] == "verified"
        # the HTML report: the line and the before/after loss plot (the arm as run, the re-run, the judge)
        png = (tmp_path / "run" / "verify.png").read_bytes()
        assert png.startswith(b"\x89PNG")
        assert "<h2>Verified remedy</h2>" in page and "verified: with &#x27;2&#x27; in float32" in page
        assert "alt='verify.png'" in page
    else:
        assert "verified" not in out
        assert summary["verification"]["status"] == "skipped"
        assert not (tmp_path / "run" / "verify.png").exists() and "Verified remedy" not in page


def test_a_rerun_without_verification_leaves_no_earlier_verify_png(tmp_path, monkeypatch, capsys):
    """--force over a folder whose earlier run had a remedy re-run: its verify.png does not stay beside a
    report that has none."""
    from convcheck.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVCHECK_NO_PROGRESS", "1")
    assert main(CLI + ["--out", "run"]) == 1
    assert (tmp_path / "run" / "verify.png").is_file()
    assert main(CLI + ["--out", "run", "--force", "--no-verify"]) == 1
    assert not (tmp_path / "run" / "verify.png").exists()


def test_a_rerun_converging_near_zero_is_held_to_the_judges_fall_not_to_its_tiny_final_loss():
    """Held-out: a hand LayerNorm kept in float32 on cpu:bf16 converged 2.292 -> 4.294e-05 against the judge's
    2.297 -> 3.477e-05 and was 'not verified: ends 24% from the judge's 3.477e-05'. Both reach ~0."""
    from convcheck.verify.run import _gap

    gap, of = _gap(4.294e-05, [2.297, 1.0, 3.477e-05])
    assert gap < 1e-5 and of == "of the judge's fall 2.297 -> 3.477e-05"
    gap, of = _gap(1.673, [1.6, 1.3, 1.119])  # a loss that fell less than it ends at: its own size
    assert abs(gap - (1.673 - 1.119) / 1.119) < 1e-12 and of == "of the judge's 1.119"
    gap, _ = _gap(0.9, [2.3, float("nan")])
    assert gap != gap  # no judge to measure against: NaN, never "verified"


@pytest.fixture(scope="module")
def offset_norm_run():
    return compare(offset_norm_net, "cpu,cpu:bf16", steps=10, input_shape=(1, 8, 8), num_classes=4, env_findings=[])


def test_a_broken_arms_envelope_does_not_widen_what_verifies(offset_norm_run):
    """New-user trial 3: the bf16 arm's own one-ulp envelope runs end near loss 27 against the judge's 0.75;
    their gap (3337%) was the allowance, so almost any re-run would have 'tracked' the judge. A broken
    envelope shows nothing of honest rounding: the fixed margin rules."""
    r = offset_norm_run
    assert r.verdict.target == "cpu:bf16" and r.verdict.layer == "norm", r.verdict.headline
    v = r.verification
    assert v.status == VERIFIED, v.line
    assert v.attempts[0].allowed_gap == TRACK_MARGIN
    assert v.line.endswith("; allowed 10%)"), v.line


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 3))


def test_a_loss_that_explodes_but_stays_finite_is_headlined_as_such_and_the_first_remedy_is_tried():
    """New-user trial 3: SGD lr 5 with momentum, the loss reaches 1.36e+03 at step 2 and stays finite; the
    NaN-like rule (>= 1000) caught it, and the headline said "non-finite loss". The default verification
    tried clipping (the second remedy listed) instead of the first, the lower learning rate."""
    r = compare(small_cnn, "cpu,cpu:bf16", steps=12, envelope=0, input_shape=(1, 8, 8), num_classes=3,
                optimizer="sgd", lr=5.0, momentum=0.9, schedule="cosine", env_findings=[])
    v = r.verdict
    assert v.category == "setup", v.headline
    assert v.headline.startswith("training setup: the loss explodes to "), v.headline
    assert "NaN-like by AUTOTRAINER's rule" in v.headline and "non-finite" not in v.headline
    assert v.evidence[0].startswith("exploding loss (cpu:float64): the loss explodes to "), v.evidence[0]
    assert "every loss stays finite" in v.evidence[0]
    assert v.remedies[0].startswith("lower the learning rate")
    assert [a.kind for a in r.verification.attempts] == ["lower-lr"], r.verification.line
    assert r.verification.line.startswith("verified: with the learning rate 10x lower, the float64 judge converges")


def test_a_rerun_loss_of_exactly_zero_says_so():
    from convcheck.verify.run import _loss_text

    assert _loss_text(0.0) == "exactly 0.0"
    assert _loss_text(1.234e-07) == "1.234e-07" and _loss_text(0.000123) == "0.000123"
    assert _loss_text(1.1109) == "1.111"
