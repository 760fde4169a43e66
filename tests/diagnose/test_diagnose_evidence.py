"""Evidence gathered from a result (a tiny fake: DataFrames and namespaces, no model), and the
hygiene of the verdict's inputs: no training import, symptom names and thresholds in one place.
The rules themselves are tested on hand-built evidence in test_diagnose_rules.py.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

import convcheck.diagnose.detectors.training as S
from convcheck.diagnose import Evidence, diagnose, gather
from convcheck.numerics.formats import FLOAT32
from convcheck.targets.runners.precision import PrecisionModel
from convcheck.measure.train.result import ArmOutcome

PACKAGE = Path(__file__).resolve().parents[2] / "convcheck"
DETECTORS = PACKAGE / "diagnose" / "detectors"
JUDGE = "cpu:float64"


def outcome(name: str, first: float, final: float) -> ArmOutcome:
    return ArmOutcome(name=name, role="judge" if name == JUDGE else "target", converged=final < 0.9 * first,
                      first_loss=first, final_loss=final, first_nonfinite_step=None, skipped_steps=0,
                      final_loss_scale=math.nan, final_dist_judge=0.0)


@dataclass(frozen=True)
class FakeTarget:
    name: str
    runner: SimpleNamespace = field(default_factory=lambda: runner(), compare=False)  # keyed by name
    unit_roundoff: float = 2.0**-24

    def __str__(self) -> str:
        return self.name


def runner(**flags) -> SimpleNamespace:
    return SimpleNamespace(**{"half_compute": False, "half_storage": False, "mixed_precision": False,
                              "tf32_like": False, "compute_dtype": "torch.float32",
                              "precision": PrecisionModel.uniform(FLOAT32), **flags})


def parity_row(target, order, layer, local, floor=1e-3) -> dict:
    tol = Evidence().tolerances
    return dict(target=target, order=order, kind="forward", layer=layer, module="Linear", param="", K=64,
                u=2.0**-8, floor=floor, bound=tol.bound(floor), propagated=local, local=local, intrinsic=local,
                over_floor=local / floor, needed=tol.needed(local, floor), nan=0, inf=0, input_nonfinite=0,
                grad_out_nonfinite=0, ref_absmax=3.0, flagged=tol.is_flagged(local, floor))


def fake_result(local_bf16: float = 2e-3, steps: int = 5, stochastic=()) -> SimpleNamespace:
    cpu, judge = FakeTarget("cpu"), FakeTarget(JUDGE)
    bf16 = FakeTarget("cpu:bf16", runner(half_compute=True, half_storage=True, compute_dtype="torch.bfloat16"))
    layers = pd.DataFrame([parity_row("cpu", 0, "fc1", 1e-7), parity_row("cpu", 1, "fc2", 2e-7),
                           parity_row("cpu:bf16", 0, "fc1", local_bf16), parity_row("cpu:bf16", 1, "fc2", 1e-3)])
    by_name = {str(t): t for t in (cpu, bf16, judge)}
    flagged = {by_name[t]: (rows[rows["flagged"]]["layer"].iloc[0] if rows["flagged"].any() else None)
               for t, rows in layers.groupby("target")}
    parity = SimpleNamespace(layers=layers, first_flagged=flagged, stochastic_layers=tuple(stochastic),
                             self_difference={cpu: 0.0, bf16: 0.0},
                             flagged=lambda t: layers[layers["flagged"] & (layers["target"] == t)])
    losses = [2.3 * 0.8**s for s in range(steps)]
    curves = pd.DataFrame([dict(arm=a, role="judge" if a == JUDGE else "target", target=a, step=s, loss=v,
                                grad_norm=1.0, dist_judge=0.0, dist_ref=0.0, dist_other=1e-6,
                                nonfinite_loss=False, nonfinite_grad=False, loss_scale=math.nan, skipped=0,
                                update_ratio=1e-3)
                           for a in ("cpu", "cpu:bf16", JUDGE) for s, v in enumerate(losses)])
    outcomes = {by_name[a]: outcome(a, losses[0], losses[-1]) for a in ("cpu", "cpu:bf16", JUDGE)}
    training = SimpleNamespace(
        curves=curves, outcomes=outcomes, envelope=None, lower_precision=bf16,
        layer_grads=pd.DataFrame(columns=["arm", "step", "layer", "grad_norm", "zero_frac"]),
        activations=pd.DataFrame(columns=["arm", "step", "layer", "kind", "dead_frac", "saturated_frac"]),
        nonfinite_producer={cpu: None, bf16: None, judge: None}, arm_of=lambda t: t)  # its arms: the targets
    config = SimpleNamespace(targets=(cpu, bf16), judge=judge, steps=steps, lr=1e-3, optimizer="adam",
                             envelope=0, tolerances=Evidence().tolerances)
    return SimpleNamespace(config=config, parity=parity, training=training, data_stats={},
                           model=SimpleNamespace(num_classes=10), findings=[])


def test_gather_reads_a_result_and_a_clean_one_is_ok():
    ev = gather(fake_result())
    assert ev.targets == ("cpu", "cpu:bf16") and ev.judge == JUDGE and ev.steps == 5
    assert ev.target_symptoms == () and ev.drift is None and ev.judge_problems == ()
    assert ev.target_facts["cpu:bf16"].half_compute and not ev.target_facts["cpu"].half_compute
    assert [(m.target, m.layer) for m in ev.closest_layers] == [("cpu", "fc2"), ("cpu:bf16", "fc1")]
    v = diagnose(fake_result())
    assert v.category == "ok"
    assert ev.target_facts["cpu:bf16"].compute_format == "bfloat16" and ev.target_facts["cpu:bf16"].half_storage
    assert ("cpu:bf16: every layer within its floor's bound; the furthest above its floor is 'fc1' (Linear) with its "
            "own error 2.00e-03, 2x its floor 1.00e-03") in v.evidence


def test_gather_turns_a_flagged_layer_into_a_layer_verdict():
    ev = gather(fake_result(local_bf16=0.5))
    assert [s.name for s in ev.target_symptoms] == [S.LAYER_ERROR]
    assert ev.target_symptoms[0].layer == "fc1" and ev.flagged_layers["cpu:bf16"] == "fc1"
    v = diagnose(fake_result(local_bf16=0.5))
    assert v.category == "layer" and v.layer == "fc1" and v.target == "cpu:bf16"
    assert "'fc1' (Linear): its own error is 0.5: the result is destroyed, while its floor is 1.00e-03" in v.evidence[0]
    assert v.headline.startswith("layer 'fc1' (Linear) computes something else on cpu:bf16")
    assert not any("autocast" in r for r in v.remedies)  # a whole-model cast: keep the layer in float32
    assert "keep 'fc1' in float32 in the bfloat16 model" in v.remedies[0]


def test_a_small_flagged_layer_is_a_note_not_a_verdict():
    """float32 losing 1e-4 in an unstable layer: far above its floor (flagged), below min_error."""
    result = fake_result()
    layers = result.parity.layers
    layers.loc[(layers["target"] == "cpu") & (layers["layer"] == "fc2"), ["local", "intrinsic", "floor"]] = \
        [1e-4, 1e-4, 1e-7]
    layers["over_floor"] = layers["intrinsic"] / layers["floor"]
    layers["flagged"] = [Evidence().tolerances.is_flagged(e, f) for e, f in zip(layers["intrinsic"], layers["floor"])]
    result.parity.first_flagged[next(t for t in result.parity.first_flagged if str(t) == "cpu")] = "fc2"
    ev = gather(result)
    assert ev.target_symptoms == () and [n.layer for n in ev.layer_notes] == ["fc2"]
    v = diagnose(result)
    assert v.category == "ok"
    assert any(e.startswith("note (cpu): 'fc2' (Linear): its own error is 0.0001") and "below min_error" in e
               for e in v.evidence)


def test_one_step_is_not_judged_for_convergence():
    v = diagnose(fake_result(steps=1))
    assert v.category == "ok"
    assert v.evidence[-1] == "convergence is not judged from 1 step; run --steps 5 or more for that"
    assert diagnose(fake_result(steps=3)).evidence[-1] == \
        "convergence is not judged from 3 steps; run --steps 5 or more for that"


def test_gather_passes_stochastic_layers_on():
    v = diagnose(fake_result(stochastic=("drop",)))
    assert v.category == "nondeterminism" and v.layer == "drop"


# --- hygiene: no training import, symptom names in one place, no float thresholds ----------

def test_diagnose_imports_neither_training_nor_torch():
    code = ("import sys, convcheck.diagnose; "
            "bad = [m for m in ('convcheck.measure.train', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def _symptom_names() -> dict[str, str]:
    return {k: v for k, v in vars(S).items() if k.isupper() and isinstance(v, str)}


def test_symptom_names_are_written_once():
    names = _symptom_names()
    assert len(set(names.values())) == len(names)
    for path in PACKAGE.rglob("*.py"):
        if path == DETECTORS / "training.py":
            continue
        strings = {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}
        assert not strings & set(names.values()), f"{path}: symptom name written as a literal"


# every module that decides: diagnose/, and what analysis/ and ddp/ measure a verdict with (their other modules hold
# process timeouts and byte sizes, not thresholds)
DECIDING = sorted((PACKAGE / "diagnose").rglob("*.py")) + [
    PACKAGE / "analysis" / name for name in ("diff.py", "rankdiff.py", "verdict.py")] + [
    PACKAGE / "ddp" / name for name in ("diagnostics.py", "parity.py", "probes.py", "rules.py")]


@pytest.mark.parametrize("path", DECIDING, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_threshold_literal_outside_thresholds(path):
    floats = [n.value for n in ast.walk(ast.parse(path.read_text()))
              if isinstance(n, ast.Constant) and isinstance(n.value, float) and n.value not in (0.0, 1.0)]
    assert floats == [], f"{path.name}: threshold literals {floats} belong in convcheck/numerics/thresholds.py"


def _curves(finals: dict[str, float], roles: dict[str, str], targets: dict[str, str], first: float = 2.3):
    rows = []
    for arm, final in finals.items():
        for step, loss in ((0, first), (19, final)):
            rows.append(dict(arm=arm, role=roles[arm], target=targets[arm], step=step, loss=loss))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("bf16, envelope, found", [
    (2.14, (2.14, 2.15, 2.16), False),   # just misses the 0.9 rule beside a like envelope: borderline (review)
    (127.9, (123.7, 124.5, 125.7), True),  # every run far above the judge's 2.03: the precision fails
])
def test_a_target_failing_with_its_envelope_is_no_convergence_only_when_far_from_the_judge(bf16, envelope, found):
    from convcheck.diagnose.target_symptoms import _outcome_symptoms
    from convcheck.targets.spec import Target

    bf, judge = Target.parse("cpu:bf16"), Target.parse(JUDGE)
    finals = {"cpu": 2.03, "cpu:bf16": bf16, JUDGE: 2.03, **{f"cpu:bf16~{i}": v for i, v in enumerate(envelope, 1)}}
    roles = {a: ("judge" if a == JUDGE else "envelope" if "~" in a else "target") for a in finals}
    targets = {a: a.split("~")[0] for a in finals}
    result = SimpleNamespace(
        config=SimpleNamespace(steps=20, judge=judge, targets=(Target.parse("cpu"), bf)),
        training=SimpleNamespace(curves=_curves(finals, roles, targets),
                                 outcomes={bf: outcome("cpu:bf16", 2.3, bf16), judge: outcome(JUDGE, 2.3, 2.03)}))
    got = _outcome_symptoms(result, bf)
    assert bool(got) == found, got
    if found:
        assert "one-ulp envelope runs fail alike" in got[0].evidence


def test_a_drift_to_nan_weights_is_said_in_words_not_as_infx():
    """A target whose weights went NaN/Inf has an infinite distance: the evidence says so, never "infx the spread"."""
    rows = [dict(arm="cpu:fp16", role="target", step=k, dist_other=math.inf if k else 1e-6, dist_ref=math.nan)
            for k in range(6)]
    rows += [dict(arm="cpu:fp16~1", role="envelope", step=k, dist_other=math.nan, dist_ref=1e-7) for k in range(6)]
    sym = S.envelope_drift(pd.DataFrame(rows), ["cpu:fp16", "cpu"], "cpu:fp16")
    assert "infx" not in sym.evidence and "stays within" not in sym.evidence
    assert "is not finite from step 1 (a run's weights hold NaN/Inf)" in sym.evidence
    rows = [dict(r, dist_other=math.inf) if r["role"] == "target" else r for r in rows]  # from step 0 on: beyond
    sym = S.envelope_drift(pd.DataFrame(rows), ["cpu:fp16", "cpu"], "cpu:fp16")
    assert sym.name == S.DRIFT and "infx" not in sym.evidence and "is not finite (a run's weights hold NaN/Inf)" in sym.evidence
