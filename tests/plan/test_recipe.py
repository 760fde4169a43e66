"""convcheck.plan.recipe: the user's loss, optimizer, schedule and clipping, through the API and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from convcheck.cli.main import main
from convcheck.plan.config import CompareConfig
from convcheck.errors import UsageError
from convcheck.pipeline import compare
from convcheck.plan.recipe import build_recipe
from convcheck.targets.spec import Target

T = Target.parse

SMALL = dict(input_shape=(1, 4, 4), num_classes=3, envelope=0, batch_size=8, env_findings=[])


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _recipe(**kw):
    return build_recipe(CompareConfig(**kw))


def _lr(result, arm="cpu"):
    return [float(v) for v in result.training.arm_curve(arm)["lr"]]


# --- loss ------------------------------------------------------------------------------------------

def test_a_user_loss_is_used_on_every_arm():
    calls = []

    def smooth_ce(output, target):
        calls.append(output.dtype)
        return nn.functional.cross_entropy(output.float(), target, label_smoothing=0.1)

    r = compare(mlp, "cpu,cpu:bf16", steps=3, loss=smooth_ce, **SMALL)
    # parity (judge, cpu, bf16, the two reruns) and 3 steps of 3 arms
    assert torch.bfloat16 in calls and torch.float64 in calls and torch.float32 in calls
    assert r.to_summary()["config"]["loss"] == "smooth_ce"


@pytest.mark.parametrize("fn, words", [
    (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"), r"shape \(8,\), expected a scalar"),
    (lambda out, y: 1.0, "returned float"),
    (lambda out, y: nn.functional.cross_entropy(out, y).detach(), "no gradient"),
    (lambda out, y: 1 / 0, "raised ZeroDivisionError"),
])
def test_a_bad_loss_is_a_one_line_usage_error(fn, words):
    with pytest.raises(UsageError, match=words):
        compare(mlp, "cpu,cpu:bf16", steps=2, loss=fn, **SMALL)


def test_loss_from_a_file_through_the_cli(tmp_path, capsys):
    (tmp_path / "losses.py").write_text(
        "import torch.nn.functional as F\n\ndef smooth(output, target):\n"
        "    return F.cross_entropy(output.float(), target, label_smoothing=0.05)\n")
    out = tmp_path / "run"
    code = main(["compare", "--model", "lenet", "--targets", "cpu,cpu:bf16", "--steps", "2", "--batch-size", "4",
                 "--envelope", "0", "--loss", f"{tmp_path}/losses.py:smooth", "--out", str(out)])
    assert code in (0, 1)
    assert json.loads((out / "summary.json").read_text())["config"]["loss"] == "losses.smooth"


@pytest.mark.parametrize("spec, words", [("nowhere.py:fn", "not found"), ("math:nope", "has no loss 'nope'"),
                                         ("math:pi", "not a callable")])
def test_a_loss_spec_that_cannot_load_is_exit_2(spec, words, capsys):
    code = main(["compare", "--model", "lenet", "--loss", spec, "--no-save"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1


# --- optimizer -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("AdamW", torch.optim.AdamW),
                                       ("RMSprop", torch.optim.RMSprop), ("adagrad", torch.optim.Adagrad)])
def test_any_torch_optimizer_by_name(name, cls):
    opt = _recipe(optimizer=name, lr=0.01).make_optimizer([nn.Parameter(torch.ones(2))])
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.01


def test_optimizer_options_reach_the_optimizer():
    opt = _recipe(optimizer="sgd", lr=0.1, momentum=0.8, nesterov=True, weight_decay=5e-4).make_optimizer(
        [nn.Parameter(torch.ones(2))])
    g = opt.param_groups[0]
    assert (g["momentum"], g["nesterov"], g["weight_decay"]) == (0.8, True, 5e-4)
    assert _recipe(optimizer="sgd").make_optimizer([nn.Parameter(torch.ones(1))]).param_groups[0]["momentum"] == 0.9
    adam = _recipe(optimizer="adam", betas=(0.8, 0.99), eps=1e-6).make_optimizer([nn.Parameter(torch.ones(1))])
    assert adam.param_groups[0]["betas"] == (0.8, 0.99) and adam.param_groups[0]["eps"] == 1e-6


@pytest.mark.parametrize("kw, words", [
    (dict(optimizer="adam", momentum=0.9), "Adam takes no momentum"),
    (dict(optimizer="lbfgs"), "needs a closure"),
    (dict(optimizer="nosuch"), "unknown optimizer 'nosuch'"),
])
def test_optimizer_mistakes_are_usage_errors(kw, words):
    with pytest.raises(UsageError, match=words):
        _recipe(**kw)


def test_an_optimizer_factory_gets_the_parameters():
    seen = []

    def factory(params):
        params = list(params)
        seen.append(len(params))
        return torch.optim.SGD(params, lr=0.05)

    r = compare(mlp, "cpu,cpu:float64", steps=2, optimizer=factory, **SMALL)
    # one call per arm, and one over the judge's model whose param_groups are read (stages.measure_weight_decay)
    assert seen == [4, 4, 4] and _lr(r) == [0.05, 0.05]
    with pytest.raises(UsageError, match="returned int, not a torch.optim.Optimizer"):
        compare(mlp, "cpu,cpu:float64", steps=2, optimizer=lambda params: 42, **SMALL)


# --- schedule --------------------------------------------------------------------------------------

def test_cosine_with_warmup_lr_per_step_is_in_the_curves():
    r = compare(mlp, "cpu,cpu:float64", steps=8, optimizer="sgd", lr=0.1, schedule="cosine", warmup=3, **SMALL)
    lr = _lr(r)
    assert lr[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])  # linear warm-up from lr/(N+1)
    assert lr[4] < lr[3] and lr[-1] < lr[4] and all(b <= a for a, b in zip(lr[3:], lr[4:]))
    assert _lr(r, "cpu:float64") == lr  # every arm has its own, identical schedule


def test_step_and_onecycle_schedules():
    lr = _lr(compare(mlp, "cpu,cpu:float64", steps=6, optimizer="sgd", lr=0.1, schedule="step:2:0.5", **SMALL))
    assert lr == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    lr = _lr(compare(mlp, "cpu,cpu:float64", steps=10, optimizer="sgd", lr=0.1, schedule="onecycle", **SMALL))
    assert max(lr) == pytest.approx(0.1, rel=1e-6) and lr[0] < 0.01 and lr[-1] < lr[0]


@pytest.mark.parametrize("kw, words", [(dict(schedule="step:0:0.5"), "EVERY >= 1"),
                                       (dict(schedule="sawtooth"), "unknown schedule 'sawtooth'")])
def test_schedule_mistakes(kw, words):
    with pytest.raises(UsageError, match=words):
        _recipe(**kw)


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(UsageError, match="--warmup 5 is not shorter than the run"):
        compare(mlp, "cpu,cpu:float64", steps=3, warmup=5, **SMALL)


def test_a_schedule_factory_gets_the_optimizer_and_steps():
    def halve_each_step(opt, steps):
        assert steps == 4
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)

    lr = _lr(compare(mlp, "cpu,cpu:float64", steps=4, optimizer="sgd", lr=0.8, schedule=halve_each_step, **SMALL))
    assert lr == pytest.approx([0.8, 0.4, 0.2, 0.1])


# --- clipping --------------------------------------------------------------------------------------

def test_clip_grad_norm_clips_and_says_so():
    r = compare(mlp, "cpu,cpu:float64", steps=3, optimizer="sgd", lr=0.1, clip_grad_norm=1e-3, **SMALL)
    c = r.training.arm_curve("cpu")
    assert c["clipped"].all()
    free = compare(mlp, "cpu,cpu:float64", steps=3, optimizer="sgd", lr=0.1, **SMALL)
    assert not free.training.arm_curve("cpu")["clipped"].any()
    # clipped steps move the weights far less
    assert r.training.outcomes[T("cpu")].final_loss > free.training.outcomes[T("cpu")].final_loss - 1e-9
    assert math.isfinite(float(c["grad_norm"].iloc[-1]))


def test_cli_recipe_options(tmp_path):
    out = tmp_path / "run"
    code = main(["compare", "--model", "lenet", "--targets", "cpu,cpu:float64", "--steps", "6", "--batch-size", "4",
                 "--envelope", "0", "--optimizer", "SGD", "--momentum", "0.9", "--weight-decay", "5e-4",
                 "--schedule", "cosine", "--warmup", "2", "--clip-grad-norm", "5", "--out", str(out)])
    assert code in (0, 1)
    cfg = json.loads((out / "summary.json").read_text())["config"]
    assert cfg["optimizer"] == "sgd" and cfg["schedule"] == "cosine" and cfg["warmup"] == 2
    assert cfg["momentum"] == 0.9 and cfg["weight_decay"] == 5e-4 and cfg["clip_grad_norm"] == 5
    assert "lr" in (out / "curves.csv").read_text().splitlines()[0].split(",")


def test_settings_torch_refuses_are_a_usage_error_naming_them(capsys):
    """``--momentum 0 --nesterov`` was an internal error (exit 4) when the first arm built its optimizer."""
    from convcheck.cli.main import main

    code = main(["compare", "--model", "lenet", "--optimizer", "sgd", "--momentum", "0", "--nesterov", "--steps", "2",
                 "--no-save"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert line.startswith("convcheck: error: optimizer SGD refuses these settings (lr=0.001, momentum=0.0, "
                           "nesterov=True): ValueError: Nesterov momentum requires a momentum")


def test_a_schedule_factory_returning_none_is_refused(tmp_path, capsys):
    """A forgotten ``return`` in the user's schedule factory would train at a constant lr, silently (issue 27)."""
    from convcheck.cli.main import main

    (tmp_path / "sched.py").write_text("import torch\n\ndef cosine(opt, steps):\n"
                                       "    torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)\n")
    code = main(["compare", "--model", "lenet", "--schedule", f"{tmp_path / 'sched.py'}:cosine", "--steps", "2",
                 "--no-save"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "schedule factory 'sched.cosine' returned None; return the scheduler it builds" in line


def test_an_optimizer_factorys_own_lr_is_the_one_the_verdict_reads(tmp_path):
    """A factory with lr 8 that makes training explode: the evidence the rules word their headlines from
    ("learning rate X is too high") holds 8, what ran, not the command line's default 0.001 it never read
    (issue 34)."""
    from convcheck.diagnose import gather
    from convcheck.diagnose.detectors import training as S

    (tmp_path / "opt.py").write_text("import torch\n\n\ndef make(params):\n"
                                     "    return torch.optim.SGD(params, lr=8.0)\n")
    r = compare(mlp, "cpu,cpu:float64", steps=30, optimizer=f"{tmp_path / 'opt.py'}:make", **SMALL)
    assert set(_lr(r)) == {8.0}
    assert r.verdict.category == "setup" and "every arm fails, the float64 judge included" in r.verdict.headline
    ev = gather(r)
    assert ev.lr == 8.0
    assert [s.extra["lr"] for s in ev.judge_problems if s.name == S.EXPLODING_GRADIENTS] == [8.0]
