"""The NaN-at-step-0 remedy asks the target's runner: float16's 65504 is advice only where float16 computes."""

from __future__ import annotations

from dataclasses import replace

import convcheck.diagnose.detectors.training as S
from convcheck.diagnose import rules as R
from convcheck.diagnose.evidence import TargetFacts
from tests.diagnose.test_diagnose_rules import evidence


def _nan_at_step_0(arm: str) -> S.Symptom:
    return S.Symptom(S.NONFINITE_FORWARD, arm, "'3' turns finite inputs into NaN/Inf", layer="3", step=0,
                     value=float("nan"), extra={"overflow": False})


def _remedies(low: str, facts: TargetFacts) -> list[str]:
    ev = evidence(low=low, target_symptoms=(_nan_at_step_0(low),))
    ev = replace(ev, target_facts={"cpu": TargetFacts(), low: facts})
    return R.numerics_remedies(ev, ev.target_symptoms[0])


def test_a_float32_float64_pair_gets_no_float16_advice():
    for low in ("cpu:float64", "cpu"):
        remedies = _remedies(low, TargetFacts())
        assert remedies and not any("65504" in r for r in remedies)
        assert any("division by zero" in r for r in remedies)


def _float16() -> TargetFacts:
    extra = {"compute_format": "float16"} if "compute_format" in TargetFacts.__dataclass_fields__ else {}
    return TargetFacts(half_compute=True, **extra)


def test_a_float16_target_keeps_the_range_advice():
    remedies = _remedies("cpu:fp16", _float16())
    assert any("65504" in r for r in remedies)
