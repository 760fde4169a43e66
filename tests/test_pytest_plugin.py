"""convcheck.pytest_plugin and convcheck.assertions, driven through pytester."""

from __future__ import annotations

import pytest

MODELS = '''
import pytest
import torch
import torch.nn as nn

from convcheck.assertions import assert_parity


class NaiveNorm(nn.Module):
    """Variance as E[x^2] - E[x]^2: fine in float32, every digit lost in bfloat16 at mean ~30."""

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        var = (x * x).mean(dim=1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


def offset_net():
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), NaiveNorm(), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        net[1].bias.fill_(30.0)
    return net


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


class Wrong5(nn.Linear):
    """5% off whenever it does not run in float64: flagged, but within reach of a larger bound_factor
    (NaiveNorm's bf16 result is destroyed: flagged whatever the factor)."""

    def forward(self, x):
        out = super().forward(x)
        return out if out.dtype == torch.float64 else out * 1.05


def wrong_net():
    return nn.Sequential(nn.Flatten(), Wrong5(64, 32), nn.ReLU(), nn.Linear(32, 4))


SMALL = dict(input_shape=(1, 8, 8), num_classes=4)
'''

FAST = ["--convcheck-steps=8", "--convcheck-batch-size=16", "--convcheck-envelope=0", "--convcheck-lr=0.01",
        "-p", "no:cacheprovider"]


@pytest.fixture(scope="module", autouse=True)
def _lazy_imports_done_here():
    """pytester's in-process runs drop the modules they import afterwards; torch registers
    operator libraries on import (once per process), so do every lazy import up front."""
    import torch.nn as nn

    from convcheck.pipeline import compare

    def mlp():
        return nn.Sequential(nn.Flatten(), nn.Linear(4, 2))

    for targets in ("cpu,cpu:emulate-tf32", "cpu,cpu:bf16"):
        compare(mlp, targets, steps=1, batch_size=2, envelope=1, input_shape=(1, 2, 2), num_classes=2)


def test_the_plugin_registers_its_options(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*convcheck*", "*--convcheck-targets=A,B*", "*--convcheck-steps*",
                                 "*--convcheck-bound-factor*"])


def test_parity_passes_and_a_reduced_precision_culprit_fails(pytester):
    pytester.makepyfile(test_user=MODELS + '''

def test_healthy(convcheck_compare):
    result = convcheck_compare(mlp, targets="cpu,cpu:emulate-tf32", **SMALL)
    assert result.config.steps == 8 and result.config.envelope == 0   # from the command line
    assert_parity(result)


def test_culprit(convcheck_compare):
    result = convcheck_compare(offset_net, targets="cpu,cpu:bf16", **SMALL)
    assert_parity(result)
''')
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    # the failure names the target, the layer and the numbers, and what would change the outcome
    result.stdout.fnmatch_lines([
        "*AssertionError: convcheck verdict: layer*",
        "*target*layer (module)*own error*floor*own/floor*needed factor*",
        "*cpu:bf16*2 (NaiveNorm)*",
        "*(bound_factor=5; no bound_factor would pass: a flagged error is non-finite or its result destroyed)*",
        "*evidence: layer error (cpu:bf16)*",
    ])
    assert "remedy:" in out and ">= inf" not in out
    assert "test_culprit" in out and "FAILED" in out


def test_targets_option_and_marker_defaults(pytester):
    pytester.makepyfile(test_user=MODELS + '''

def test_option(convcheck_compare):
    result = convcheck_compare(offset_net, **SMALL)
    assert [str(t) for t in result.targets] == ["cpu", "cpu:bf16"]
    assert result.parity.first_flagged[result.targets[1]] == "2"


@pytest.mark.convcheck(steps=2, seed=4)
def test_marker(convcheck_compare):
    result = convcheck_compare(mlp, targets="cpu,cpu:float64", **SMALL)
    assert result.config.steps == 2 and result.config.seed == 4
    assert len(result.training.curves) == 2 * 2


def test_call_overrides_marker(convcheck_compare):
    result = convcheck_compare(mlp, targets="cpu,cpu:float64", steps=1, **SMALL)
    assert result.config.steps == 1
''')
    result = pytester.runpytest(*FAST, "--convcheck-targets=cpu,cpu:bf16")
    result.assert_outcomes(passed=3)


def test_a_tolerance_option_changes_the_outcome(pytester):
    pytester.makepyfile(test_user=MODELS + '''

def test_culprit(convcheck_compare):
    result = convcheck_compare(wrong_net, targets="cpu,cpu:bf16", **SMALL)
    assert result.config.tolerances.bound_factor == 1e9
    assert result.parity.first_flagged[result.targets[1]] is None
''')
    result = pytester.runpytest(*FAST, "--convcheck-bound-factor=1e9")
    result.assert_outcomes(passed=1)


def test_bad_option_value_is_a_usage_error_in_the_test(pytester):
    pytester.makepyfile(test_user=MODELS + '''
from convcheck.errors import UsageError


def test_bad_target(convcheck_compare):
    with pytest.raises(UsageError, match="fp8"):
        convcheck_compare(mlp, **SMALL)
''')
    result = pytester.runpytest(*FAST, "--convcheck-targets=cpu,cpu:fp8")
    result.assert_outcomes(passed=1)


def test_marker_takes_the_cli_option_names(pytester):
    pytester.makepyfile(test_user=MODELS + '''
from convcheck.errors import UsageError


@pytest.mark.convcheck(bound_factor=1e9, min_error=0.5, judge="cpu:float64", batch_size=8)
def test_marker_tolerances(convcheck_compare):
    result = convcheck_compare(wrong_net, targets="cpu,cpu:bf16", **SMALL)
    assert result.config.tolerances.bound_factor == 1e9 and result.config.tolerances.min_error == 0.5
    assert str(result.config.judge) == "cpu:float64" and result.config.batch_size == 8
    assert result.parity.first_flagged[result.targets[1]] is None


@pytest.mark.convcheck(bound_facter=2)
def test_marker_typo(convcheck_compare):
    pass
''')
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*unknown convcheck option 'bound_facter'*bound_factor*"])


def test_a_nan_tolerance_is_refused_not_a_pass(pytester):
    pytester.makepyfile(test_user=MODELS + '''

def test_culprit(convcheck_compare):
    convcheck_compare(offset_net, targets="cpu,cpu:bf16", **SMALL)
''')
    result = pytester.runpytest(*FAST, "--convcheck-bound-factor=nan")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*tolerance bound_factor must be a positive number, got nan*"])
