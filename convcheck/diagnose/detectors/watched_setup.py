"""What the user set up differently, read from two watched runs before any numerics is blamed
(``setup`` verdicts): the optimizer's class and its other hyperparameters (the manifest's ``optimizer``
and ``optimizer_settings``), the learning rates each step
used (``steps.jsonl``'s ``lr``), the initial weights (the ``param/<name>`` arrays of both runs' step-0
snapshots, taken before any update); and, for one run, a loss that explodes.

A finding is a ``watched_evidence.Setup``: a headline naming the difference, its evidence and remedies (from
``diagnose/remedies.py``). Runs are read as ``detectors/watched.py`` reads them (``steps``, ``manifest``,
``snapshot(step)``)."""

from __future__ import annotations

import math

import numpy as np

from convcheck.diagnose.remedies import DIVERGE_REMEDIES, INIT_REMEDIES, LR_REMEDIES, OPTIMIZER_REMEDIES
from convcheck.diagnose.watched_evidence import Setup
from convcheck.numerics.formats import unit_roundoff_of
from convcheck.numerics.thresholds import EXPLODE_FACTOR, LR_RTOL, PART_FACTOR, RISE_FACTOR, RISE_MIN_STEPS


def _optimizer(run) -> str | None:
    o = run.manifest.get("optimizer")
    return o if isinstance(o, str) else None


def optimizer_difference(a, b) -> Setup | None:
    oa, ob = _optimizer(a), _optimizer(b)
    if oa == ob:
        return None
    name = lambda o: o if o is not None else "no optimizer"  # noqa: E731
    return Setup(f"different optimizers: A uses {name(oa)}, B uses {name(ob)}", "optimizer",
                 evidence=[f"the manifests' optimizer: {name(oa)} | {name(ob)}"], remedies=list(OPTIMIZER_REMEDIES),
                 step=0)


def settings_difference(a, b) -> Setup | None:
    """The same optimizer class built with other hyperparameters (momentum, weight decay, betas, eps, ...):
    the first setting that differs, group by group, as each block started (runs without the record: None)."""
    if _optimizer(a) != _optimizer(b):
        return None  # the class difference says it
    sa, sb = a.manifest.get("optimizer_settings"), b.manifest.get("optimizer_settings")
    if not sa or not sb or len(sa) != len(sb):
        return None  # parameter groups that differ in number show in the learning rates
    for g, (ga, gb) in enumerate(zip(sa, sb)):
        for key in sorted(set(ga) & set(gb)):
            va, vb = ga[key], gb[key]
            if _same_setting(va, vb):
                continue
            group = f" (parameter group {g})" if len(sa) > 1 else ""
            name = _optimizer(a) or "optimizer"
            return Setup(f"different {name} settings: A's {key} is {va!r}, B's is {vb!r}{group}", "optimizer",
                         evidence=[f"the manifests' optimizer_settings[{g}].{key}: {va!r} | {vb!r}"],
                         remedies=list(OPTIMIZER_REMEDIES), step=0)
    return None


def _same_setting(va, vb) -> bool:
    """Settings compared as learning rates are (``_same``: one given as a float32 tensor is the same)."""
    if isinstance(va, float) and isinstance(vb, float):
        return _same(va, vb)
    if isinstance(va, list) and isinstance(vb, list):
        return len(va) == len(vb) and all(_same_setting(x, y) for x, y in zip(va, vb))
    return va == vb


def _same(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= LR_RTOL * max(abs(x), abs(y))


def _lrs(lr: list) -> str:
    return repr(float(lr[0])) if len(lr) == 1 else "[" + ", ".join(repr(float(v)) for v in lr) + "]"


def lr_difference(a, b, steps: int) -> Setup | None:
    """The first aligned step whose recorded learning rates differ (per parameter group)."""
    for k in range(steps):
        la, lb = a.steps[k]["lr"], b.steps[k]["lr"]
        if len(la) == len(lb) and all(_same(x, y) for x, y in zip(la, lb)):
            continue
        if len(la) != len(lb):
            what = (f"A's optimizer has {len(la)} parameter groups, B's {len(lb)} (learning rates {_lrs(la)} | "
                    f"{_lrs(lb)}) from step {k}")
        else:
            g = next(i for i, (x, y) in enumerate(zip(la, lb)) if not _same(x, y))
            group = f" (parameter group {g})" if len(la) > 1 else ""
            what = f"B's learning rate{group} is {float(lb[g])!r} where A's is {float(la[g])!r} from step {k}"
        if k > 0:
            what += f" (the same before: {_lrs(a.steps[k - 1]['lr'])})"
        return Setup(f"different learning rates: {what}", "learning rate",
                     evidence=[f"steps.jsonl lr at step {k}: {_lrs(la)} | {_lrs(lb)}"], remedies=list(LR_REMEDIES),
                     step=k)
    return None


def _params_at_step0(run) -> tuple[dict, dict] | None:
    e = next((s for s in run.manifest["snapshots"] if s["step"] == 0), None)
    if e is None or not any(x["key"].startswith("param/") for x in e["arrays"]):
        return None
    dtypes = {x["key"]: x["dtype"] for x in e["arrays"]}
    return run.snapshot(0), dtypes


def initial_weights_difference(a, b) -> Setup | None:
    """The first parameter (in the model's order) whose step-0 values, before any update, differ between
    the runs beyond rounding of the coarser dtype (relative norm, as a snapshot parting)."""
    pa, pb = _params_at_step0(a), _params_at_step0(b)
    if pa is None or pb is None:
        return None
    (sa, da), (sb, db) = pa, pb
    for p in a.manifest["model"]["parameters"]:
        key = f"param/{p['name']}"
        if key not in sa or key not in sb or sa[key].shape != sb[key].shape:
            continue
        x, y = sa[key].astype(np.float64), sb[key].astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            continue
        norm = max(np.linalg.norm(x), np.linalg.norm(y))
        d = float(np.linalg.norm(x - y) / norm) if norm else 0.0
        u = max(unit_roundoff_of(da[key]), unit_roundoff_of(db[key]))
        if d > PART_FACTOR * u:
            return Setup(f"different initial weights: {p['name']} already differs at step 0, before any update",
                         "initial weights",
                         evidence=[f"step-0 snapshots: {p['name']} differs by {d:.3g} (relative, element by element), "
                                   f"{d / u:.3g}x the roundoff of {da[key]}; the model was not built from the same "
                                   "seed or state"],
                         remedies=list(INIT_REMEDIES), step=0)
    return None


def divergence(run) -> Setup | None:
    """One run whose loss explodes: a finite loss above ``EXPLODE_FACTOR`` times the first (positive) one,
    or a loss that never falls below the first and ends at ``RISE_FACTOR`` times it or more."""
    losses = [(s["step"], s["loss"]) for s in run.steps
              if isinstance(s["loss"], (int, float)) and math.isfinite(s["loss"])]
    if len(losses) < 2 or losses[0][1] <= 0:
        return None
    k0, first = losses[0]
    curve = "the loss: " + ", ".join(f"{v:.4g}" for _, v in losses[:8]) + (" ..." if len(losses) > 8 else "")
    high = next(((k, v) for k, v in losses[1:] if v > EXPLODE_FACTOR * first), None)
    if high is not None:
        k, v = high
        return Setup(f"the loss explodes: {v:.4g} at step {k}, {v / first:.3g}x its first value {first:.4g} "
                     f"(step {k0})", "divergence", evidence=[curve], remedies=list(DIVERGE_REMEDIES), step=k)
    (kn, last) = losses[-1]
    if len(losses) >= RISE_MIN_STEPS and all(v >= first for _, v in losses[1:]) and last >= RISE_FACTOR * first:
        return Setup(f"the loss never falls below its first value {first:.4g} (step {k0}) and ends at {last:.4g} "
                     f"(step {kn}), {last / first:.3g}x it", "divergence", evidence=[curve],
                     remedies=list(DIVERGE_REMEDIES), step=kn)
    return None
