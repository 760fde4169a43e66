"""convcheck.plan.config and convcheck.plan.options: one config, defaults in one place, numbers checked at the edge."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys

import pytest

from convcheck.plan.config import CompareConfig, with_options
from convcheck.errors import UsageError
from convcheck.plan.options import config_from_options, declare_compare_options
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances


def _parse(argv):
    p = argparse.ArgumentParser()
    declare_compare_options(p.add_argument)
    return config_from_options(vars(p.parse_args(argv)))


def test_defaults_come_from_the_dataclass():
    assert _parse([]) == CompareConfig()
    cfg = CompareConfig()
    assert (cfg.steps, cfg.batch_size, cfg.optimizer, cfg.lr, cfg.envelope, cfg.judge) == (30, 32, "adam", 1e-3, 3, None)


def test_cli_options_map_onto_the_config():
    cfg = _parse(["--targets", "cpu,cpu:bf16", "--judge", "cpu:float64", "--steps", "5", "--batch-size", "4",
                  "--bound-factor", "2", "--min-error", "0.01", "--optimizer", "sgd"])
    assert cfg.targets == "cpu,cpu:bf16" and cfg.judge == "cpu:float64"
    assert (cfg.steps, cfg.batch_size, cfg.optimizer) == (5, 4, "sgd")
    assert cfg.tolerances == Tolerances(bound_factor=2.0, min_error=0.01)


def test_with_options_takes_cli_and_field_names():
    cfg = with_options(CompareConfig(), **{"bound-factor": 3, "batch_size": 2, "min_error": 0})
    assert cfg.tolerances.bound_factor == 3 and cfg.tolerances.min_error == 0 and cfg.batch_size == 2
    with pytest.raises(UsageError, match="unknown convcheck option 'stepz'"):
        with_options(CompareConfig(), stepz=3)


@pytest.mark.parametrize("field, value", [
    ("steps", 0), ("steps", 2.5), ("steps", True), ("batch_size", -1), ("envelope", -1), ("seed", -3),
    ("lr", 0.0), ("lr", math.nan), ("lr", math.inf), ("lr", "0.1"), ("optimizer", ""), ("optimizer", 3), ("data", 3),
    ("momentum", -0.1), ("weight_decay", math.nan), ("betas", (0.9,)), ("betas", (0.9, 1.0)), ("eps", 0.0),
    ("warmup", -1), ("clip_grad_norm", 0.0), ("nesterov", "yes"), ("seed", 2**63), ("schedule", ""),
])
def test_bad_numbers_are_usage_errors(field, value):
    with pytest.raises(UsageError) as info:
        CompareConfig(**{field: value})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kw", [dict(bound_factor=math.nan), dict(bound_factor=-1), dict(bound_factor=0),
                                dict(min_error=math.nan), dict(min_error=-1), dict(min_error=math.inf),
                                dict(converged_loss_ratio=0), dict(converged_loss_ratio=1.5),
                                dict(bound_factor="8")])
def test_bad_tolerances_are_usage_errors(kw):
    with pytest.raises(UsageError, match="tolerance"):
        Tolerances(**kw)


def test_default_tolerances_are_valid():
    assert Tolerances() == DEFAULT_TOLERANCES


@pytest.mark.parametrize("argv, words", [
    (["--bound-factor", "nan"], "bound_factor must be a positive number"),
    (["--bound-factor", "-1", "--min-error", "-1"], "bound_factor"),
    (["--min-error", "nan"], "min_error must be a number of at least 0"),
    (["--steps", "0"], "steps must be an integer of at least 1"),
    (["--lr", "inf"], "learning rate must be a positive number"),
])
def test_cli_bad_numbers_exit_2_before_any_work(argv, words, capsys):
    from convcheck.cli.main import main

    code = main(["compare", "--model", "no-such-model", "--no-save", *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1


def test_help_does_not_import_torch():
    code = ("import sys; from convcheck.cli.main import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
