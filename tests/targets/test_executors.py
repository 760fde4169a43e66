"""Executors (``convcheck.targets.executors``): where a target's work runs, and the layering that keeps DDP in ``ddp/``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import convcheck
from convcheck.targets import executors
from convcheck.targets.executors import ArmJob, Executor, ParityStep, TargetParity, executor_for
from convcheck.targets.spec import Target

PACKAGE = Path(convcheck.__file__).parent


def _imported_modules(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, at the top or inside a function,
    relative imports resolved."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _ddp_imports(path: Path) -> set[str]:
    package = ".".join(("convcheck",) + path.relative_to(PACKAGE).parent.parts)
    return {m for m in _imported_modules(path.read_text(), package)
            if m == "convcheck.ddp" or m.startswith("convcheck.ddp.")}


def test_no_module_outside_ddp_imports_it():
    """The dependency points from ``convcheck/ddp/`` down to the generic layer, never back up."""
    offenders = [f"{path.relative_to(PACKAGE)}: {m}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path.relative_to(PACKAGE).parts[0] != "ddp" for m in sorted(_ddp_imports(path))]
    assert offenders == []


def test_the_import_check_sees_imports_inside_functions_and_relative_ones():
    source = ("import os\n"
              "def f():\n    from convcheck.ddp.arm import DDPArmState\n"
              "def g():\n    from ...ddp import rank_pool\n    import convcheck.ddp.launch\n")
    found = _imported_modules(source, "convcheck.measure.train")
    assert {"convcheck.ddp.arm", "convcheck.ddp.rank_pool", "convcheck.ddp.launch"} <= found


def test_every_target_kind_has_a_registered_executor():
    assert type(executor_for(Target.parse("cpu"))) is Executor
    assert executor_for(Target.parse("cpu:float64")).name == "in-process"
    ddp = executor_for(Target.parse("ddp:cpu:2"))
    assert ddp.name == "rank-pool" and not ddp.reads_judge_record
    assert [e.name for e in executors.executors()][0] == "in-process"


def test_the_in_process_executor_runs_what_it_is_handed():
    ex = Executor()
    got = TargetParity(1.5, [{"layer": "x"}], self_difference=0.0)
    step = ParityStep(build=None, batch=(), judge_grads={}, loss_fn=None, seed=0, here=lambda target: got)
    assert ex.parity(Target.parse("cpu"), step) is got
    job = ArmJob(build=None, steps=1, recipe=None, here=lambda arm: ("built", arm))
    assert ex.training_arm("arm", job) == ("built", "arm")
    assert ex.findings(None, "cpu") == ()
    assert ex.serve(None) is None and ex.wrap_builder(len, None) is len


def test_an_unknown_executor_is_named():
    class Elsewhere:
        executor = "nowhere"

    class Spec:
        runner = Elsewhere()

        def __str__(self):
            return "far:1"

    with pytest.raises(LookupError, match="target far:1: no executor 'nowhere' is registered"):
        executor_for(Spec())


def test_the_process_hooks_come_from_the_kinds_in_a_fresh_process():
    """``before_threads`` loads the plugins without loading torch (OMP_WAIT_POLICY must precede it)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import os, sys; from convcheck.targets import executors; executors.before_threads('cpu,ddp:cpu:2'); "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, "
            "[e.name for e in executors.executors()])")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().split(maxsplit=2) == ["PASSIVE", "False", "['in-process', 'rank-pool']"], proc.stderr
