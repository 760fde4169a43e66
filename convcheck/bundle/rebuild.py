"""A ``CompareResult`` from two checked bundles and a ``JudgeRecord`` (made by ``convcheck.bundle.diff``)."""

from __future__ import annotations

import dataclasses
import math

import torch

from convcheck.bundle.common import JudgeRecord, config_of
from convcheck.bundle.reader import Bundle
from convcheck.numerics.metrics import rel_l2
from convcheck.targets.spec import Target


@dataclasses.dataclass(frozen=True)
class LabelledTarget(Target):
    """The same target spec recorded on two machines: ``cuda@A`` and ``cuda@B`` (runner as ``cuda``)."""

    label: str = ""

    def __str__(self) -> str:
        return f"{Target.__str__(self)}@{self.label}"


def _targets(a: Bundle, b: Bundle, labels: tuple[str, str]) -> tuple[Target, Target]:
    ta, tb = Target.parse(a["target"]), Target.parse(b["target"])
    if ta != tb:
        return ta, tb
    fields = {f.name: getattr(ta, f.name) for f in dataclasses.fields(Target)}
    return LabelledTarget(**fields, label=labels[0]), LabelledTarget(**fields, label=labels[1])


def _rename(bundle: Bundle, target: Target) -> dict:
    """The side's training tables and parity rows with its target (and its envelope runs) named ``target``."""
    raw, new = bundle["target"], str(target)

    def name(n):
        if n == raw:
            return new
        if isinstance(n, str) and n.startswith(raw + "~"):
            return new + n[len(raw):]
        return n

    out = {key: [{**r, "arm": name(r["arm"])} for r in bundle["training"][key]]
           for key in ("curves", "layer_grads", "activations")}
    for r in out["curves"]:
        r["target"] = name(r["target"])
    out["producer"] = {name(k): v for k, v in bundle["training"]["nonfinite_producer"].items()}
    out["weights"] = {name(k): v for k, v in bundle["training"].get("nonfinite_weights", {}).items()}
    out["detail"] = {name(k): v for k, v in bundle["training"].get("nonfinite_detail", {}).items()}  # /2 on
    out["rows"] = [{**r, "target": name(r["target"])} for r in bundle["parity"]["rows"]]
    return out


def _rows(bundle: Bundle, renamed: dict, judge: JudgeRecord) -> list[dict]:
    """The side's parity rows, ``propagated`` recomputed from its arrays against ``judge``."""
    fwd = {e["key"]: i for i, e in enumerate(bundle["arrays"]["forward"])}
    grd = {e["param"]: i for i, e in enumerate(bundle["arrays"]["grads"])}
    rows = []
    for r in renamed["rows"]:
        r = dict(r)
        if isinstance(r.get("shape"), list):
            r["shape"] = tuple(r["shape"])
        if r["kind"] == "forward" and r["layer"] in fwd and r["layer"] in judge.outputs:
            ref = judge.outputs[r["layer"]]
            arr = torch.from_numpy(bundle.forward(fwd[r["layer"]]))
            if tuple(arr.shape) == tuple(ref.shape) and not math.isnan(r["propagated"]):
                r["propagated"] = rel_l2(arr, ref)
        elif r["kind"] == "grad" and r.get("param") in grd and r.get("param") in judge.grads:
            ref = judge.grads[r["param"]]
            arr = torch.from_numpy(bundle.grad(grd[r["param"]]))
            if tuple(arr.shape) == tuple(ref.shape) and not math.isnan(r["propagated"]):
                r["propagated"] = rel_l2(arr, ref)
        rows.append(r)
    return rows


def _dist(a: list, b: list) -> float:
    """``metrics.param_distance`` over two recorded parameter lists: ||a - b|| / ||b|| in float64."""
    num = den = 0.0
    for pa, pb in zip(a, b):
        va, vb = torch.from_numpy(pa).to(torch.float64), torch.from_numpy(pb).to(torch.float64)
        num += float(torch.linalg.vector_norm(va - vb)) ** 2
        den += float(torch.linalg.vector_norm(vb)) ** 2
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num / den) if den > 0 else math.nan


def _curves(a: Bundle, b: Bundle, ra: dict, rb: dict, arms, steps: int):
    """Per step: A's and B's rows, the judge's (A's), the envelope runs' (from the side they perturb);
    ``dist_other`` from the snapshots both sides hold after that step (NaN where one lacks it)."""
    names = [arm.name for arm in arms]
    rank = {n: i for i, n in enumerate(names)}
    source = {names[0]: ra, names[1]: rb, names[2]: ra}
    for arm in arms[3:]:
        source[arm.name] = ra if arm.reference == names[0] else rb

    def table(key):
        rows = [r for n, side in source.items() for r in side[key] if r["arm"] == n]
        rows.sort(key=lambda r: (r["step"], rank[r["arm"]]))
        return rows

    curves = table("curves")
    for r in curves:
        if r["arm"] in names[:2]:
            r["dist_other"] = math.nan
    for step in range(steps):
        pa, pb = a.snapshot(step + 1), b.snapshot(step + 1)
        if pa is None or pb is None:
            continue
        for r in curves:
            if r["step"] == step and r["arm"] == names[0]:
                r["dist_other"] = _dist(pa, pb)
            elif r["step"] == step and r["arm"] == names[1]:
                r["dist_other"] = _dist(pb, pa)
    return curves, table("layer_grads"), table("activations"), source


def build_result(a: Bundle, b: Bundle, judge: JudgeRecord, resolved, recipe, labels=("A", "B")):
    from convcheck.env import audit
    from convcheck.env.fingerprint import Fingerprint
    from convcheck.measure.parity import ParityResult
    from convcheck.pipeline import CompareResult
    from convcheck.measure.train import TrainConfig, TrainResult, make_arms

    ta, tb = _targets(a, b, labels)
    ra, rb = _rename(a, ta), _rename(b, tb)
    cfg = config_of(a, (ta, tb), Target.parse(a["judge"]))  # the judge arm the curves were trained with
    parity = ParityResult.from_rows(
        _rows(a, ra, judge) + _rows(b, rb, judge), [ta, tb], cfg.tolerances, a["parity"]["judge_loss"],
        losses={ta: a["parity"]["loss"], tb: b["parity"]["loss"]},
        stochastic_layers=a["parity"]["stochastic_layers"],
        self_difference={ta: a["parity"]["self_difference"], tb: b["parity"]["self_difference"]}, judge=judge.name)
    # The recorded judge arm: the one trained on A's machine, named as recorded.
    # (the recorded envelope runs were nudged once, before step 0, whatever the two targets' precisions)
    arms = make_arms([ta, tb], cfg.envelope, cfg.seed, Target.parse(a["judge"]), every_step=False)
    curves, grads, acts, source = _curves(a, b, ra, rb, arms, cfg.steps)
    side = {arm: source[arm.name] for arm in arms}
    training = TrainResult.from_rows(
        curves, grads, acts, arms, TrainConfig(steps=cfg.steps, seed=cfg.seed, recipe=recipe), cfg.tolerances,
        nonfinite_producer={arm: tuple(s["producer"].get(arm.name) or ()) or None for arm, s in side.items()},
        nonfinite_weights={arm: bool(s["weights"].get(arm.name, False)) for arm, s in side.items()},
        nonfinite_detail={arm: dict(s["detail"].get(arm.name) or {}) for arm, s in side.items()})
    fps = [Fingerprint.from_dict(x["fingerprint"]) for x in (a, b)]
    findings, seen = [], set()
    for fp in fps:
        for f in audit(fp):
            key = (f.id, f.message if hasattr(f, "message") else str(f))
            if key not in seen:
                seen.add(key)
                findings.append(f)
    notes = list(a.manifest.get("notes") or [])
    if a["judge"] != b["judge"]:
        notes.append(f"the recorded judges differ ({a['judge']} for {a['target']}, {b['judge']} for "
                     f"{b['target']}): local errors are each against its own")
    result = CompareResult(
        model=resolved, config=cfg, parity=parity, training=training, data_source=a["data_source"],
        batch_hashes=tuple(a["batch_sha256"]), init_hash=a["init_sha256"], data_stats=a["data_stats"],
        notes=notes, findings=findings, fingerprint=fps[1 if training.lower_precision == tb else 0],
        judge_reason=judge.reason, recipe=recipe, batches_hash=a["batches_sha256"],
        loss_batch_ratio=judge.loss_batch_ratio)
    from convcheck.diagnose import diagnose

    return dataclasses.replace(result, verdict=diagnose(result)), fps
