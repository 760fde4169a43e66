"""The verdict: rules over parity, curves, symptoms and environment findings.

Categories (ARCHITECTURE.md, "Verdict categories"): ``ok``, ``numerics``,
``layer``, ``version``, ``hardware``, ``setup``, ``nondeterminism``. The rules
run in a fixed order, the first that applies decides:

1. randomness: a layer draws random numbers no mask is shared for -> nondeterminism
2. every arm fails, the judge included (or envelope runs fail too) -> setup
3. the same target differs from itself run to run -> nondeterminism
4. a target symptom (layer flagged, non-finite values, GradScaler collapse,
   underflow, lost updates, drift beyond the envelope, a failed outcome) with a
   hardware finding -> hardware; with a version finding -> version
5. a layer turning finite values into NaN/Inf, or another precision effect -> numerics
6. a layer whose local error is far above its bound -> layer
7. otherwise -> ok
Diagnose never runs a model: everything it reads is in the comparison result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from convcheck import symptoms as S

CATEGORIES = ("ok", "numerics", "layer", "version", "hardware", "setup", "nondeterminism")


@dataclass(frozen=True)
class Verdict:
    category: str
    headline: str
    evidence: list[str] = field(default_factory=list)
    remedies: list[str] = field(default_factory=list)
    target: str | None = None
    layer: str | None = None
    sub_cause: str | None = None
    symptoms: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown verdict category {self.category!r}")

    def to_dict(self) -> dict:
        return {
            "category": self.category, "headline": self.headline, "evidence": list(self.evidence),
            "remedies": list(self.remedies), "target": self.target, "layer": self.layer,
            "sub_cause": self.sub_cause, "symptoms": list(self.symptoms),
        }


_SETUP_REMEDIES = {
    "non-finite loss": ["lower the learning rate (try 10x smaller)",
                        "clip gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"],
    "exploding gradients / learning rate too high": [
        "lower the learning rate (try 10x smaller)",
        "clip gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"],
    "vanishing gradients": [
        "replace saturating activations (sigmoid/tanh) with ReLU, or add BatchNorm between layers",
        "use residual connections or fewer layers; use Kaiming initialisation"],
    "saturated activations": ["normalise the inputs of saturating activations (BatchNorm) or use ReLU"],
    "dead ReLUs": ["lower the learning rate", "use LeakyReLU, or check the initialisation and the biases"],
    "loss plateau": ["check that labels match inputs", "raise the learning rate or train longer",
                     "check the input normalisation"],
    "oscillating loss": ["lower the learning rate", "use a larger batch"],
    "input data out of range": ["normalise the inputs (e.g. scale pixels to [0, 1] and standardise)"],
}
_SETUP_PRIORITY = ["non-finite loss", "exploding gradients / learning rate too high", "vanishing gradients",
                   "saturated activations", "dead ReLUs", "input data out of range", "loss plateau",
                   "oscillating loss"]


def diagnose(result) -> Verdict:
    """Turn one comparison's evidence into a verdict."""
    cfg = result.config
    parity, training = result.parity, result.training
    targets = [t for t in cfg.targets if t != cfg.judge]
    names = [str(t) for t in cfg.targets]
    per = training.outcomes
    judge_name = str(cfg.judge)
    curves = training.curves
    findings = list(result.findings or [])
    num_classes = result.model.num_classes
    evidence: list[str] = []

    # 1. randomness not shared between arms
    if parity.stochastic_layers:
        layer = parity.stochastic_layers[0]
        return Verdict(
            "nondeterminism",
            f"layer '{layer}' draws its own random numbers, so every arm sees different randomness: "
            "differences between the targets are not evidence of numerics",
            [f"re-running the judge's forward under another seed changes the output of "
             f"{', '.join(repr(s) for s in parity.stochastic_layers)} while its input stays the same",
             *_training_lines(per)],
            ["use nn.Dropout/Dropout2d modules (convcheck gives them the same masks on every arm) instead of "
             "functional or custom random draws",
             "or turn the randomness off for the comparison (model.eval() for that layer, or p=0)"],
            layer=layer, sub_cause="stochastic layer without shared masks", symptoms=["stochastic layer"])

    # 2. setup: the judge fails too (unless one-step parity already names a target-only cause)
    judge_info = per.get(judge_name)
    env_fail = training.envelope.failed if training.envelope else 0
    data_syms = S.data_problems(result.data_stats)
    target_syms = _target_symptoms(result, targets)
    step0 = [s for s in target_syms if s.step == 0 or s.name == "layer error"]
    judgeable = cfg.steps >= 2  # one loss value says nothing about convergence
    if judgeable and judge_info and not judge_info.converged and not step0:
        syms = S.training_problems(curves, training.layer_grads, training.activations, judge_name,
                                   num_classes, cfg.lr) + data_syms
        targets_ok = all(per[n].converged for n in names if n in per and n != judge_name)
        why = ("the float64 judge fails too, so the setup, not the device" if targets_ok
               else "every arm fails, the float64 judge included")
        return _setup_verdict(syms, per, cfg, why)
    if judgeable and env_fail and not step0 and all(per[n].converged for n in names if n in per):
        return Verdict(
            "setup",
            f"{env_fail} of {cfg.envelope} envelope runs of the lower-precision target fail from one-ulp "
            "changes of the initial weights: the setup is fragile, not the device",
            [f"{env_fail}/{cfg.envelope} perturbed runs did not converge", *_training_lines(per)],
            ["lower the learning rate or add warm-up", "add normalisation layers; check the initialisation"],
            sub_cause="fragile setup", symptoms=["envelope runs fail"])

    # 3. a target differs from itself
    # (differences below min_error are reported with the verdict, not as one)
    for name, diff in parity.self_difference.items():
        if diff > cfg.tolerances.min_error:
            return Verdict(
                "nondeterminism",
                f"{name} gives different results for the same input and seed (relative difference {diff:.2e})",
                [f"two identical forward/backward runs of {name} differ by {diff:.2e} (relative L2)"],
                ["torch.use_deterministic_algorithms(True) and torch.backends.cudnn.benchmark = False",
                 "set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts"],
                target=name, sub_cause="nondeterministic kernels", symptoms=["self difference"])

    # 4-6. target symptoms
    drift = None
    if cfg.envelope > 0 and len(cfg.targets) == 2:
        # the pair as (a target arm, the other): the judge has no distance of its own to the other side
        pair = sorted(names, key=lambda n: n == judge_name)
        drift = S.envelope_drift(curves, pair, training.lower_precision)
        if drift is not None and drift.name == "drift beyond envelope":
            target_syms.append(drift)
    if target_syms:
        hw = _matching(findings, "hardware")
        ver = _matching(findings, "version")
        main = target_syms[0]
        if hw:
            return _env_verdict("hardware", hw, main, target_syms, per)
        if ver:
            return _env_verdict("version", ver, main, target_syms, per)
        return _symptom_verdict(main, target_syms, per, result, findings)

    # 7. ok
    evidence += _training_lines(per)
    table = parity.layers.assign(r=parity.layers["local"] / parity.layers["bound"])
    for name, rows in table.dropna(subset=["r"]).groupby("target", sort=False):
        w = rows.sort_values("r").iloc[-1]
        evidence.append(f"{name}: every layer within its bound; the closest is '{w['layer']}' with local error "
                        f"{w['local']:.2e}, {w['r']:.2g}x its bound {w['bound']:.2e}")
    if drift is not None:
        evidence.append(drift.evidence)
    notes = [f"{f.id}: {f.message}" for f in findings if getattr(f, "severity", "") in ("critical", "warn")]
    evidence += notes
    evidence += [f"{n} differs from itself run to run by {d:.2e} (below {cfg.tolerances.min_error:g}: benign)"
                 for n, d in parity.self_difference.items() if d > 0]
    if not judgeable:
        evidence.append(f"convergence is not judged from {cfg.steps} step; run --steps 2 or more for that")
    return Verdict("ok", f"both targets train alike: {' and '.join(names)} agree with the float64 judge "
                   "within the expected rounding", evidence, [], symptoms=[])


def _training_lines(per: dict) -> list[str]:
    out = []
    for name, info in per.items():
        state = "converged" if info.converged else "did not converge"
        out.append(f"{name}: {state}, loss {info.first_loss:.4g} -> {info.final_loss:.4g}"
                   + (f", first non-finite at step {info.first_nonfinite_step}"
                      if info.first_nonfinite_step is not None else ""))
    return out


def _setup_verdict(syms, per, cfg, why: str) -> Verdict:
    syms = sorted(syms, key=lambda s: _SETUP_PRIORITY.index(s.name) if s.name in _SETUP_PRIORITY else 99)
    if syms:
        main = syms[0]
        headline = f"training setup: {main.name}" + (f" in '{main.layer}'" if main.layer else "") + f" ({why})"
        remedies = list(_SETUP_REMEDIES.get(main.name, []))
        if main.name == "exploding gradients / learning rate too high":
            headline = f"training setup: learning rate {cfg.lr:g} is too high, gradients explode ({why})"
    else:
        main = None
        headline = f"training setup: no arm converges in {cfg.steps} steps ({why})"
        remedies = ["train longer or raise the learning rate", "check data, labels and loss"]
    evidence = [f"{s.name} ({s.arm}): {s.evidence}" for s in syms[:4]] + _training_lines(per)
    return Verdict("setup", headline, evidence, remedies, layer=main.layer if main else None,
                   sub_cause=main.name if main else "no convergence", symptoms=[s.name for s in syms])


def _matching(findings, kind: str) -> list:
    return [f for f in findings if getattr(f, "kind", None) == kind
            and getattr(f, "severity", "") in ("critical", "warn")]


def _env_verdict(category: str, found: list, main, syms, per) -> Verdict:
    f = found[0]
    where = f" in '{main.layer}'" if main.layer else ""
    headline = f"{f.id}: {f.message.rstrip('.')} - and {main.arm} shows {main.name}{where}"
    evidence = [f"{x.id} ({x.severity}): {x.message} [source: {x.source}]" for x in found[:3]]
    evidence += [f"{s.name} ({s.arm}): {s.evidence}" for s in syms[:3]] + _training_lines(per)
    remedies = [x.remedy for x in found[:3] if x.remedy]
    return Verdict(category, headline, evidence, remedies, target=main.arm, layer=main.layer,
                   sub_cause=f.id, symptoms=[s.name for s in syms])


def _target_symptoms(result, targets: list[Target]) -> list:
    parity, training, cfg = result.parity, result.training, result.config
    curves, per = training.curves, training.outcomes
    judge_name = str(cfg.judge)
    judge_info = per.get(judge_name)
    out = []
    for t in targets:
        name = str(t)
        nf = S.nonfinite_producer(parity.layers, name)
        if nf is not None:
            out.append(nf)
        producer = training.nonfinite_producer.get(name)
        if nf is None and producer is not None and training.nonfinite_producer.get(judge_name) is None:
            step, layer = producer
            out.append(S.Symptom("non-finite forward", name, f"'{layer}' turned finite inputs into NaN/Inf "
                                 f"at training step {step}", layer=layer, step=step))
        gs = S.grad_scaler_problems(curves, name)
        if gs:
            out.append(gs)
        uf = S.underflow(training.layer_grads, name, judge_name) if t.runner.half_compute else None
        if uf:
            out.append(uf)
        # lr*|g|/|W| is the step size of SGD only (Adam's steps are ~lr per element)
        lu = (S.lost_updates(curves, name, t.unit_roundoff, t.runner.half_storage)
              if cfg.optimizer == "sgd" else None)
        if lu and name in per and not per[name].converged:
            out.append(lu)
        flagged = parity.first_flagged.get(name)
        if flagged and not any(s.layer == flagged for s in out):
            rows = parity.flagged(name)
            r = rows[rows["layer"] == flagged].iloc[0]
            out.append(S.Symptom("layer error", name,
                                 f"local error of '{flagged}' ({r['module']}) is {r['local']:.3g}, "
                                 f"{r['local'] / r['bound']:.3g}x its expected bound {r['bound']:.2e} "
                                 f"(u={r['u']:.2e}, K={int(r['K'])}); propagated error {r['propagated']:.3g}",
                                 layer=flagged, value=float(r["local"]), extra={"kind": r["kind"]}))
        info = per.get(name)
        judge_ok = judge_info.converged if judge_info else True
        if cfg.steps >= 2 and info and not info.converged and judge_ok and not any(s.arm == name for s in out):
            # Borderline runs that only just miss the rule are not a finding: the outcome must be
            # worse than the envelope runs', or (without an envelope) clearly worse than the judge's.
            has_envelope = bool((curves["role"] == "envelope").any())
            oc = S.outcome_vs_envelope(curves, name) if has_envelope else None
            judge_final = judge_info.final_loss if judge_info else math.nan
            worse = (not math.isfinite(info.final_loss)
                     or info.final_loss > judge_final * (1 + S.OUTCOME_RELATIVE) + 1e-12)
            if oc:
                out.append(oc)
            elif not has_envelope and worse:
                out.append(S.Symptom("no convergence", name,
                                     f"{name} did not converge (loss {info.first_loss:.4g} -> "
                                     f"{info.final_loss:.4g}) while the judge did (-> {judge_final:.4g})"))
    order = {"non-finite forward": 0, "non-finite backward": 1, "GradScaler collapse": 2, "layer error": 3,
             "gradient underflow": 4, "small updates lost": 5}
    return sorted(out, key=lambda s: order.get(s.name, 9))


def _symptom_verdict(main, syms, per, result, findings) -> Verdict:
    evidence = [f"{s.name} ({s.arm}): {s.evidence}" for s in syms[:4]] + _training_lines(per)
    math_notes = [f for f in findings if getattr(f, "kind", None) == "numerics"]
    evidence += [f"{f.id}: {f.message}" for f in math_notes[:2]]
    layer = main.layer
    if main.name == "layer error":
        return Verdict(
            "layer", f"layer '{layer}' computes something else on {main.arm}: its local error is far above "
            "what the precision explains; later layers only pass it on",
            evidence,
            [f"run '{layer}' in float32: disable autocast around it (torch.autocast(device_type, enabled=False)) "
             "and cast its input with .float()",
             f"if '{layer}' is your own code, use a numerically stable formula (e.g. torch.var or a two-pass "
             "variance instead of E[x^2]-E[x]^2)"],
            target=main.arm, layer=layer, sub_cause="local error above bound", symptoms=[s.name for s in syms])
    remedies = _numerics_remedies(main, result)
    if main.name == "non-finite forward" and main.extra.get("overflow"):
        headline = (f"float16 overflow in '{layer}' on {main.arm}: it produces the first Inf "
                    f"(values reach {main.value:.4g} > 65504)")
    elif main.name.startswith("non-finite"):
        headline = f"'{layer}' produces the first NaN/Inf on {main.arm} from finite inputs"
    elif main.name == "drift beyond envelope":
        headline = (f"{main.arm} drifts from the other target {main.value:.3g}x beyond the one-ulp noise envelope "
                    f"from step {main.step}, while every layer is within its bound")
    else:
        headline = f"{main.name} on {main.arm}" + (f" in '{layer}'" if layer else "")
    return Verdict("numerics", headline, evidence, remedies, target=main.arm, layer=layer,
                   sub_cause=main.name, symptoms=[s.name for s in syms])


def _numerics_remedies(main, result) -> list[str]:
    t = next((x for x in result.config.targets if str(x) == main.arm), None)
    layer = main.layer
    out = []
    if main.name.startswith("non-finite") or main.name == "GradScaler collapse":
        if t is not None and t.runner.mixed_precision:
            out.append(f"keep '{layer}' in float32 under autocast (torch.autocast(device_type, enabled=False) "
                       "around it), or use bfloat16 autocast, which has float32's range")
        elif layer:
            out.append(f"keep '{layer}' in float32, or normalise its input so values stay below 65504")
        out.append("scale activations down (add normalisation before the layer)")
    if main.name == "gradient underflow":
        out.append("use torch.amp.GradScaler to scale the loss, or bfloat16 instead of float16")
    if main.name == "small updates lost":
        out.append("keep float32 master weights (autocast instead of casting the model to bf16/fp16)")
    if main.name in ("drift beyond envelope", "outcome outside envelope", "no convergence"):
        if t is not None and t.runner.tf32_like:
            out.append("disable TF32: torch.backends.cuda.matmul.allow_tf32 = False; "
                       "torch.backends.cudnn.allow_tf32 = False")
        if t is not None and t.runner.half_compute:
            out.append("run the sensitive layers in float32 under autocast, or train in float32")
        out.append("compare with --targets using the higher precision on both sides to confirm")
    return out or ["rerun in float32 (cpu:float32 vs your target) to confirm the precision effect"]
