"""The thread choice (issue 28): made once per run, the same for every arm and the judge, reported in the
header and summary.json, honouring the user's setting, and the caller's count put back afterwards."""

from __future__ import annotations

import json
import time

import pytest
import torch

import convcheck
import convcheck.plan.threads as threads_mod
import convcheck.stages as stages
from convcheck.cli.main import main
from convcheck.plan.threads import ThreadChoice, measure_choice

FAST = dict(steps=2, envelope=0, batch_size=8)


@pytest.fixture(autouse=True)
def _caller_threads(monkeypatch, tmp_path):
    """Every test starts with no thread variable set, and leaves torch's count as it found it."""
    for name in threads_mod.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVCHECK_NO_PROGRESS", "1")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def measured(monkeypatch):
    """Two threads are this machine's default (whatever its cores), so the choice is measured; the probe's
    calls are counted and the counts seen while the stages run are recorded."""
    torch.set_num_threads(2)
    monkeypatch.setattr(threads_mod, "torch_default_threads", lambda: 2)
    calls = []
    real = stages.measure_choice

    def counting(steps, default):
        calls.append((len(steps), default))
        return real(steps, default)

    monkeypatch.setattr(stages, "measure_choice", counting)
    return calls


def _seen_threads():
    seen = []
    return seen, (lambda stage, done, total: seen.append((stage, torch.get_num_threads())))


def test_the_choice_is_measured_once_used_by_every_stage_and_reported(measured):
    seen, progress = _seen_threads()
    result = convcheck.compare("lenet", "cpu,cpu:bf16", progress=progress, **FAST)
    assert len(measured) == 1  # once per run, not per stage or arm
    assert measured[0] == (3, 2)  # the judge's step and each target's, against the default of 2
    choice = result.threads
    assert choice.source == "measured" and choice.threads in (1, 2)
    assert choice.reason == f"measured faster than {3 - choice.threads}"
    assert set(choice.step_s) == {1, 2}
    assert {n for stage, n in seen} == {choice.threads}  # parity and every arm's training steps alike
    assert {stage for stage, n in seen} == {"parity", "train"}
    assert torch.get_num_threads() == 2  # the caller's count again
    summary = result.to_summary()["threads"]
    assert summary["count"] == choice.threads and summary["source"] == "measured"
    assert set(summary["probe_step_s"]) == {"1", "2"}


def test_the_header_line_and_summary_json_name_the_choice(measured, capsys, tmp_path):
    code = main(["compare", "--model", "lenet", "--steps", "2", "--envelope", "0", "--batch-size", "8",
                 "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert len(measured) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    n = summary["threads"]["count"]
    assert f"threads: {n} (measured faster than {3 - n})" in out.splitlines()
    assert torch.get_num_threads() == 2


def test_an_explicit_option_is_honoured_without_measuring(measured, capsys):
    seen, progress = _seen_threads()
    result = convcheck.compare("lenet", "cpu,cpu:bf16", progress=progress, threads=1, **FAST)
    assert measured == []
    assert result.threads == ThreadChoice(1, "set with --threads", "option")
    assert {n for _, n in seen} == {1}
    assert torch.get_num_threads() == 2
    code = main(["compare", "--model", "lenet", "--threads", "1", "--steps", "2", "--envelope", "0",
                 "--batch-size", "8", "--no-save"])
    assert code in (0, 1) and measured == []
    assert "threads: 1 (set with --threads)" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_an_environment_variable_is_honoured(measured, monkeypatch, variable):
    monkeypatch.setenv(variable, "1")
    torch.set_num_threads(1)  # as torch starts in a process with the variable set
    assert threads_mod.given_choice(None) == ThreadChoice(1, f"set by {variable}", "env")
    assert threads_mod.given_choice(4).source == "option"  # --threads outranks the variable


def test_a_run_with_the_variable_set_is_not_measured(measured, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result = convcheck.compare("lenet", "cpu,cpu:bf16", **FAST)
    assert measured == []
    assert result.threads.line() == "threads: 1 (set by OMP_NUM_THREADS)"
    assert result.to_summary()["threads"]["source"] == "env"


def test_torch_set_num_threads_before_convcheck_is_honoured(measured):
    torch.set_num_threads(1)  # the caller's own setting: not the default of 2
    seen, progress = _seen_threads()
    result = convcheck.compare("lenet", "cpu,cpu:bf16", progress=progress, **FAST)
    assert measured == []
    assert result.threads.threads == 1 and result.threads.source == "caller"
    assert "set by torch.set_num_threads" in result.threads.line()
    assert {n for _, n in seen} == {1}
    assert torch.get_num_threads() == 1


def test_the_caller_count_comes_back_when_the_run_fails(measured):
    with pytest.raises(convcheck.errors.UsageError):
        convcheck.compare("lenet", "cpu,cpu:bf16", threads=1, loss=lambda out, y: "not a tensor", **FAST)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_thread_count_is_a_usage_error(bad):
    with pytest.raises(convcheck.errors.UsageError, match="threads"):
        convcheck.CompareConfig(threads=bad)


@pytest.mark.parametrize("slow_at, kept", [(1, 2), (2, 1)])
def test_measure_choice_keeps_the_faster_count(slow_at, kept):
    """A step that is plainly slower (a 0.2 s wait) at one of the two counts: the other is kept."""
    def step():
        if torch.get_num_threads() == slow_at:
            time.sleep(0.2)

    torch.set_num_threads(2)
    choice = measure_choice([step], 2)
    assert choice.threads == kept and choice.source == "measured"
    assert choice.reason == f"measured faster than {slow_at}"
    assert torch.get_num_threads() == 2  # measure_choice leaves the default; the stage sets the choice


def test_the_probe_changes_no_figure(measured, monkeypatch):
    """A run whose probe ran (then kept 1 thread) gives bitwise the figures of a run told --threads 1."""
    told = convcheck.compare("lenet", "cpu,cpu:bf16", threads=1, **FAST)
    probing = stages.measure_choice  # the counting wrapper: the real probe runs

    def probe_then_one(steps, default):
        probing(steps, default)
        return ThreadChoice(1, "kept for the test", "measured")

    monkeypatch.setattr(stages, "measure_choice", probe_then_one)
    probed = convcheck.compare("lenet", "cpu,cpu:bf16", **FAST)
    assert len(measured) == 1 and probed.threads.source == "measured"
    assert probed.parity.layers.equals(told.parity.layers)
    assert probed.training.curves.equals(told.training.curves)
    assert probed.training.layer_grads.equals(told.training.layer_grads)


@pytest.mark.slow  # ~2 s of timed rounds
def test_measure_choice_takes_more_rounds_where_one_step_does_not_settle_it():
    """0.25 s at the default against 0.2 s at one thread (not 1.5x apart): the alternating rounds run
    (three: the budget allows them), and the faster median is kept."""
    calls = []

    def step():
        calls.append(torch.get_num_threads())
        time.sleep(0.25 if torch.get_num_threads() == 2 else 0.2)

    torch.set_num_threads(2)
    choice = measure_choice([step], 2)
    assert calls == [1, 1, 2] + [2, 1, 1, 2, 2, 1]  # warm-up, one each, then three rounds alternating
    assert choice.threads == 1 and len(choice.step_s) == 2
