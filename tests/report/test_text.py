"""convcheck.report.text: the terminal summary."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from convcheck.pipeline import compare
from convcheck.report.summary import fmt
from convcheck.report.text import make_console, render_compare
from convcheck.targets.spec import Target

T = Target.parse


class NaiveNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        var = (x * x).mean(dim=1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


def long_named_net():
    fc = nn.Linear(64, 32)
    with torch.no_grad():
        fc.bias.fill_(30.0)
    encoder = nn.Sequential(OrderedDict(input_projection=fc, naive_variance_norm=NaiveNorm()))
    return nn.Sequential(OrderedDict(flatten=nn.Flatten(), encoder=encoder, relu=nn.ReLU(),
                                     classifier=nn.Linear(32, 4)))


@pytest.fixture(scope="module")
def culprit():
    return compare(long_named_net, "cpu,cpu:bf16", steps=2, batch_size=8, envelope=0,
                   input_shape=(1, 8, 8), num_classes=4, env_findings=[])


def _render(result) -> str:
    buf = io.StringIO()
    render_compare(result, make_console(buf))
    return buf.getvalue()


def test_layer_names_and_flags_are_shown_whole(culprit):
    assert culprit.parity.first_flagged[T("cpu:bf16")] == "encoder.naive_variance_norm"
    text = _render(culprit)
    table = text.split("One-step parity")[1].split("First flagged layer")[0]
    assert "encoder.naive_variance_norm" in table  # not "encoder.na…"
    assert "FLAGGED" in table
    assert "own/floor" in table and "floor" in table and "propagated" in table
    assert "encoder.naive_variance_norm (NaiveNorm)" in table  # the module class next to the path
    assert "…" not in table
    # float32 loses 1e-4 there: flagged (far above its floor), a note in the verdict (below min_error)
    assert ("First flagged layer  cpu: encoder.naive_variance_norm, cpu:bf16: encoder.naive_variance_norm"
            in text)
    assert "note (cpu): " in text and "below min_error" in text


def test_plain_text_when_not_a_terminal(culprit):
    text = _render(culprit)
    assert "\x1b[" not in text  # no ANSI codes in a pipe or a file


def test_text_with_brackets_is_printed_literally(culprit, monkeypatch):
    """Verdicts quote code (E[x^2]-E[x]^2) and notes quote paths: none of it is rich markup."""
    from dataclasses import replace

    result = replace(culprit, notes=["data from /tmp/[run]/x.npz [/red] done"])
    if result.verdict is not None:
        v = replace(result.verdict, headline="uses E[x^2]-E[x]^2 [bold]", evidence=["a [/] b"],
                    remedies=["use torch.var, not E[x^2]-E[x]^2"])
        result = replace(result, verdict=v)
    text = _render(result)
    assert "data from /tmp/[run]/x.npz [/red] done" in text
    if result.verdict is not None:
        assert "uses E[x^2]-E[x]^2 [bold]" in text
        assert "evidence: a [/] b" in text
        assert "use torch.var, not E[x^2]-E[x]^2" in text


@pytest.mark.parametrize("value, text", [
    (None, "-"), (True, "yes"), (False, "no"), (7, "7"), (float("nan"), "-"), (float("inf"), "inf"),
    (-float("inf"), "-inf"), (0.0, "0"), (0.5, "0.5"), (2.3026, "2.303"), (1.5e-7, "1.50e-07"),
])
def test_fmt(value, text):
    assert fmt(value) == text


def _table_lines(text: str, start: str, end: str) -> list[str]:
    return text.split(start, 1)[1].split(end, 1)[0].splitlines()


@pytest.mark.parametrize("width", [80, 100, 160])
def test_tables_fit_the_width_and_keep_the_flag(culprit, width):
    """Issue 26: at 100 columns the propagated and flag columns were cut off, so FLAGGED never showed."""
    buf = io.StringIO()
    render_compare(culprit, make_console(buf, width=width))
    text = buf.getvalue()
    parity = _table_lines(text, "One-step parity", "First flagged layer")
    curves = _table_lines(text, "Loss per step", "Training")
    for line in parity + curves:
        assert len(line) <= width, line
    table = "\n".join(parity)
    assert "flag" in table and "FLAGGED" in table and "own/floor" in table
    assert "…" not in "\n".join(parity + curves)  # nothing cut: dropped or wrapped instead
    header = next(line for line in parity if "layer (module)" in line)
    assert ("propagated" in header) == (width >= 160)  # the low-value columns go first when narrow
    # the recipe line breaks between its parts, never inside one
    recipe = text.split("recipe: ", 1)[1].split("judge ", 1)[0]
    assert all(len(line) <= width for line in recipe.splitlines())


def test_columns_is_honoured_when_piped():
    from convcheck.report.text import PIPED_WIDTH, output_width

    pipe = io.StringIO()
    assert output_width(pipe, {"COLUMNS": "80"}) == 80
    assert output_width(pipe, {}) == PIPED_WIDTH
    assert output_width(pipe, {"COLUMNS": "wide"}) == PIPED_WIDTH
    assert make_console(pipe).width == PIPED_WIDTH or "COLUMNS" in __import__("os").environ


def test_a_long_recipe_breaks_between_its_parts():
    from convcheck.report.text import _wrapped_parts

    buf = io.StringIO()
    parts = ["loss cross-entropy", "sgd lr 0.05 (momentum 0.9, nesterov, weight decay 0.0005)",
             "schedule cosine + 5 warm-up steps", "clip grad norm 1"]
    _wrapped_parts(make_console(buf, width=72), "recipe: ", parts, "; ")
    lines = buf.getvalue().splitlines()
    assert any(line.strip() == "clip grad norm 1" or line.endswith("clip grad norm 1") for line in lines)
    assert all(len(line) <= 72 for line in lines)
    assert "clip grad" not in lines[0] or "clip grad norm 1" in lines[0]


@pytest.fixture(scope="module")
def with_envelope():
    return compare("lenet", "cpu,cpu:float64", steps=10, batch_size=8, envelope=3, env_findings=[])


@pytest.mark.parametrize("width", range(80, 141, 4))
def test_no_number_is_cropped(with_envelope, width):
    """rich crops a table that is a few columns too wide without a mark: every number must still be whole."""
    buf = io.StringIO()
    render_compare(with_envelope, make_console(buf, width=width))
    text = buf.getvalue()
    curves = "\n".join(_table_lines(text, "Loss per step", "Training"))
    c = with_envelope.training.curves
    spread = c[c["role"] == "envelope"].groupby("step")["dist_ref"].max()
    for step, value in spread.items():
        assert f" {fmt(value)}" in curves, (step, fmt(value), curves)
    for value in c[c["arm"] == "cpu"]["loss"]:
        assert f" {fmt(value, 3)}" in curves
    assert all(len(line) <= width for line in curves.splitlines())


def _nesterov_factory(params):
    """A user's optimizer factory: its own lr, momentum and nesterov (convcheck's --lr does not reach it)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)


def test_the_recipe_line_shows_an_optimizer_factorys_own_lr():
    """New-user trial 5: the header printed the config's lr 0.001 beside the factory's name, not the 0.05 it uses."""
    from types import SimpleNamespace

    from convcheck.plan.config import CompareConfig
    from convcheck.plan.recipe import build_recipe
    from convcheck.report.summary import recipe_line

    cfg = CompareConfig(optimizer=_nesterov_factory)
    line = recipe_line(SimpleNamespace(config=cfg, recipe=build_recipe(cfg)))
    assert "_nesterov_factory lr 0.05 (momentum 0.9, nesterov)" in line
    assert "lr 0.001" not in line
