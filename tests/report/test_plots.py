"""Issue 26: the plots point at the culprit: inf/NaN at the top of the axis, layers in model order, legends
outside the axes, a loss that spans decades on a log axis, non-finite steps marked."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from convcheck.pipeline import compare
from convcheck.report.plots import layer_points, layers_figure, loss_figure, loss_scale


class Blowup(nn.Module):
    def forward(self, x):
        return x * 1e6  # past float16's 65504: inf in fp16, finite in float32


def blowup_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Blowup(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def overflow():
    torch.manual_seed(0)
    return compare(blowup_net, "cpu,cpu:fp16", steps=4, batch_size=8, envelope=0,
                   input_shape=(1, 8, 8), num_classes=4, env_findings=[])


def _legend_outside(ax) -> bool:
    fig = ax.figure
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    return legend.x0 >= ax.get_window_extent().x1


def test_an_inf_culprit_is_marked_at_the_top_not_drawn_tiny(overflow):
    fig = layers_figure(overflow)
    ax = next(a for a in fig.axes if a.get_title().startswith("cpu:fp16"))
    marks = [line for line in ax.get_lines() if line.get_label().startswith("inf / NaN")]
    assert marks, "no marker for the inf error"
    assert list(marks[0].get_ydata()) and all(y == 1.0 for y in marks[0].get_ydata())  # the axis' top
    assert marks[0].get_transform() != ax.transData
    labels = [t.get_text() for t in ax.texts]
    assert "2 (Blowup (own code: mul))" in labels and "inf" in labels  # the flagged layer and its op named, the inf said
    # layers in model order on x
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0 (Flatten)", "1 (Linear)", "2 (Blowup (own code: mul))",
                                                             "3 (Linear)"]
    assert ax.get_yscale() == "log"
    assert all(_legend_outside(a) for a in fig.axes)
    points = layer_points(overflow.parity.layers.query("kind == 'forward' and target == 'cpu:fp16'"))
    assert [p["nonfinite"] for p in points] == [False, False, True, False]  # 3: own error 0 on an inf input


def test_loss_plot_marks_non_finite_steps_and_puts_legends_outside(overflow):
    fig = loss_figure(overflow)
    ax = fig.axes[0]
    marks = [line for line in ax.get_lines() if "non-finite loss" in line.get_label()]
    assert marks and marks[0].get_label() == "cpu:fp16: non-finite loss (4 steps)"
    assert all(_legend_outside(a) for a in fig.axes)


def test_the_targets_distance_to_each_other_is_drawn_once(overflow):
    """New-user trial 4: 'A to the other target' and 'B to the other target' were the same line drawn twice,
    hiding a 'to judge' line beneath them."""
    ax = loss_figure(overflow).axes[1]
    labels = [line.get_label() for line in ax.get_lines()]
    assert [x for x in labels if " to " in x and "judge" not in x] == ["cpu to cpu:fp16"]
    assert {"cpu to judge", "cpu:fp16 to judge"} <= set(labels)


@pytest.mark.parametrize("values, scale", [
    ([2.3, 2.1, 0.4], "linear"),
    ([7.3e4, 1.4e23, math.nan], "log"),  # a summed loss: the first steps are not a flat line at 0
    ([-5.0, 1e5, 0.0], "symlog"),
    ([math.nan, math.inf], "linear"),
])
def test_loss_scale(values, scale):
    assert loss_scale(values) == scale
