"""The rule of the ``layer`` category: one layer's own error far above what its precision allows."""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.evidence import Evidence, TargetFacts
from convcheck.diagnose import remedies as RM
from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.rules.lines import symptom_evidence
from convcheck.diagnose.verdict import Verdict


@verdict_rule(
    "V007", "layer-error", priority=70, category="layer",
    headline="layer '{layer}'{module} computes something else on {target}: its own error is far above "
             "what the precision allows; later layers only pass it on",
    remedies=("run '{layer}' in float32: disable autocast around it (torch.autocast(device_type, enabled=False)) "
              "and cast its input with .float()",
              "if '{layer}' is your own code, use a numerically stable formula (e.g. torch.var or a two-pass "
              "variance instead of E[x^2]-E[x]^2)"))
def layer_error(ev: Evidence) -> Verdict | None:
    """The main target symptom is a layer whose own error is far above its floor (or destroys its
    result). Remedies fit the target (``layer_remedies``): autocast off around it, the layer kept in
    float32 in a cast model, TF32 off, or (float32) only the stable formula."""
    if not ev.symptoms or ev.symptoms[0].name != S.LAYER_ERROR:
        return None
    main = ev.symptoms[0]
    module = main.extra.get("module")
    return layer_error.verdict(
        symptom_evidence(ev), {"layer": main.layer, "target": main.arm, "module": f" ({module})" if module else ""},
        remedies=layer_remedies(ev, main), target=main.arm, layer=main.layer,
        sub_cause="own error above floor", symptoms=[s.name for s in ev.symptoms])


_STABLE_FORMULA = ("if '{layer}' is your own code, use a numerically stable formula (e.g. torch.var or a two-pass "
                   "variance instead of E[x^2]-E[x]^2; no large offset added and subtracted)")


def layer_remedies(ev: Evidence, main: S.Symptom) -> list[str]:
    """What runs the flagged layer at a higher precision on this kind of target."""
    t = ev.target_facts.get(main.arm) or TargetFacts()
    layer = main.layer
    out = []
    if t.mixed_precision:
        out.append(RM.LAYER_AUTOCAST_OFF.remedy(layer=layer))
    elif t.half_storage:
        out.append(RM.LAYER_IN_CAST_MODEL.remedy(layer=layer, fmt=t.compute_format))
    elif t.tf32_like:
        out.append(RM.DISABLE_TF32_MODEL.remedy())
    out.append(_STABLE_FORMULA.format(layer=layer))
    return out
