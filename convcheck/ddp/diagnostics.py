"""Diagnosing a data-parallel setup: why a ``ddp:`` arm computes another training than one device.

Pure functions over evidence already gathered (``TrainResult`` curves and its
``ddp_batchnorm`` record, the parity rows); no model is run here. Each
detector returns a ``DDPFinding`` (summary, evidence lines, remedy, the
layers named) or None; ``ddp_findings`` runs them in priority order. The
verdict they support is category ``setup``, sub-cause ``ddp``.

- ``batchnorm_per_rank``: BatchNorm layers normalise with each rank's batch
  statistics (no SyncBatchNorm), which differ from the global batch's at a
  small per-rank batch; remedy ``SyncBatchNorm.convert_sync_batchnorm``.
- ``loss_scale``: the data-parallel gradient (and loss) is the single-device
  one divided or multiplied by the world size: a loss summed over the batch
  (DDP averages the ranks' gradients) or a per-rank mean summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

SETUP = "setup"
SUB_CAUSE = "ddp"

# A rank's BatchNorm statistics differ from the global batch's when some channel's mean is more than
# BN_MEAN_SHIFT global standard deviations away, or its standard deviation off by more than BN_STD_CHANGE
# (relative). Batch statistics of n samples scatter by ~1/sqrt(n) std: per-rank batch 2 gives ~0.7, a
# per-rank batch of 256 ~0.06; float32 reduction order changes them by ~1e-7. 0.05 separates a per-rank
# normalisation from reduction-order noise by five orders of magnitude.
BN_MEAN_SHIFT = 0.05
BN_STD_CHANGE = 0.05
# The DDP/single-device ratio of the first step's gradient norm within this (relative) of world or 1/world.
LOSS_SCALE_TOLERANCE = 0.05


@dataclass(frozen=True)
class DDPFinding:
    kind: str  # "batchnorm_per_rank" | "loss_scale"
    arm: str
    summary: str
    evidence: tuple[str, ...] = ()
    remedy: str = ""
    layers: tuple[str, ...] = field(default_factory=tuple)
    category: str = SETUP
    sub_cause: str = SUB_CAUSE


def ddp_arms(training) -> list[str]:
    return [a.name for a in training.arms if a.role == "target" and getattr(a.target, "world", None)]


def single_device_partner(training, arm: str) -> str | None:
    """The other target (or the judge when the pair is a target and the judge)."""
    others = [a.name for a in training.arms if a.role == "target" and a.name != arm]
    return others[0] if others else (training.judge or None)


def batchnorm_per_rank(training, arm: str) -> DDPFinding | None:
    """Per-rank BatchNorm statistics off the global batch's, layer by layer (worst over steps)."""
    steps = getattr(training, "ddp_batchnorm", {}).get(arm) or []
    worst: dict[str, tuple[float, float]] = {}
    for record in steps:
        for layer, (shift, change) in record.items():
            old = worst.get(layer, (0.0, 0.0))
            worst[layer] = (max(old[0], shift), max(old[1], change))
    off = {k: v for k, v in worst.items() if v[0] > BN_MEAN_SHIFT or v[1] > BN_STD_CHANGE}
    if not off:
        return None
    world = _world(training, arm)
    names = tuple(sorted(off, key=lambda k: -max(off[k])))
    shown = ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    evidence = [f"BatchNorm '{n}' on {arm}: a rank's channel mean is up to {s:.3g} global std away from the "
                f"global batch's, its std off by up to {c:.1%}" for n, (s, c) in
                sorted(off.items(), key=lambda kv: -max(kv[1]))[:4]]
    drift = drift_line(training, arm)
    if drift:
        evidence.append(drift)
    return DDPFinding(
        kind="batchnorm_per_rank", arm=arm, layers=names,
        summary=(f"BatchNorm layers {shown} normalise each of the {world} ranks' slice with its own batch "
                 f"statistics, not the global batch's: {arm} trains another model than one device"),
        evidence=tuple(evidence),
        remedy=("synchronise the statistics: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) "
                "before wrapping it in DistributedDataParallel (or a larger per-rank batch; "
                "convcheck --ddp-sync-bn shows the difference)"),
    )


def loss_scale(training, arm: str) -> DDPFinding | None:
    """The first step's gradient norm (before any drift) is the single device's times world or 1/world."""
    other = single_device_partner(training, arm)
    world = _world(training, arm)
    if other is None or world < 2:
        return None
    c = training.curves
    first = c[c["step"] == c["step"].min()].set_index("arm")
    if arm not in first.index or other not in first.index:
        return None
    g_ddp, g_one = float(first.at[arm, "grad_norm"]), float(first.at[other, "grad_norm"])
    if not (math.isfinite(g_ddp) and math.isfinite(g_one)) or g_one <= 0 or g_ddp <= 0:
        return None
    ratio = g_ddp / g_one
    for factor, how in ((1.0 / world, "1/"), (float(world), "")):
        if abs(ratio / factor - 1.0) <= LOSS_SCALE_TOLERANCE:
            l_ddp, l_one = float(first.at[arm, "loss"]), float(first.at[other, "loss"])
            cause = ("the loss is summed over the batch: each rank sums its slice and DDP averages the ranks' "
                     "gradients, so the gradient is divided by the world size" if factor < 1 else
                     "the per-rank loss is multiplied by the world size (or averaged and then summed "
                     "over ranks), so the gradient is the world size times too large")
            return DDPFinding(
                kind="loss_scale", arm=arm,
                summary=f"the loss scale on {arm} is off by the world size ({how}{world}): {cause}",
                evidence=(f"first-step gradient norm {g_ddp:.4g} on {arm} vs {g_one:.4g} on {other}: "
                          f"ratio {ratio:.4g} (world size {world})",
                          f"first-step loss {l_ddp:.4g} on {arm} vs {l_one:.4g} on {other}"),
                remedy=("average the loss over the batch (reduction='mean'), or scale it by the world size "
                        "so the averaged gradient equals the single-device one; with a summed loss on purpose, "
                        "scale the learning rate with the world size"),
            )
    return None


DETECTORS = (loss_scale, batchnorm_per_rank)


def ddp_findings(training) -> list[DDPFinding]:
    """Every finding for every data-parallel arm, in priority order (loss scale first: it is exact)."""
    return [f for arm in ddp_arms(training) for det in DETECTORS if (f := det(training, arm)) is not None]


def drift_line(training, arm: str) -> str | None:
    """'parameter distance between A and B ends at X (Y x the envelope's spread)', when both are known."""
    c: pd.DataFrame = training.curves
    other = single_device_partner(training, arm)
    mine = c[c["arm"] == arm]
    if mine.empty or other is None:
        return None
    last = mine.iloc[-1]
    dist = float(last["dist_other"]) if math.isfinite(float(last["dist_other"])) else float(last["dist_judge"])
    env = c[c["role"] == "envelope"]
    spread = float(env[env["step"] == last["step"]]["dist_ref"].max()) if not env.empty else math.nan
    if math.isfinite(spread) and spread > 0:
        return f"parameter distance between {arm} and {other} ends at {dist:.3g}, {dist / spread:.3g}x the spread " \
               f"of the one-ulp envelope"
    return f"parameter distance between {arm} and {other} ends at {dist:.3g}"


def _world(training, arm: str) -> int:
    found = next((a for a in training.arms if a.name == arm), None)
    return int(getattr(found.target, "world", None) or 1) if found is not None else 1


def ddp_verdict(findings: list[DDPFinding]):
    """The verdict the first finding supports (category ``setup``, sub-cause ``ddp``), or None.

    Meant for a rule in ``convcheck.diagnose.rules`` (priority between the environment findings and the
    layer error): ``ddp_verdict(ev.ddp_findings)`` with ``Evidence.ddp_findings = ddp_findings(training)``."""
    if not findings:
        return None
    from convcheck.diagnose.verdict import Verdict

    main = findings[0]
    evidence = list(main.evidence) + [f"also: {f.summary}" for f in findings[1:]]
    remedies = [main.remedy] + [f.remedy for f in findings[1:] if f.remedy != main.remedy]
    return Verdict(SETUP, main.summary, evidence, remedies, target=main.arm,
                   layer=main.layers[0] if main.layers else None, sub_cause=SUB_CAUSE, symptoms=[main.kind])
