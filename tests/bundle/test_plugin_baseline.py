"""The pytest plugin's baselines: record once, check later runs; a missing baseline fails, never passes."""

from __future__ import annotations

import pytest

TEST = '''
import convcheck

def test_lenet_bf16(convcheck_baseline):
    result = convcheck_baseline("lenet", "cpu:bf16")
    assert result.verdict is not None
    assert [str(t) for t in result.config.targets] == ["cpu:bf16@baseline", "cpu:bf16@here"]
'''
FAST = ["--convcheck-steps=2", "--convcheck-batch-size=4", "--convcheck-envelope=0", "-p", "no:cacheprovider"]


def test_record_then_check_against(pytester, tmp_path, bundles):
    # pytester's in-process runs drop the modules they import: import every lazy one here first
    # (``bundles`` has run record; one diff runs the rest).
    from convcheck.bundle import baseline  # noqa: F401
    from convcheck.bundle.diff import diff_bundles

    diff_bundles(*bundles)
    pytester.makepyfile(test_it=TEST)
    base = tmp_path / "baselines"
    missing = pytester.runpytest(*FAST, "--convcheck-against", str(base))
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*no baseline at*--convcheck-record*"])
    none = pytester.runpytest(*FAST)
    none.assert_outcomes(failed=1)
    none.stdout.fnmatch_lines(["*no baseline given*"])
    rec = pytester.runpytest(*FAST, "--convcheck-record", str(base))
    rec.assert_outcomes(skipped=1)
    assert len(list(base.iterdir())) == 1
    check = pytester.runpytest(*FAST, "--convcheck-against", str(base))
    check.assert_outcomes(passed=1)


OWN = '''
import torch.nn as nn

def small_mlp():  # no size convcheck tries fits it: the test gives the input shape
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4))

def test_own_model_bf16(convcheck_baseline):
    result = convcheck_baseline("nets_own.py:small_mlp", "cpu:bf16", input_shape=(3, 8, 8), num_classes=4)
    assert result.verdict is not None
'''


@pytest.mark.slow  # three pytester runs: ~3 s
def test_a_baseline_of_a_model_that_cannot_tell_its_input_shape(pytester, tmp_path, bundles):
    """New-user trial 5: convcheck_baseline refused input_shape ('unknown convcheck option'), so only models of a
    size convcheck can guess could have a baseline; a failed record left an empty baseline folder."""
    from convcheck.bundle import baseline  # noqa: F401
    from convcheck.bundle.diff import diff_bundles

    diff_bundles(*bundles)
    pytester.makepyfile(nets_own=OWN.split("def test_own_model_bf16")[0], test_own=OWN)
    base = tmp_path / "baselines"
    rec = pytester.runpytest(*FAST, "--convcheck-record", str(base))
    rec.assert_outcomes(skipped=1)
    check = pytester.runpytest(*FAST, "--convcheck-against", str(base))
    check.assert_outcomes(passed=1)
    pytester.makepyfile(test_own=OWN.replace(", input_shape=(3, 8, 8), num_classes=4", ""))
    failed = pytester.runpytest(*FAST, "--convcheck-record", str(tmp_path / "again"))
    failed.assert_outcomes(failed=1)
    assert not (tmp_path / "again").exists() or not any((tmp_path / "again").iterdir())
