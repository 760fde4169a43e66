"""The integrations are optional extras: ``import convcheck`` never imports a framework, and a missing one
is a one-line error naming the extra that installs it (one child process for all three checks: a
missing package is ``sys.modules[name] = None`` there, which is what Python's import sees when it is absent)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import convcheck, convcheck.watch, convcheck.integrations
seen = sorted(m for m in ("lightning", "pytorch_lightning", "transformers", "accelerate") if m in sys.modules)
from convcheck.errors import UsageError
errors = {}
for module, blocked in (("convcheck.integrations.hf", ("transformers",)),
                        ("convcheck.integrations.lightning", ("lightning", "lightning.pytorch", "pytorch_lightning"))):
    saved = {m: sys.modules.pop(m, None) for m in blocked}
    sys.modules.update({m: None for m in blocked})
    try:
        __import__(module)
        errors[module] = None
    except UsageError as e:
        errors[module] = [e.exit_code, str(e)]
    for m in blocked:
        del sys.modules[m]
print(json.dumps({"imported": seen, "errors": errors}))
"""


@pytest.mark.slow  # ~3 s: fresh interpreters importing convcheck
def test_no_framework_is_imported_and_a_missing_extra_is_one_line():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    for module, extra in (("convcheck.integrations.hf", "hf"), ("convcheck.integrations.lightning", "lightning")):
        code, message = result["errors"][module]
        assert code == 2 and "\n" not in message
        assert message.startswith(f"convcheck.integrations.{extra} needs ")
        assert f"pip install 'convcheck[{extra}]'" in message
