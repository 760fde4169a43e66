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

from convcheck.diagnose.remedies import UNSCALE_BEFORE_CLIP, SCALER_REMEDIES, TRAIN_MODE_REMEDIES, CLIP_REMEDIES, DIVERGE_REMEDIES, INIT_REMEDIES, LR_REMEDIES, OPTIMIZER_REMEDIES
from convcheck.diagnose.detectors.watched_causal import weight_norms
from convcheck.diagnose.watched_checks import pair_check
from convcheck.diagnose.watched_evidence import Setup
from convcheck.numerics.formats import unit_roundoff_of
from convcheck.numerics.thresholds import (CLIP_PINNED_MIN, CLIP_PINNED_RTOL, EXPLODE_FACTOR, LR_RTOL,
                                          PART_FACTOR, RISE_FACTOR, RISE_MIN_STEPS, WEIGHT_BLOWUP)


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
            if same_setting(va, vb):
                continue
            group = f" (parameter group {g})" if len(sa) > 1 else ""
            name = _optimizer(a) or "optimizer"
            return Setup(f"different {name} settings: A's {key} is {va!r}, B's is {vb!r}{group}", "optimizer",
                         evidence=[f"the manifests' optimizer_settings[{g}].{key}: {va!r} | {vb!r}"],
                         remedies=list(OPTIMIZER_REMEDIES), step=0)
    return None


def same_setting(va, vb) -> bool:
    """Settings compared as learning rates are (``_same``: one given as a float32 tensor is the same)."""
    if isinstance(va, float) and isinstance(vb, float):
        return _same(va, vb)
    if isinstance(va, list) and isinstance(vb, list):
        return len(va) == len(vb) and all(same_setting(x, y) for x, y in zip(va, vb))
    return va == vb


def _same(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= LR_RTOL * max(abs(x), abs(y))


def lrs_text(lr: list) -> str:
    return repr(float(lr[0])) if len(lr) == 1 else "[" + ", ".join(repr(float(v)) for v in lr) + "]"


def lr_difference(a, b, steps: int) -> Setup | None:
    """The first aligned step whose recorded learning rates differ (per parameter group)."""
    for k in range(steps):
        la, lb = a.steps[k]["lr"], b.steps[k]["lr"]
        if len(la) == len(lb) and all(_same(x, y) for x, y in zip(la, lb)):
            continue
        if len(la) != len(lb):
            what = (f"A's optimizer has {len(la)} parameter groups, B's {len(lb)} (learning rates {lrs_text(la)} | "
                    f"{lrs_text(lb)}) from step {k}")
        else:
            g = next(i for i, (x, y) in enumerate(zip(la, lb)) if not _same(x, y))
            group = f" (parameter group {g})" if len(la) > 1 else ""
            what = f"B's learning rate{group} is {float(lb[g])!r} where A's is {float(la[g])!r} from step {k}"
        if k > 0:
            what += f" (the same before: {lrs_text(a.steps[k - 1]['lr'])})"
        return Setup(f"different learning rates: {what}", "learning rate",
                     evidence=[f"steps.jsonl lr at step {k}: {lrs_text(la)} | {lrs_text(lb)}"], remedies=list(LR_REMEDIES),
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
    if len(losses) >= RISE_MIN_STEPS and all(v >= first for _, v in losses[1:]) and last >= RISE_FACTOR * first \
            and _blows_up(run, kn):
        return Setup(f"the loss never falls below its first value {first:.4g} (step {k0}) and ends at {last:.4g} "
                     f"(step {kn}), {last / first:.3g}x it", "divergence", evidence=[curve],
                     remedies=list(DIVERGE_REMEDIES), step=kn)
    return None


def _blows_up(run, k: int) -> bool:
    """Whether the parameters blow up by step ``k`` (issue 42), asked of a loss that rises (``RISE_FACTOR``) but not
    far (``EXPLODE_FACTOR``): a loss that rises by design (a GAN's generator, a contrastive term) is no divergence
    while the weights stay put. The weights' global norm at ``WEIGHT_BLOWUP`` x
    its first, or a global gradient norm that is not finite; a run recorded
    without the weights' norm is judged by its loss alone, as before."""
    w = weight_norms(run)
    if w[0] is None:
        return True
    seen = [v for v in w[:k + 1] if v is not None]
    if seen and max(seen) >= WEIGHT_BLOWUP * seen[0]:
        return True
    g = [global_norm(s.get("grad_norms") or {}) for s in run.steps[:k + 1]]
    return any(v == v and not math.isfinite(v) for v in g)


def global_norm(norms: dict) -> float:
    """One step's global gradient norm from its per-parameter norms (NaN when none was recorded)."""
    vals = [v for v in norms.values() if isinstance(v, (int, float))]
    return math.sqrt(sum(v * v for v in vals)) if vals else math.nan


def _global_norms(run, steps: int) -> list[float]:
    return [global_norm(s["grad_norms"]) for s in run.steps[:steps]]


def clipped_at(norms: list[float], tol: float = CLIP_PINNED_RTOL) -> tuple[float, list[int]] | None:
    """``(max_norm, the pinned steps)`` when a run's global gradient norm is pinned at one value - ``clip_grad_norm_``
    scales every larger gradient to it - within ``tol`` (relative) at ``CLIP_PINNED_MIN`` steps or more and never
    above it; else None. (The watch reads the gradients at the optimizer's step, after the loop's own clipping.)"""
    finite = [(k, v) for k, v in enumerate(norms) if math.isfinite(v) and v > 0]
    if not finite:
        return None
    top = max(v for _, v in finite)
    pinned = [k for k, v in finite if v >= top * (1 - 2 * tol)]
    return (top, pinned) if len(pinned) >= CLIP_PINNED_MIN else None


def _grad_tolerance(a, b) -> float:
    """How far two runs' clipped norms may scatter: ``CLIP_PINNED_RTOL``, or ``PART_FACTOR`` roundoffs of the
    coarser gradient dtype (a bfloat16 gradient's norm, clipped to 0.5, reads 0.5006 or 0.4999)."""
    dtypes = [p.get("dtype", "float32") for run in (a, b) for p in run.manifest["model"]["parameters"]]
    return max([CLIP_PINNED_RTOL] + [PART_FACTOR * unit_roundoff_of(d) for d in dtypes])


def clipping_difference(a, b, steps: int) -> Setup | None:
    """One run clips its gradients (its norm pinned at ``max_norm``) where the other's goes past that value,
    or the two clip at different norms."""
    na, nb = _global_norms(a, steps), _global_norms(b, steps)
    tol = _grad_tolerance(a, b)
    ca, cb = clipped_at(na, tol), clipped_at(nb, tol)
    if ca is None and cb is None:
        return None
    if ca is not None and cb is not None:
        if abs(ca[0] - cb[0]) <= 2 * tol * max(ca[0], cb[0]) or _one_ratio(na, nb, tol):
            return None  # the same clipping, or norms one factor apart at every step (a loss scale, not a clip)
        head = f"different gradient clipping: A clips at norm {ca[0]:.4g}, B at {cb[0]:.4g}"
        step = min(ca[1][0], cb[1][0])
    else:
        side, (c, pinned), other, theirs = ("A", ca, "B", nb) if ca is not None else ("B", cb, "A", na)
        # the other run's gradient passes that norm at the steps this one was pinned: clipping changed them there
        past = [(j, theirs[j]) for j in pinned if j < len(theirs) and math.isfinite(theirs[j])
                and theirs[j] > c * (1 + 2 * tol)]
        if len(past) < CLIP_PINNED_MIN or _one_ratio(na, nb, tol):
            return None
        k = pinned[0]
        j, v = past[0]
        head = (f"{side} clips its gradients at norm {c:.4g} and {other} does not: {side}'s gradient norm is pinned "
                f"at {c:.4g} from step {k}, {other}'s reaches {v:.4g} at step {j}")
        step = k
    lo = max(0, step - 1)
    return Setup(head, "gradient clipping", [f"global gradient norms at the optimizer's step from step {lo}: "
                                             f"A {_norms_text(na, lo)}; B {_norms_text(nb, lo)}"],
                 list(CLIP_REMEDIES), step=step)


def _one_ratio(na: list[float], nb: list[float], tol: float) -> bool:
    """Whether B's norm is one factor times A's at every step both recorded (a loss scale; no clipping pins that)."""
    ratios = [y / x for x, y in zip(na, nb) if math.isfinite(x) and math.isfinite(y) and x > 0 and y > 0]
    if len(ratios) < CLIP_PINNED_MIN:
        return False
    mid = sorted(ratios)[len(ratios) // 2]
    return all(abs(r / mid - 1) <= 2 * tol for r in ratios)


def _norms_text(norms: list[float], lo: int) -> str:
    return ", ".join(f"{v:.4g}" for v in norms[lo:lo + 6]) + (" ..." if len(norms) > lo + 6 else "")


def eval_from(run, steps: int | None = None) -> int | None:
    """The first step the run trained with the model in eval mode (``model_eval``: the optimizer stepped on
    forwards run with ``model.training`` False), or None."""
    return next((k for k, s in enumerate(run.steps[:steps]) if s.get("model_eval")), None)


def eval_mode_difference(a, b, steps: int) -> Setup | None:
    """One run trains in eval mode from some step and the other does not (or from another step)."""
    ka, kb = eval_from(a, steps), eval_from(b, steps)
    if ka == kb:
        return None
    side, k = ("A", ka) if kb is None or (ka is not None and ka < kb) else ("B", kb)
    other = "B" if side == "A" else "A"
    return Setup(f"{side} trains with the model in eval mode from step {k} and {other} does not: BatchNorm uses its "
                 "running statistics and Dropout is off there (model.train() not called after an evaluation?)",
                 "eval mode", [f"steps.jsonl model_eval from step {k} in {side}: its forwards ran with model.training "
                               "False before the optimizer's step (those steps' layers and batches are not recorded)"],
                 list(TRAIN_MODE_REMEDIES), step=k)


def skipped_steps(run, steps: int) -> list[int]:
    """The aligned steps a run's GradScaler skipped (Inf gradients found; the scale lowered, no update)."""
    return [k for k, s in enumerate(run.steps[:steps]) if s.get("skipped")]


def scaler_difference(a, b, steps: int) -> Setup | None:
    """Both runs step through a GradScaler and one skipped a step the other took: their scalers were set up
    differently (init_scale, growth) - the runs part there by design, not by their numerics."""
    if not (a.manifest.get("scaler") and b.manifest.get("scaler")):
        return None
    sa, sb = set(skipped_steps(a, steps)), set(skipped_steps(b, steps))
    if sa == sb:
        return None
    k = min(sa ^ sb)
    side, other = ("A", "B") if k in sa else ("B", "A")
    scale = lambda run: run.steps[k].get("scale")  # noqa: E731
    return Setup(f"{side}'s GradScaler skipped step {k} and {other}'s stepped: their loss scales differ (scale after "
                 f"step {k}: A {scale(a):.3g}, B {scale(b):.3g})", "loss scale",
                 [f"skipped steps: A {sorted(sa)[:8]}, B {sorted(sb)[:8]}"], list(SCALER_REMEDIES), step=k)


def _compiled(run) -> dict:
    return run.manifest.get("compiled") or {}


def compiled_random(a, b, random_layers: tuple) -> str | None:
    """One run's model compiled (``torch.compile``) and the other's not, with random layers (Dropout) that
    inductor draws from its own generator unless ``fallback_random`` was set: the runs' masks differ from
    the first step, whatever the seeds. The finding's text, or None."""
    how = [_compiled(r).get("how") for r in (a, b)]
    if not random_layers or (how[0] is None) == (how[1] is None):
        return None
    side = "A" if how[0] is not None else "B"
    if _compiled((a, b)["AB".index(side)]).get("fallback_random"):
        return None
    names = ", ".join(random_layers[:3]) + (" ..." if len(random_layers) > 3 else "")
    other = "B" if side == "A" else "A"
    return (f"{side} runs its model compiled ({how['AB'.index(side)]}), {other} eager, and the model has random "
            f"layers ({names}): inductor draws their masks from its own generator, not eager's "
            "(torch._inductor.config.fallback_random was not set)")


def clip_before_unscale(run, side: str) -> Setup | None:
    """The run clipped its gradients while its GradScaler still held them scaled (``watch/scaler_use.py``: a
    ``clip_grad_norm_`` with the scaler enabled and no ``scaler.unscale_(optimizer)`` before it that step)."""
    marked = [k for k, s in enumerate(run.steps) if s.get("clip_before_unscale")]
    if not marked:
        return None
    k = marked[0]
    scale = run.steps[k].get("scale")
    norms = _global_norms(run, len(run.steps))
    said = [f"steps.jsonl clip_before_unscale at {len(marked)} of {len(run.steps)} steps, from step {k}"]
    if isinstance(scale, (int, float)) and math.isfinite(norms[k]):
        said.append(f"at step {k} the scale is {scale:g}: the gradients reaching the optimizer have norm "
                    f"{norms[k]:.4g}, a clip's max_norm divided by up to {scale:g}")
    who = "the run" if side == "-" else side
    return Setup(f"{who} clips its gradients before unscaling them: clip_grad_norm_ ran on the GradScaler's scaled "
                 f"gradients from step {k} (scaler.unscale_(optimizer) was not called before it)",
                 "clip before unscale_", said, list(UNSCALE_BEFORE_CLIP), step=k)


# --- the pair's setup checks, in the order a step uses what they read (``watched_checks``) ----------------

@pair_check("optimizer", order=10)
def _optimizer_check(a, b, steps: int) -> Setup | None:
    return optimizer_difference(a, b)


@pair_check("clip-before-unscale", order=50)
def _clip_before_unscale_check(a, b, steps: int) -> list:
    return [clip_before_unscale(a, "A"), clip_before_unscale(b, "B")]


pair_check("clipping", order=60)(clipping_difference)
pair_check("eval-mode", order=70)(eval_mode_difference)
pair_check("scaler", order=80)(scaler_difference)


@pair_check("initial-weights", order=90)
def _initial_weights_check(a, b, steps: int) -> Setup | None:
    return initial_weights_difference(a, b)
