"""The pytest plugin's baselines: record once, check later runs; a missing baseline fails, never passes."""

from __future__ import annotations

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
