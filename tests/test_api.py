"""The public API in convcheck/__init__.py: lazy, and the names the README uses."""

import subprocess
import sys

import pytest

import convcheck


def test_import_convcheck_does_not_import_torch():
    code = "import sys, convcheck; print('torch' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_compare_is_the_function_and_returns_a_verdict():
    result = convcheck.compare("lenet", "cpu,cpu:float64", steps=2, envelope=0, batch_size=8)
    assert isinstance(result, convcheck.CompareResult)
    assert result.verdict.category in ("ok", "setup")
    assert isinstance(result.verdict, convcheck.Verdict)


def test_public_names_resolve():
    assert convcheck.Target.parse("cpu:bf16").mode == "bf16"
    assert convcheck.Tolerances().bound_factor > 1
    assert callable(convcheck.assert_parity)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        convcheck.nope  # noqa: B018
