"""Every module imports on its own, first: no import order in which a circle of imports breaks.

A circle between packages can hide behind the order the suite happens to import things in
(``ddp.diagnostics`` imported first once failed while the suite passed). One subprocess imports
each module as the first of the package, with every ``convcheck`` module dropped before it. An
integration whose optional extra (lightning, transformers) is not installed refuses in one line, as it
does for a user; where the extra is installed (the slow CI run) it is imported like any other.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import importlib, pathlib, sys, traceback
root = pathlib.Path(sys.argv[1])
names = []
for path in sorted((root / "convcheck").rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__main__":
        continue
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "convcheck" or m.startswith("convcheck.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        if type(exc).__name__ == "UsageError" and "pip install 'convcheck[" in str(exc):
            continue  # an integration whose optional extra is not installed here: its one-line refusal
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\n".join(failed))
print(f"checked {len(names)}")
"""


@pytest.mark.slow  # ~12 s: every module re-imported first in one subprocess; CI's slow pass runs it
def test_every_module_imports_first():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("checked ") and int(lines[-1].split()[1]) > 100
    assert lines[:-1] == []
