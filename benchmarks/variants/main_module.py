"""A module as ``main`` (or REF) has it, loaded beside this tree's: the "before" of an in-process A/B.

    old = main_module("convcheck/targets/runners/precision.py")          # git show main:PATH

The ref is ``$AB_REF`` where set (once this branch is merged, main is no "before": give the commit
before it), else ``main``. Its imports resolve against this tree's package (relative ``convcheck.*`` modules as they are here).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main_module(path: str, ref: str | None = None):
    ref = ref or os.environ.get("AB_REF") or "main"
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, text=True,
                         check=True).stdout
    name = "_ab_" + "".join(c if c.isalnum() else "_" for c in ref) + "_" + path.replace("/", "_").removesuffix(".py")
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__dict__["__package__"] = path.rsplit("/", 1)[0].replace("/", ".")
    sys.modules[name] = mod  # (a dataclass looks its module up there)
    exec(compile(src, f"{ref}:{path}", "exec"), mod.__dict__)
    return mod
