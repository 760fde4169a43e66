"""convcheck.exit_codes: which exit code a failure gets, and whose code the traceback blames."""

from __future__ import annotations

import errno
import io
import operator

import pytest
import torch

from convcheck.errors import RunFailed, UsageError, UserCodeError
from convcheck.exit_codes import (
    EXIT_INTERNAL,
    EXIT_RESOURCE,
    EXIT_USAGE,
    as_convcheck_error,
    classify,
    report,
    resource_reason,
)
from convcheck.run_stage import RunStage, user_failures


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


@pytest.mark.parametrize("exc, reason", [
    (MemoryError(), "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"), "out of memory: "),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total)"),
     "out of GPU memory: CUDA out of memory"),
    (RuntimeError("MPS backend out of memory (MPS allocated: 18.13 GB)"), "out of GPU memory"),
    (OSError(errno.ENOSPC, "No space left on device", "run/report.html"), "disk full writing run/report.html"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk full"),
    (KeyboardInterrupt(), "interrupted"),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), "broken pipe"),
])
def test_the_machines_limits_are_exit_3(exc, reason):
    assert reason in resource_reason(exc)
    failure = classify(exc, "training step 2 of 5")
    assert failure.code == EXIT_RESOURCE and "during training step 2 of 5" in failure.line


@pytest.mark.parametrize("exc", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("x"),
                                 OSError(errno.EACCES, "Permission denied")])
def test_other_errors_are_not_resource_errors(exc):
    assert resource_reason(exc) is None


def test_an_error_raised_in_the_users_code_is_theirs():
    def users_forward():
        raise ValueError("shape mismatch in my layer")

    exc = _raised(users_forward)
    failure = classify(exc, "training step 3 of 30")
    assert failure.code == EXIT_USAGE and not failure.internal
    assert "ValueError: shape mismatch in my layer in users_forward (" in failure.line
    assert "test_failures.py:" in failure.line and failure.line.endswith("during training step 3 of 30")


def test_an_error_raised_inside_torch_called_by_the_user_is_theirs():
    def users_forward():
        return torch.ones(2, 3) @ torch.ones(2, 3)

    failure = classify(_raised(users_forward))
    assert failure.code == EXIT_USAGE and "users_forward" in failure.line


def test_a_package_only_the_users_code_reaches_is_their_side(tmp_path, monkeypatch):
    """timm, torchvision, transformers...: installed, but convcheck never calls them itself."""
    site = tmp_path / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "thirdparty_layers.py").write_text("def attention(x):\n    raise RuntimeError('head dim mismatch')\n")
    monkeypatch.syspath_prepend(str(site))
    import thirdparty_layers

    failure = classify(_raised(lambda: thirdparty_layers.attention(None)))
    assert failure.code == EXIT_USAGE and "attention (" in failure.line and "thirdparty_layers.py:2" in failure.line


def test_an_error_whose_innermost_own_frame_is_convcheck_is_a_bug():
    from convcheck.report.export import summary_dict

    exc = _raised(lambda: summary_dict(operator))  # convcheck's code fails on what it was handed
    failure = classify(exc)
    assert failure.code == EXIT_INTERNAL and failure.internal
    assert as_convcheck_error(exc) is None  # the API lets it through unchanged


def test_convcheck_errors_keep_their_code():
    assert classify(UsageError("bad")).code == 2 and classify(RunFailed("full")).code == 3


def test_the_api_maps_failures_to_convcheck_errors():
    def users_code():
        raise KeyError("label")

    with pytest.raises(UserCodeError, match="KeyError: 'label' in users_code"):
        with user_failures():
            users_code()
    with pytest.raises(RunFailed, match="out of memory"):
        with user_failures():
            raise MemoryError()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in Python stays Ctrl-C
        with user_failures():
            raise KeyboardInterrupt()


def test_report_prints_one_line_or_a_traceback_for_a_bug():
    stream = io.StringIO()
    assert report(UsageError("no such model"), stream=stream) == 2
    assert stream.getvalue() == "convcheck: error: no such model\n"
    stream = io.StringIO()
    from convcheck.report.export import summary_dict

    assert report(_raised(lambda: summary_dict(None)), stream=stream) == EXIT_INTERNAL
    text = stream.getvalue()
    assert text.startswith("Traceback") and "bug in convcheck" in text.strip().splitlines()[-1]


def test_the_stage_counts_training_steps_not_arm_steps():
    seen = []
    stage = RunStage(lambda *a: seen.append(a), steps=5)
    assert stage.describe() == "setup" and not stage.started
    stage("parity", 0, 1)
    assert stage.describe() == "the one-step parity check" and stage.started
    stage("train", 7, 15)  # 3 arms: 7 arm-steps done -> the third step is running
    assert stage.describe() == "training step 3 of 5"
    assert seen == [("parity", 0, 1), ("train", 7, 15)]
