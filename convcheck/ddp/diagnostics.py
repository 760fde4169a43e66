"""Diagnosing a data-parallel setup: why a ``ddp:`` arm computes another training than one device.

Pure functions over evidence already gathered (``TrainResult`` curves and the
arm's ``RankMeasures`` in ``TrainResult.arm_evidence``); no model is run here.
Each detector returns a ``DDPFinding`` (summary, evidence lines, remedy, the
layers named) or None; ``arm_findings`` runs them in priority order (the
rank-pool executor's ``findings`` hook, one arm at a time). The verdict they
support is category ``setup``, sub-cause ``ddp`` (rule V009, ``rules``).

- ``batchnorm_per_rank``: BatchNorm layers normalise with each rank's batch
  statistics (no SyncBatchNorm), which differ from the global batch's at a
  small per-rank batch; remedy ``SyncBatchNorm.convert_sync_batchnorm``.
- ``loss_scale``: the data-parallel gradient (and loss) is the single-device
  one divided or multiplied by the world size: a loss summed over the batch
  (DDP averages the ranks' gradients) or a per-rank mean summed.
- ``same_data``: two ranks' slices of the global batch hash alike: the data
  is not sharded (every rank loads the same samples: no DistributedSampler).
- ``buffers_not_broadcast``: a buffer differs across ranks when the forward
  starts (``broadcast_buffers=False``, or a buffer set per rank).
- ``dropout_per_rank``: a module draws from torch's global generators in its
  forward (``F.dropout``...), which the shared masks do not cover: each rank
  draws its own mask for its slice (and, seeded alike, the same numbers).

``loss_scale``, ``same_data``, ``buffers_not_broadcast`` and ``dropout_per_rank`` are exact evidence
(``EXACT``): the verdict names them whatever the drift; per-rank BatchNorm by the outcome alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from convcheck.numerics.thresholds import (BN_GRAD_TOLERATED, BN_MEAN_SHIFT, BN_RANK_BATCH_OK, BN_STD_CHANGE,
                                          GRAD_FAR, LOSS_SCALE_TOLERANCE)
from convcheck.ddp.evidence import RankMeasures
from convcheck.diagnose.detectors.training import STOCHASTIC_LAYER

SETUP = "setup"
SUB_CAUSE = "ddp"

# Findings that need no drift to be a setup difference.
EXACT = ("loss_scale", "same_data", "buffers_not_broadcast", "dropout_per_rank", "gradient_apart")


@dataclass(frozen=True)
class DDPFinding:
    kind: str  # loss_scale, same_data, buffers_not_broadcast, dropout_per_rank, gradient_apart, batchnorm_per_rank
    arm: str
    summary: str
    evidence: tuple[str, ...] = ()
    remedy: str = ""
    layers: tuple[str, ...] = field(default_factory=tuple)
    category: str = SETUP
    sub_cause: str = SUB_CAUSE
    covers: tuple[str, ...] = ()  # other findings' kinds this one stands for (the step-0 gradient's BatchNorm)
    approximate: bool = False  # an EXACT kind that still needs the drift and the outcome (``gradient_apart``)

    @property
    def exact(self) -> bool:
        """A setup difference whatever the drift (``EXACT``)."""
        return self.kind in EXACT and not self.approximate

    @property
    def explains_drift(self) -> bool:
        """Per-rank BatchNorm alone (or the step-0 gradient it explains): its drift is always far, the outcome
        judges it (``diagnose.rules.numerics.drift_is_a_note``, rule V009)."""
        return self.kind == "batchnorm_per_rank" or (self.kind == "gradient_apart" and self.approximate)

    @property
    def explains(self) -> tuple[str, ...]:
        """Symptom kinds this finding accounts for: random draws the ranks found explain a stochastic layer
        (rule V001 leaves them to V009, which has the per-rank evidence)."""
        return (STOCHASTIC_LAYER,) if self.kind == "dropout_per_rank" else ()


def single_device_partner(training, arm: str) -> str | None:
    """The other target (or the judge when the pair is a target and the judge)."""
    others = [a.name for a in training.arms if a.role == "target" and a.name != arm]
    return others[0] if others else (training.judge or None)


BN_REMEDY = ("synchronise the statistics: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) "
             "before wrapping it in DistributedDataParallel (or a larger per-rank batch; "
             "convcheck --ddp-sync-bn shows the difference)")


def batchnorm_per_rank(training, arm: str) -> DDPFinding | None:
    """Per-rank BatchNorm statistics off the global batch's, layer by layer (worst over steps)."""
    steps = _evidence(training, arm).batchnorm
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
        remedy=BN_REMEDY,
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


def _evidence(training, arm: str) -> RankMeasures:
    """What the arm's ranks gathered (empty when nothing was: a result read back from a bundle)."""
    found = next((v for a, v in training.arm_evidence.items() if a.name == arm), None)
    return found or RankMeasures()


def same_data(training, arm: str) -> DDPFinding | None:
    """Two ranks' slices hash alike in at least half the steps: every rank trains on the same samples."""
    steps = _evidence(training, arm).slices
    repeated = [(i, _equal_ranks(h)) for i, h in enumerate(steps)]
    repeated = [(i, pairs) for i, pairs in repeated if pairs]
    if not steps or len(repeated) * 2 < len(steps):
        return None
    world = _world(training, arm)
    first_step, pairs = repeated[0]
    shown = "; ".join(f"ranks {', '.join(map(str, group))}" for group in pairs)
    return DDPFinding(
        kind="same_data", arm=arm,
        summary=(f"the ranks of {arm} see the same samples: in {len(repeated)} of {len(steps)} steps two or more "
                 f"of the {world} ranks' slices of the global batch are identical, so the data is not sharded "
                 f"and the effective batch is one rank's"),
        evidence=(f"per-rank batch hashes equal at step {first_step + 1}: {shown} "
                  f"(SHA-256 over each rank's samples and targets)",
                  f"steps with a repeated slice: {', '.join(str(i + 1) for i, _ in repeated[:8])}"
                  + (" ..." if len(repeated) > 8 else "")),
        remedy=("shard the data across ranks: DataLoader(dataset, sampler=DistributedSampler(dataset, "
                "num_replicas=world_size, rank=rank), ...) and sampler.set_epoch(epoch) every epoch; an "
                "iterable source must skip to its rank's share (itertools.islice(it, rank, None, world_size))"),
    )


def _equal_ranks(hashes: list[str]) -> list[tuple[int, ...]]:
    groups: dict[str, list[int]] = {}
    for rank, h in enumerate(hashes):
        groups.setdefault(h, []).append(rank)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def set_per_rank(training, arm: str) -> dict[str, int]:
    """``{buffer: first step}`` for buffers that were equal on every rank when a forward started and differed
    when it ended: the forward sets them from the rank's own slice (a running statistic), so no broadcast
    makes the ranks compute what one device does. Steps as the curves number them (from 0)."""
    ev = _evidence(training, arm)
    found: dict[str, int] = {}
    for step, after in enumerate(ev.buffers_after):
        before = ev.buffers[step] if step < len(ev.buffers) else {}
        for name, spread in after.items():
            if spread > 0 and not before.get(name) and name not in found:
                found[name] = step
    return found


def _statistic_remedy(names) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"compute {shown} over all ranks in the forward: all_reduce the slice's sum and count "
            "(torch.distributed.all_reduce) and divide, as SyncBatchNorm does for BatchNorm's statistics; "
            "broadcasting the buffer (broadcast_buffers=True, the default) does not fix it: each rank's forward "
            "already used its own slice's value")


def buffers_not_broadcast(training, arm: str) -> DDPFinding | None:
    """A buffer differs across ranks when the forward starts (after DDP's broadcast, when it broadcasts)."""
    worst: dict[str, tuple[float, int]] = {}
    for step, record in enumerate(_evidence(training, arm).buffers):
        for name, spread in record.items():
            old = worst.get(name, (0.0, step))
            worst[name] = (max(old[0], spread), old[1])  # the largest spread, the first step it was seen
    if not worst:
        return None
    names = sorted(worst, key=lambda n: -worst[n][0])
    layers = tuple(dict.fromkeys(n.rpartition(".")[0] or n for n in names))
    shown = ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    per_rank = set_per_rank(training, arm)
    # steps as the curves number them (from 0): a spread seen as step k's forward starts was made before it
    evidence = [f"buffer '{n}' on {arm}: ranks differ by up to {worst[n][0]:.3g} of its largest value when the "
                f"forward starts (first when step {worst[n][1]}'s forward starts"
                + (f"; step {per_rank[n]}'s forward set it from each rank's own slice)" if n in per_rank else ")")
                for n in names[:4]]
    drift = drift_line(training, arm)
    own = [n for n in names if n in per_rank]
    broadcast = ("broadcast the buffers: DistributedDataParallel(model, broadcast_buffers=True) (the default), or "
                 "keep them equal across ranks yourself (SyncBatchNorm for BatchNorm statistics, an all_reduce for "
                 "a running buffer of your own)")
    if own and len(own) == len(names):
        remedy = _statistic_remedy(own)
    elif own:
        remedy = f"{broadcast}; and {_statistic_remedy(own)}"
    else:
        remedy = broadcast
    return DDPFinding(
        kind="buffers_not_broadcast", arm=arm, layers=layers,
        summary=(f"buffers {shown} differ across the ranks of {arm} when the forward starts: they are not "
                 f"broadcast from rank 0, so each rank runs another model (and a checkpoint keeps rank 0's)"
                 + (f"; {', '.join(repr(n) for n in own[:4])} {'is' if len(own) == 1 else 'are'} set in the "
                    f"forward from each rank's own slice, so a broadcast alone would not make them equal"
                    if own else "")),
        evidence=tuple(evidence + ([drift] if drift else [])),
        remedy=remedy,
    )


def dropout_per_rank(training, arm: str) -> DDPFinding | None:
    """Modules that draw from torch's global random generators in their forward, found in the ranks."""
    draws = _evidence(training, arm).draws or {}
    layers = tuple(draws.get("layers") or ())
    if not layers:
        return None
    world = _world(training, arm)
    shown = ", ".join(f"'{n}'" for n in layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    same = bool(draws.get("same_on_every_rank"))
    how = ("every rank drew the same random numbers for its own slice (the ranks were seeded alike), so the "
           "ranks drop the same positions" if same else "the ranks drew different random numbers")
    return DDPFinding(
        kind="dropout_per_rank", arm=arm, layers=layers,
        summary=(f"{shown} draw{'s' if len(layers) == 1 else ''} random numbers inside the forward "
                 f"(F.dropout, torch.rand..., not an nn.Dropout module), which the shared masks do not cover: "
                 f"each of the {world} ranks of {arm} draws a mask for its own slice, none of them the single "
                 f"device's mask over the whole batch"),
        evidence=(f"on {arm}, the global random generator's state changed across the forward of {shown} in the "
                  f"first step; {how}",),
        remedy=("use nn.Dropout modules (convcheck gives them the same masks on every rank and arm) instead of "
                "F.dropout in forward; in your own DDP training seed each rank differently "
                "(torch.manual_seed(seed + rank)) so that the ranks do not drop the same positions"),
    )




def gradient_apart(training, arm: str, parity) -> DDPFinding | None:
    """The averaged gradient at step 0 (parity's DDP rows) far outside its bound: the ranks compute another
    gradient than one device; names what computes from each rank's slice (BatchNorm without SyncBatchNorm,
    a buffer the forward sets per rank) when the ranks' evidence shows it."""
    layers = getattr(parity, "layers", None)
    if layers is None or not len(layers):
        return None
    rows = layers[(layers["target"] == arm) & (layers["kind"] == "grad")]
    sizes = [float(v) for v in rows["ref_absmax"] if math.isfinite(float(v))] if "ref_absmax" in rows else []
    # a parameter whose true gradient is zero (a shift every logit gets; a bias before a BatchNorm) has a
    # judge gradient of rounding noise: one device's float32 gradient may be exactly 0 (bound 10), the
    # all-reduce's ~1e-8 against the judge's ~1e-16: a relative error of 1e8 that says nothing
    negligible = math.sqrt(float(rows["u"].max())) * max(sizes) if sizes and "u" in rows else 0.0
    over = []
    for _, r in rows.iterrows():
        err, bound = float(r["propagated"]), float(r["bound"])
        if not (math.isfinite(err) and math.isfinite(bound)) or bound <= 0 or err <= GRAD_FAR * bound:
            continue
        size = float(r["ref_absmax"]) if "ref_absmax" in r else math.inf
        if math.isfinite(size) and size <= negligible:
            continue
        over.append((str(r["param"] or r["layer"]), err, bound))
    if not over:
        return None
    param, err, bound = max(over, key=lambda w: w[1] / w[2])
    largest = max(w[1] for w in over)  # what the BatchNorm approximation is held to
    ev = _evidence(training, arm)
    bn = {}
    for record in ev.batchnorm:
        for layer, dev in record.items():
            bn.setdefault(layer, dev)
    own = [n for n in set_per_rank(training, arm) if (n.rpartition(".")[0] or n) not in bn]
    # the BatchNorm layers whose ranks' statistics are off the global batch's; every BatchNorm only when
    # nothing else computes from the rank's slice (one at a large per-rank batch beside a user's own
    # statistic is not the cause)
    bn_off = [n for n, (s, c) in bn.items() if s > BN_MEAN_SHIFT or c > BN_STD_CHANGE] or ([] if own else list(bn))
    world = _world(training, arm)
    parts, remedies, named = [], [], []
    if bn_off:
        parts.append("BatchNorm layers " + ", ".join(f"'{n}'" for n in bn_off[:4])
                     + f" normalise each of the {world} ranks' slice with its own batch statistics, not the global "
                     "batch's (no SyncBatchNorm)")
        remedies.append(BN_REMEDY)
        named += bn_off
    if own:
        mods = list(dict.fromkeys(n.rpartition(".")[0] or n for n in own))
        parts.append(", ".join(f"'{m}'" for m in mods[:4]) + " set" + ("s" if len(mods) == 1 else "")
                     + " " + ", ".join(f"'{n}'" for n in own[:4]) + f" from each of the {world} ranks' own slice in its "
                     "forward and use" + ("s" if len(mods) == 1 else "") + " it there")
        remedies.append(_statistic_remedy(own))
        named += mods
    if not parts:
        parts.append("no BatchNorm or buffer explains it: some module's output depends on other samples of the "
                     "batch (a statistic over dim 0), which each rank computes over its slice only")
        remedies.append("find the module whose output depends on the other samples of the batch and compute that "
                        "statistic over all ranks (torch.distributed.all_reduce), as SyncBatchNorm does")
    evidence = [f"step 0, before any update: the averaged gradient of '{param}' on {arm} (after the all-reduce) "
                f"is {err:.3g} from the float64 judge's, {err / bound:.3g}x its bound {bound:.3g} (10x one "
                f"device's error at this precision: a correct data-parallel step differs only in its sums' order)"]
    evidence += [f"BatchNorm '{n}' at step 0: a rank's channel mean is up to {bn[n][0]:.3g} global std away from "
                 f"the global batch's, its std off by up to {bn[n][1]:.1%}" for n in bn_off[:4]]
    drift = drift_line(training, arm)
    if drift:
        evidence.append(drift)
    return DDPFinding(
        kind="gradient_apart", arm=arm, layers=tuple(named),
        summary=(f"the averaged gradient on {arm} differs from one device's at step 0 ({err:.3g} against a bound "
                 f"of {bound:.3g}): {'; '.join(parts)}, so {arm} trains another model than "
                 f"one device"),
        evidence=tuple(evidence), remedy="; ".join(remedies),
        covers=("batchnorm_per_rank",) if bn_off else (),
        # a per-rank BatchNorm alone, with the gradient within BN_GRAD_TOLERATED or each rank normalising at least
        # BN_RANK_BATCH_OK samples: the approximation DDP users accept (the standard recipe); the verdict only when
        # it changes the outcome (as the BatchNorm finding)
        approximate=bool(bn_off) and not own and (largest <= BN_GRAD_TOLERATED
                                                  or (ev.rank_batch or 0) >= BN_RANK_BATCH_OK))


DETECTORS = (loss_scale, same_data, buffers_not_broadcast, dropout_per_rank, batchnorm_per_rank)
# findings that explain a step-0 gradient apart from one device's by themselves
_EXPLAIN_GRADIENT = ("loss_scale", "dropout_per_rank")


def arm_findings(training, arm: str, parity=None) -> list[DDPFinding]:
    """The findings for one data-parallel arm, in priority order (loss scale first: it is exact); the step-0
    gradient finding (``gradient_apart``, from ``parity``'s rows) after the exact ones, unless one of them
    already explains that gradient (a loss scale, unshared random draws)."""
    found = [f for det in DETECTORS if (f := det(training, arm)) is not None]
    if parity is not None and not any(f.kind in _EXPLAIN_GRADIENT for f in found):
        grad = gradient_apart(training, arm, parity)
        if grad is not None:
            at = next((i for i, f in enumerate(found) if f.kind == "batchnorm_per_rank"), len(found))
            found.insert(at, grad)
            found = [f for f in found if f.kind not in grad.covers]  # its lines are the gradient finding's
    return found


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
    if not math.isfinite(dist):
        return f"parameter distance between {arm} and {other} ends non-finite (a run's weights hold NaN/Inf)"
    if math.isfinite(spread) and spread > 0:
        envelope = training.envelope.null_model if getattr(training, "envelope", None) else "one-ulp envelope"
        return f"parameter distance between {arm} and {other} ends at {dist:.3g}, {dist / spread:.3g}x the spread " \
               f"of the {envelope}"
    return f"parameter distance between {arm} and {other} ends at {dist:.3g}"


def _world(training, arm: str) -> int:
    found = next((a for a in training.arms if a.name == arm), None)
    return int(getattr(found.target, "world", None) or 1) if found is not None else 1

