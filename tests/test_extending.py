"""Extending convcheck is one file plus its test: a verdict rule, an env rule, a zoo model, a target kind.

Each test drops a new module into the package's search path (a temporary folder, not the source tree)
and checks that the package's own discovery picks it up, registered, with nothing else edited.
"""

from __future__ import annotations

import sys
import textwrap

import pytest


@pytest.fixture
def extra_module(tmp_path, monkeypatch):
    """Write ``name.py`` with ``source`` into a folder appended to ``package.__path__``."""
    added = []

    def add(package, name: str, source: str):
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        added.append(f"{package.__name__}.{name}")

    yield add
    for name in added:
        sys.modules.pop(name, None)


def test_a_verdict_rule_is_one_module(extra_module, monkeypatch):
    from convcheck.diagnose import registry, rules

    monkeypatch.setattr(registry, "RULES", list(registry.RULES))
    extra_module(rules, "zz_example", """
        from convcheck.diagnose.registry import verdict_rule

        @verdict_rule("V990", "example-rule", priority=999, category="setup", headline="example")
        def example_rule(ev):
            return None
    """)
    assert "zz_example" in rules.import_rule_modules()
    assert "example-rule" in [r.name for r in registry.RULES]


def test_an_env_rule_is_one_module(extra_module, monkeypatch):
    from convcheck.env import rules
    from convcheck.env.rules import base

    monkeypatch.setattr(base, "RULES", list(base.RULES))
    extra_module(rules, "zz_example", """
        from convcheck.env.rules.base import make_finding, rule

        @rule
        def example_rule(fp):
            return [make_finding("MATH901", "warn", "an example", "none needed", "this test")]
    """)
    assert "zz_example" in rules.import_rule_families()
    assert "example_rule" in [r.__name__ for r in base.RULES]


def test_a_zoo_model_is_one_module(extra_module):
    import reference_models
    from reference_models import registry

    extra_module(reference_models, "zz_tiny", """
        from torch import nn

        from reference_models.spec import ModelSpec


        def zz_tiny(num_classes=10):
            return nn.Sequential(nn.Flatten(), nn.Linear(4, num_classes))


        SPECS = (ModelSpec("zz_tiny", zz_tiny, (1, 2, 2), 10, "a tiny test model"),)
    """)
    registry.discover.cache_clear()
    try:
        assert "zz_tiny" in registry.list_models()
        assert registry.get_model("zz_tiny")(__import__("torch").zeros(1, 1, 2, 2)).shape == (1, 10)
    finally:
        registry.discover.cache_clear()


def test_a_target_kind_is_one_module(extra_module, monkeypatch):
    from convcheck.targets import runners
    from convcheck.targets.runners import registry

    monkeypatch.setattr(registry, "_REGISTRY", list(registry._REGISTRY))
    extra_module(runners, "zz_kind", """
        from convcheck.targets.runners.plain import FloatRunner
        from convcheck.targets.runners.registry import register


        @register
        class ExampleRunner(FloatRunner):
            modes = ("zz-example",)
            devices = ("cpu",)
            descriptions = {"zz-example": "an example kind"}
    """)
    registry.import_kinds(runners.__name__, runners.__path__)
    assert "zz-example" in registry.known_modes()


def _watched_regression(out, steps: int) -> None:
    """A user's loop: a small regression MLP, SGD, watched for ``steps`` steps."""
    import torch
    import torch.nn as nn

    import convcheck

    convcheck.seed_everything(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    with convcheck.watch(model, opt, out=out) as w:
        for _ in range(steps):
            x = torch.randn(16, 6, generator=g)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_a_watched_detector_is_one_module(extra_module, monkeypatch, tmp_path):
    """A new cause for ``convcheck diff A B``: one module in ``diagnose/detectors/`` registering one check; the
    diff runs it in its order and rule W001 makes its finding the verdict."""
    from convcheck.analysis.diff import diff_watched
    from convcheck.diagnose import detectors, watched_checks

    _watched_regression(tmp_path / "a", steps=4)
    _watched_regression(tmp_path / "b", steps=7)
    assert diff_watched(tmp_path / "a", tmp_path / "b").verdict.category == "ok"  # 4 aligned steps agree

    monkeypatch.setattr(watched_checks, "PAIR_CHECKS", list(watched_checks.PAIR_CHECKS))
    extra_module(detectors, "zz_run_length", """
        from convcheck.diagnose.watched_checks import pair_check
        from convcheck.diagnose.watched_evidence import Setup

        @pair_check("run-length", order=5)
        def run_length(a, b, steps):
            if len(a.steps) == len(b.steps):
                return None
            return Setup(f"the runs trained {len(a.steps)} and {len(b.steps)} steps", "run length",
                         evidence=["compared over the first steps only"], remedies=["train both as long"], step=0)
    """)
    d = diff_watched(tmp_path / "a", tmp_path / "b")
    assert d.verdict.category == "setup"
    assert d.verdict.headline.startswith("the runs trained 4 and 7 steps"), d.verdict.headline
    assert "zz_run_length" in watched_checks.import_detector_modules()


def test_a_remedy_with_its_action_is_one_catalogue_entry(monkeypatch):
    """Issue 46: one ``declare`` - the text, the cause it answers, the change verify makes - and a verdict that gives
    it has its action tried, picked by id (no deriver, no word list edited)."""
    from convcheck.diagnose import catalogue
    from convcheck.diagnose.verdict import Verdict
    from convcheck.plan.config import CompareConfig
    from convcheck.plan.recipe import build_recipe
    from convcheck.targets.spec import Target
    from convcheck.verify.actions import Context, actions_for

    monkeypatch.setattr(catalogue, "CATALOGUE", dict(catalogue.CATALOGUE))
    halve = catalogue.declare("halve-lr", "halve the learning rate", answers=("loss plateau",),
                              actions=catalogue.Change("halve-lr", lr_factor=0.5))

    recipe = build_recipe(CompareConfig(optimizer="sgd"))
    v = Verdict("setup", "h", remedies=["check the data", halve.remedy()], target="cpu", sub_cause="loss plateau")
    first = actions_for(Context(v, Target.parse("cpu"), True, None, recipe))[0]
    assert (first.kind, first.lr_factor, first.text) == ("halve-lr", 0.5, "with the learning rate times 0.5")
    probe = [__import__("torch").zeros(1, requires_grad=True)]
    assert (first.recipe(recipe).make_optimizer(probe).param_groups[0]["lr"]
            == 0.5 * recipe.make_optimizer(probe).param_groups[0]["lr"])
    # a cause the entry does not answer: not asked for
    other = Verdict("setup", "h", remedies=[halve.remedy()], target="cpu", sub_cause="dead ReLUs")
    assert "halve-lr" not in [a.kind for a in actions_for(Context(other, Target.parse("cpu"), True, None, recipe))]


def test_a_layer_statistic_is_one_declaration(monkeypatch, tmp_path, capsys):
    """Issue 46: a new per-layer statistic (mean |x|) is one ``declare``: the watch records it in the same
    one-pass read, the reader checks it, and ``convcheck diff --out`` tables it (CSV and HTML) with its
    relative error B against A."""
    import csv

    import torch
    import torch.nn as nn

    import convcheck
    from convcheck.cli.main import main
    from convcheck.runformat import statistics
    from convcheck.runformat.reader import open_watched

    monkeypatch.setattr(statistics, "STATISTICS", statistics.STATISTICS)  # the declaration undone afterwards
    statistics.declare(statistics.Statistic(
        "l1_mean", "mean |x|", "scale", optional=True, digits=4,
        reduce=lambda x, acc: x.abs().sum(dtype=acc), finish=lambda total, finite: total / finite if finite else 0.0))

    def record(out, head_scale):
        convcheck.seed_everything(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        with torch.no_grad():
            model[2].weight.mul_(head_scale), model[2].bias.mul_(head_scale)  # B's head outputs twice A's
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with convcheck.watch(model, opt, out=out) as w:
            for _ in range(2):
                x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)

    record(tmp_path / "a", 1.0)
    record(tmp_path / "b", 2.0)
    row = open_watched(tmp_path / "a").steps[0]["layers"]["0"]  # recorded, and read back through the reader's check
    assert row["l1_mean"] > 0
    main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")])
    capsys.readouterr()
    with open(tmp_path / "rep" / "watch_layers.csv", newline="") as f:
        rows = {(r["step"], r["layer"]): r for r in csv.DictReader(f)}
    assert "l1_mean_rel" in next(iter(rows.values()))
    assert float(rows[("0", "0")]["l1_mean_rel"]) == 0.0  # the same first layer, weights and batch
    assert abs(float(rows[("0", "2")]["l1_mean_rel"]) - 0.5) < 1e-6  # B's head outputs twice A's: |2a - a| / 2a
    page = (tmp_path / "rep" / "watch_report.html").read_text()
    assert "l1_mean_rel" in page and "mean |x|: relative error" in page
