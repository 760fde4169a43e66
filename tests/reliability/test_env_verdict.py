"""``compare --env FILE`` with a CRITICAL audit finding reaches the verdict: exit 1, the finding named (issue 27)."""

from __future__ import annotations

import json

from tests.reliability.conftest import DATA, TINY, bad, run_cli


def _compare(capsys, env_file: str) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, ["compare", "--model", bad("good"), *TINY, "--no-save", "--json",
                                      "--env", str(DATA / env_file)])
    return code, json.loads(out)


def test_a_critical_driver_finding_is_the_verdict(capsys):
    code, summary = _compare(capsys, "driver470_cu121.json")  # driver 470 with a CUDA 12.1 wheel
    verdict = summary["verdict"]
    assert code == 1
    assert verdict["category"] == "version"
    assert verdict["headline"].startswith("DRV001 (critical)")
    assert verdict["sub_cause"] == "DRV001"
    assert any("driver" in r.lower() for r in verdict["remedies"])


def test_a_healthy_environment_leaves_the_verdict_ok(capsys):
    code, summary = _compare(capsys, "h100_healthy.json")
    assert code == 0 and summary["verdict"]["category"] == "ok"


def test_the_rule_is_one_module_found_by_discovery():
    from convcheck.diagnose.registry import RULES
    from convcheck.diagnose.rules import import_rule_modules

    assert "critical_env" in import_rule_modules()
    rule = next(r for r in RULES if r.name == "critical-environment")
    # last among a comparison's rules (the watched runs' rules read other evidence)
    assert rule.id == "V010" and rule.priority > max(r.priority for r in RULES if r is not rule and r.reads is rule.reads)
