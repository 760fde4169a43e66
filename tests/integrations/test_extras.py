"""The integrations are optional extras: ``import convcheck`` never imports a framework, and a missing one
is a one-line error naming the extra that installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_convcheck_and_watch_imports_no_framework():
    done = run_python("import sys, convcheck, convcheck.watch, convcheck.integrations\n"
                      "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
                      "if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module, blocked, extra", [
    ("convcheck.integrations.hf", ("transformers",), "hf"),
    ("convcheck.integrations.lightning", ("lightning", "lightning.pytorch", "pytorch_lightning"), "lightning"),
])
def test_a_missing_extra_is_a_one_line_usage_error(module, blocked, extra):
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)  # what a missing package looks like
    done = run_python(f"import sys\n{block}"
                      "from convcheck.errors import UsageError\n"
                      f"try:\n    import {module}\n"
                      "except UsageError as e:\n    print(e.exit_code, e)\n")
    assert done.returncode == 0, done.stderr
    code, _, message = done.stdout.strip().partition(" ")
    assert code == "2" and "\n" not in message
    assert f"pip install 'convcheck[{extra}]'" in message
