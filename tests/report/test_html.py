"""Issue 26: report.html's header says the whole run: model, input, classes, loss, optimizer with its momentum
and nesterov, schedule and warm-up, clipping; a row without a module has no empty '()'."""

from __future__ import annotations

import re

import pytest
import torch.nn as nn

from convcheck.pipeline import compare
from convcheck.report.html import render_html


def net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def sgd_run():
    return compare(net, "cpu,cpu:float64", steps=4, batch_size=8, envelope=0, input_shape=(1, 8, 8),
                   num_classes=4, env_findings=[], optimizer="sgd", lr=0.05, nesterov=True, schedule="cosine",
                   warmup=1, clip_grad_norm=2.0)


def _text(page: str) -> str:
    return re.sub(r"<[^>]+>", " ", page)


def test_the_header_is_complete(sgd_run):
    page = render_html(sgd_run, {})
    header = _text(page.split("<p class='run'>", 1)[1].split("</p>", 1)[0])
    assert "model net (object, input 1x8x8, 4 classes)" in header
    assert "? classes" not in page and "file model" not in page
    assert "loss cross-entropy" in header
    assert "sgd lr 0.05 (momentum 0.9, nesterov)" in header  # SGD's momentum as built, not only as given
    assert "schedule cosine + 1 warm-up steps" in header
    assert "clip grad norm 2" in header
    assert "<h1>convcheck compare: net, cpu vs cpu:float64</h1>" in page


def test_rows_without_a_module_show_no_empty_parentheses(sgd_run, monkeypatch):
    layers = sgd_run.parity.layers.copy()
    layers["module"] = ""  # as a data-parallel target's gradient rows have it
    from dataclasses import replace

    page = render_html(replace(sgd_run, parity=replace(sgd_run.parity, layers=layers)), {})
    assert "()" not in page
