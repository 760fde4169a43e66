"""convcheck.report.text: the terminal summary."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from convcheck.pipeline import compare
from convcheck.report.text import fmt, make_console, render_compare
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

    result = culprit
    monkeypatch.setattr(result, "notes", ["data from /tmp/[run]/x.npz [/red] done"])
    if result.verdict is not None:
        v = replace(result.verdict, headline="uses E[x^2]-E[x]^2 [bold]", evidence=["a [/] b"],
                    remedies=["use torch.var, not E[x^2]-E[x]^2"])
        monkeypatch.setattr(result, "verdict", v)
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
