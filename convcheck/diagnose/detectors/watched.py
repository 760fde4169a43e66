"""compare's detectors on watched runs, and the differences only a pair of runs shows.

A watched run is read through three members (``watch.reader.WatchedRun`` has them; a test may hand a
stand-in): ``steps`` (one dict per optimizer step: ``loss``, ``lr`` per group, ``grad_norms`` per
parameter, ``layers``), ``manifest`` (``model.parameters`` with their dtypes, ``optimizer``,
``optimizer_settings``, ``snapshots``) and ``snapshot(step)`` (the arrays of a snapshot step: ``param/``,
``grad/``...). Every detector returns ``training.Symptom`` records (kind, side as the ``arm``, layer,
step, value) - the same data ``compare``'s detectors return - and never decides a verdict.

- ``run_findings(run, side)``: one run on its own - compare's ``training_problems`` (a NaN-like loss,
  exploding or vanishing gradients, an oscillating loss) on the run's curves, and ``lost_updates`` for
  weights kept in bfloat16/float16 (the update ratio from the learning rate, the gradient norms and the
  step-0 weights).
- ``recipe_difference(a, b, tol)``: two runs that already differ at step 0, before any update, with the
  same weights and batch (the caller checks both): the loss is computed differently (its value ratio), and
  a gradient-norm ratio that is one constant for every parameter is a loss scale.
- ``gradient_underflow(a, b)``: a parameter whose gradient is exactly zero in one run where the other's is
  not (its norm, at every step; the zero share of its entries, at the snapshot steps).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from convcheck.diagnose.detectors import recipe as R
from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.detectors.watched_setup import divergence, global_norm
from convcheck.diagnose.watched_evidence import LOSS as LOSS_PRODUCER
from convcheck.numerics.formats import coarsest_dtype, format_named, unit_roundoff_of
from convcheck.numerics.thresholds import (CONVERGED_LOSS_RATIO, CONVERGED_TAIL, CONVERGENCE_MIN_STEPS,
                                          EXPLODING_LAYER_RATIO, PART_FACTOR, SCALE_RATIO_SPREAD, TINY_NORM,
                                          UNDERFLOW_EXTRA_ZEROS)

RECIPE = "recipe difference"  # the loss computed differently (pair symptom)
LOSS_SCALE = "loss scale"  # the same loss, gradients multiplied by one factor (pair symptom)
SGD_LIKE = ("SGD",)  # an update of lr x the (momentum-averaged) gradient
ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")  # an update of about lr per entry


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _weights_at_step0(run) -> dict[str, np.ndarray] | None:
    if not any(s["step"] == 0 for s in run.manifest.get("snapshots", [])):
        return None
    snap = run.snapshot(0) or {}
    params = {k[len("param/"):]: v for k, v in snap.items() if k.startswith("param/")}
    return params or None


def _update_ratio(run, k: int, weight_norm: float, numel: int) -> float:
    """An estimate of one step's |dW| / |W| from what a watched step records: SGD's lr x |g| (divided by
    1 - momentum, its steady state), Adam's about lr per entry; NaN for another optimizer."""
    lr = [v for v in run.steps[k]["lr"] if _finite(v)]
    if not lr or not weight_norm > 0:
        return math.nan
    opt = run.manifest.get("optimizer")
    settings = (run.manifest.get("optimizer_settings") or [{}])[0] or {}
    if opt in SGD_LIKE:
        momentum = settings.get("momentum", 0.0)
        momentum = momentum if _finite(momentum) and 0 <= momentum < 1 else 0.0
        return max(lr) * global_norm(run.steps[k]["grad_norms"]) / (1 - momentum) / weight_norm
    if opt in ADAM_LIKE:
        return max(lr) * math.sqrt(numel) / weight_norm
    return math.nan


def curves(run, side: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """compare's ``curves`` and per-layer gradient rows (``layer_grads``) for one watched run: each step's
    loss, learning rate, global gradient norm and update ratio; each module's gradient norm (its
    parameters' norms combined), in the model's order."""
    weights = _weights_at_step0(run)
    wnorm = math.sqrt(sum(float(np.sum(np.square(w.astype(np.float64)))) for w in weights.values())) \
        if weights else math.nan
    numel = sum(int(w.size) for w in weights.values()) if weights else 0
    rows, grads = [], []
    for k, s in enumerate(run.steps):
        loss = s["loss"] if _finite(s["loss"]) else math.nan
        lr = [v for v in s["lr"] if _finite(v)]
        rows.append({"arm": side, "step": k, "loss": loss, "grad_norm": global_norm(s["grad_norms"]),
                     "update_ratio": _update_ratio(run, k, wnorm, numel), "lr": max(lr) if lr else math.nan,
                     "loss_scale": s.get("scale", math.nan), "skipped": bool(s.get("skipped", False))})
        by_layer: dict[str, float] = {}
        for name, v in s["grad_norms"].items():
            layer = name.rsplit(".", 1)[0] if "." in name else name
            if isinstance(v, (int, float)):
                by_layer[layer] = by_layer.get(layer, 0.0) + v * v
        grads += [{"arm": side, "layer": layer, "step": k, "grad_norm": math.sqrt(sq), "zero_frac": math.nan}
                  for layer, sq in by_layer.items()]
    cols = ["arm", "layer", "step", "grad_norm", "zero_frac"]
    return pd.DataFrame(rows), pd.DataFrame(grads, columns=cols)


_ACTIVATION_COLUMNS = ["arm", "layer", "step", "kind", "dead_frac", "saturated_frac"]
RELU_LIKE = ("ReLU", "ReLU6")  # a module whose zero outputs are dead units (DeepDiagnosis' rule)


def activations(run, side: str) -> pd.DataFrame:
    """compare's activation rows for one run: each ReLU module's share of zero outputs per step (its
    ``dead_frac``; the manifest's ``layer_types`` name the modules - a run recorded before them has none)."""
    types = run.manifest.get("model", {}).get("layer_types") or {}
    relus = {name for name, t in types.items() if t in RELU_LIKE}
    rows = [{"arm": side, "layer": name, "step": k, "kind": "relu", "dead_frac": float(r["zeros"]),
             "saturated_frac": math.nan}  # a step's ``zeros`` is the share of its outputs that are exactly 0
            for k, s in enumerate(run.steps) for name, r in s["layers"].items()
            if name in relus and _finite(r.get("zeros"))]
    return pd.DataFrame(rows, columns=_ACTIVATION_COLUMNS)


DECOUPLED = ("AdamW",)  # lr x weight_decay is what the weights lose a step: SGD's coupled decay, AdamW's


def weight_decay(run) -> dict | None:
    """The strongest group's decay per step, as ``stages.measure_weight_decay`` reads it for compare:
    ``{optimizer, lr (the group's peak as the run stepped it), weight_decay, momentum}``; None for an optimizer
    whose decay is not lr x wd a step (an adaptive optimizer's coupled L2), or none recorded."""
    opt = run.manifest.get("optimizer")
    groups = run.manifest.get("optimizer_settings") or []
    if not run.steps or not groups:
        return None
    best = None
    for g, settings in enumerate(groups):
        decoupled = opt in DECOUPLED or settings.get("decoupled_weight_decay") is True
        wd = settings.get("weight_decay")
        if not (opt in SGD_LIKE or decoupled) or not _finite(wd) or wd <= 0:
            continue
        lrs = [s["lr"][g] for s in run.steps if g < len(s["lr"]) and _finite(s["lr"][g])]
        if lrs and (best is None or max(lrs) * wd > best["lr"] * best["weight_decay"]):
            momentum = settings.get("momentum")
            best = {"optimizer": opt, "lr": max(lrs), "weight_decay": wd,
                    "momentum": momentum if _finite(momentum) else 0.0}
    return best


RANDOM_LAYERS = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout")


def random_layers(run) -> tuple[str, ...]:
    """The run's layers that draw random numbers (Dropout and its kin, by ``layer_types``; older runs: none)."""
    types = run.manifest.get("model", {}).get("layer_types") or {}
    return tuple(name for name, t in types.items() if t in RANDOM_LAYERS)


def weights_format(run) -> str | None:
    """The coarsest dtype the model's parameters are kept in, when it is a 16-bit one (else None)."""
    dtypes = {p.get("dtype") for p in run.manifest.get("model", {}).get("parameters", [])}
    coarse = coarsest_dtype(d for d in dtypes if isinstance(d, str))
    return coarse if coarse in ("bfloat16", "float16") else None


def compute_format(run) -> str | None:
    """The coarsest dtype the run's layers output at its first step (what it computes in)."""
    if not run.steps:
        return None
    return coarsest_dtype(r["dtype"] for r in run.steps[0]["layers"].values() if isinstance(r.get("dtype"), str))


def run_findings(run, side: str) -> list[S.Symptom]:
    """What ``compare``'s detectors find on this run alone (its ``side``: "A", "B", or "the run")."""
    if not run.steps:
        return []
    c, g = curves(run, side)
    # the steps a GradScaler skipped (Inf gradients found, the scale lowered) are its design, a step whose optimizer
    # found no gradient at all has no gradient norm to read (not a non-finite one), and a step whose loss was never
    # handed to the watch (no ``w.step(loss)``: null, where a NaN loss is NaN) has no loss to read: not read here
    kept = ~c["skipped"].astype(bool) & c["step"].map(
        lambda k: bool(run.steps[k].get("grad_norms")) and run.steps[k].get("loss") is not None)
    c, g = c[kept].reset_index(drop=True), g[g["step"].isin(set(c.loc[kept, "step"]))]
    if c.empty:
        return []
    lr = float(c["lr"].max()) if c["lr"].notna().any() else math.nan
    norms = [v for v in c["grad_norm"] if math.isfinite(v)]
    grew = len(norms) >= 2 and max(norms) > EXPLODING_LAYER_RATIO * max(norms[0], TINY_NORM)
    # a per-batch loss that ends 1.5x its first is no finding alone here (the run's own divergence rule,
    # EXPLODE_FACTOR / RISE_FACTOR, reads the loss): gradients count when they grew or turned non-finite
    diverged = divergence(run) is not None
    # compare's NaN-like rule (a finite loss >= 1e3) is absolute: a regression's loss of 1644 falling to 1635 is
    # healthy; a watched run's finite explosion is its own divergence rule's (EXPLODE_FACTOR, RISE_FACTOR)
    found = [s for s in S.training_problems(c, g, activations(run, side), side, 0, lr)
             if (s.name != S.EXPLODING_GRADIENTS or s.step is not None or grew)
             and (s.label != S.EXPLODING_LOSS or diverged)]
    decay = R.decay_too_strong(weight_decay(run), side)
    found += [decay] if decay is not None else []
    fmt = weights_format(run)
    if fmt is not None:
        lost = S.lost_updates(c, side, unit_roundoff_of(fmt), True)
        if lost is not None:
            found.append(S.Symptom(lost.name, side, f"{lost.evidence} ({fmt} weights, "
                                   f"{run.manifest.get('optimizer') or 'optimizer'})", value=lost.value,
                                   extra={"format": fmt}))
    return found


def _ratio_text(r: float) -> str:
    return f"{r:.4g}x"


def _world_size(run) -> int | None:
    d = run.manifest.get("distributed")
    w = d.get("world_size") if isinstance(d, dict) else None
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 1 else None


def _world_factor(a, b, scale: float, spread: float) -> str:
    """``: the world size of B's DDP run (2) ...`` when one factor between the runs' gradients is a run's world
    size: a loss multiplied (or divided) by the world size, which DDP's gradient averaging already accounts for."""
    for run, factor, how in ((b, scale, "multiplied by"), (a, 1 / scale, "multiplied by")):
        w = _world_size(run)
        if w is not None and abs(factor / w - 1) <= spread:
            side = "B" if run is b else "A"
            return (f": the world size of {side}'s data-parallel run ({w}) - its loss {how} the world size, which "
                    "DistributedDataParallel's gradient averaging already divides out")
    return ""


def recipe_difference(a, b, tol: float) -> S.Symptom | None:
    """Step 0 of two runs with the same weights and batch (the caller's check): the losses differ beyond
    ``tol`` (relative), or every parameter's gradient norm differs by one common factor (a loss scale).
    Returns a ``RECIPE`` or ``LOSS_SCALE`` symptom on side "B" (B against A)."""
    if not a.steps or not b.steps:
        return None
    la, lb = a.steps[0]["loss"], b.steps[0]["loss"]
    loss_apart = (_finite(la) and _finite(lb) and la != lb and abs(la - lb) > tol * max(abs(la), abs(lb)))
    ga, gb = a.steps[0]["grad_norms"], b.steps[0]["grad_norms"]
    names = [n for n in ga if n in gb and _finite(ga[n]) and _finite(gb[n]) and ga[n] > 0 and gb[n] > 0]
    scale, spread = None, SCALE_RATIO_SPREAD
    if names:
        ratios = sorted(gb[n] / ga[n] for n in names)
        median = ratios[len(ratios) // 2]
        dtypes = {p["name"]: p.get("dtype", "float32") for p in a.manifest["model"]["parameters"]}
        computed = [f for f in (compute_format(a), compute_format(b)) if f is not None]
        u = max([unit_roundoff_of(dtypes.get(n, "float32")) for n in names] + [unit_roundoff_of(f) for f in computed])
        spread = max(SCALE_RATIO_SPREAD, PART_FACTOR * u)
        if abs(median - 1) > spread and all(abs(r / median - 1) <= spread for r in ratios):
            scale = median
    if not loss_apart and scale is None:
        return None
    # one factor on every gradient (and a loss apart, when the loss itself is that small) of a run whose backward
    # is in its 16-bit format's subnormal range is that range's spacing, not a loss computed or scaled otherwise
    found = next((u for u in (subnormal_gradients(b, names, "B", lb if loss_apart else None),
                              subnormal_gradients(a, names, "A", la if loss_apart else None)) if u), None)
    if found is not None:
        return found
    lines = []
    if loss_apart:
        lines.append(f"step-0 loss: A {la:.6g}, B {lb:.6g} (B/A = {_ratio_text(lb / la) if la else 'inf'}), "
                     f"beyond rounding ({tol:.3g} relative)")
    if scale is not None:
        lines.append(f"step-0 gradient norms: B's are {_ratio_text(scale)} A's for all {len(names)} parameters "
                     f"(within {spread:.3g}): one factor multiplies the whole "
                     "backward" + _world_factor(a, b, scale, spread))
    elif names:
        worst = max(names, key=lambda n: abs(math.log(gb[n] / ga[n])))
        lines.append(f"step-0 gradient norms differ parameter by parameter (largest: {worst}, B/A = "
                     f"{_ratio_text(gb[worst] / ga[worst])}): not one scale")
    kind = LOSS_SCALE if scale is not None and (not loss_apart or (la != 0 and abs(lb / la / scale - 1) <= spread)) \
        else RECIPE
    value = scale if kind == LOSS_SCALE else (lb / la if la else math.inf)
    return S.Symptom(kind, "B", "; ".join(lines), step=0, value=value,
                     extra={"loss_ratio": lb / la if loss_apart and la else None, "grad_ratio": scale})


def subnormal_gradients(run, names: list[str], side: str, loss: float | None = None) -> S.Symptom | None:
    """A gradient underflow seen at step 0 as one factor on every gradient: the run computes in float16 or
    bfloat16 (its layers' outputs or its weights) and even its largest parameter gradient, as a root-mean-square
    entry, lies below that format's smallest normal number - the gradients keep a few bits of the subnormal range
    (a down-weighted loss, a loss averaged over many elements, no GradScaler). ``loss``: the run's step-0 loss when
    it differs from the other run's - then the loss itself must lie in the loss's format's subnormal range too."""
    shapes = {p["name"]: p.get("shape") for p in run.manifest["model"]["parameters"]}
    dtypes = {p.get("dtype") for p in run.manifest["model"]["parameters"]} | {compute_format(run)}
    fmt = coarsest_dtype(d for d in dtypes if isinstance(d, str))
    if fmt not in ("float16", "bfloat16"):
        return None
    norms = run.steps[0]["grad_norms"]
    rms = {n: norms[n] / math.sqrt(math.prod(shapes[n]) or 1) for n in names if shapes.get(n) is not None}
    tiny = format_named(fmt).smallest_normal
    if not rms or max(rms.values()) >= tiny:
        return None
    if loss is not None:
        loss_fmt = coarsest_dtype(d for d in (run.steps[0].get("loss_dtype"), fmt) if isinstance(d, str))
        if not (_finite(loss) and abs(loss) < format_named(loss_fmt).smallest_normal):
            return None
    top = max(rms, key=rms.get)
    return S.Symptom(S.GRADIENT_UNDERFLOW, side, f"{side}'s step-0 gradients lie in {fmt}'s subnormal range: the "
                     f"largest root-mean-square entry ({top}) is {rms[top]:.3g}, below {fmt}'s smallest normal "
                     f"{tiny:.3g}, so every gradient keeps only a few bits", layer=top, step=0, value=rms[top] / tiny,
                     extra={"compute": fmt, "subnormal": True})


def _zero_share(x: np.ndarray) -> float:
    return float(np.count_nonzero(x == 0)) / x.size if x.size else 0.0


def gradient_underflow(a, b) -> S.Symptom | None:
    """The first aligned step at which a parameter's gradient is exactly zero in one run and not in the
    other: its whole norm 0 (every step's record), or UNDERFLOW_EXTRA_ZEROS more of its entries exactly zero
    (the snapshot steps both runs took)."""
    steps = min(len(a.steps), len(b.steps))
    snapped = ({s["step"] for s in a.manifest.get("snapshots", [])}
               & {s["step"] for s in b.manifest.get("snapshots", [])})
    for k in range(steps):
        ga, gb = a.steps[k]["grad_norms"], b.steps[k]["grad_norms"]
        for n in ga:
            x, y = ga[n], gb.get(n)
            if not (_finite(x) and _finite(y)):
                continue
            if (x == 0) != (y == 0):
                side, other, v = ("B", "A", x) if y == 0 else ("A", "B", y)
                return S.Symptom(S.GRADIENT_UNDERFLOW, side, f"the gradient of {n} is exactly 0 in {side} at step "
                                 f"{k} where {other}'s norm is {v:.3g}", layer=n, step=k, value=1.0,
                                 extra={"other_norm": v, "compute": compute_format((a, b)["AB".index(side)])})
        if k in snapped:
            found = _snapshot_zeros(a, b, k)
            if found is not None:
                return found
    return None


def _snapshot_zeros(a, b, k: int) -> S.Symptom | None:
    sa, sb = a.snapshot(k) or {}, b.snapshot(k) or {}
    for key in sa:
        if not key.startswith("grad/") or key not in sb or sa[key].shape != sb[key].shape:
            continue
        za, zb = _zero_share(sa[key]), _zero_share(sb[key])
        if abs(zb - za) > UNDERFLOW_EXTRA_ZEROS:
            side, other = ("B", "A") if zb > za else ("A", "B")
            name = key[len("grad/"):]
            return S.Symptom(S.GRADIENT_UNDERFLOW, side, f"{max(za, zb):.0%} of the gradient entries of {name} are "
                             f"exactly 0 in {side} at step {k} against {min(za, zb):.0%} in {other}", layer=name,
                             step=k, value=abs(zb - za), extra={"compute": compute_format((a, b)["AB".index(side)])})
    return None


SCALED_BACKWARD = "loss scale overflow"  # a fixed loss scale that overflows the backward (one run's symptom)


PARAMETER_GRADIENT = "parameter gradient"  # a producer kind: a parameter's gradient, every output gradient finite


def first_nonfinite(run) -> dict | None:
    """The run's first NaN/Inf: the watch's producer, or - when earlier - a parameter whose recorded gradient
    norm is not finite while no module's input or output gradient was (an overflow inside a layer's weight or
    bias reduction: a fixed loss scale's backward in float16 makes it), as a producer record of kind
    ``PARAMETER_GRADIENT`` at that step."""
    p = run.manifest.get("first_nonfinite")
    p = p if isinstance(p, dict) else None
    for k, s in enumerate(run.steps):
        if p is not None and k >= p["step"]:
            break
        if s.get("skipped"):
            continue  # a GradScaler found Inf and skipped the step: its design, not a finding
        bad = [n for n, v in s["grad_norms"].items() if isinstance(v, (int, float)) and not math.isfinite(v)]
        if bad:
            name = bad[0]
            found = {"layer": name.rsplit(".", 1)[0] if "." in name else name, "step": k, "direction": "backward",
                     "kind": PARAMETER_GRADIENT, "parameter": name,
                     "detail": f"the gradient of {name} is {s['grad_norms'][name]} while every module's input and "
                               "output gradient is finite"}
            unchecked = _unchecked_calls(run, s)
            if unchecked:  # not every output gradient was read: the first non-finite one may be among them
                some = ", ".join(unchecked[:3]) + (f" and {len(unchecked) - 3} more" if len(unchecked) > 3 else "")
                found["detail"] = (f"the gradient of {name} is {s['grad_norms'][name]} while every module output "
                                   f"gradient checked is finite; the later calls of {some} were not checked one by "
                                   "one (repeated_grads=\"together\")")
                found["calls_unchecked"] = unchecked
            return found
    return p


def _unchecked_calls(run, step: dict) -> list[str]:
    """The layers whose repeated calls at ``step`` had their gradients checked together with the first call's
    (``repeated_grads="together"``): recorded at a step whose parameter gradients are not all finite."""
    got = step.get("grads_unchecked")
    return sorted(n for n in got if isinstance(n, str)) if isinstance(got, dict) else []


def scaled_backward(run, side: str) -> S.Symptom | None:
    """The first non-finite value is a gradient while the loss itself is finite, with no GradScaler recorded:
    the one the loss's own backward hands the model, or, in a float16 run, a parameter's gradient summed inside
    a layer (every output gradient finite). The backward ran on a scaled loss (``(loss * S).backward()``) whose
    gradients pass float16's range (a mean loss hands each output at most about 1/batch)."""
    p = first_nonfinite(run)
    if not isinstance(p, dict) or p.get("direction") != "backward" or run.manifest.get("scaler"):
        return None
    if compute_format(run) != "float16" or (p.get("layer") != LOSS_PRODUCER and p.get("kind") != PARAMETER_GRADIENT):
        return None  # float32 and bfloat16 hold any scaled gradient a finite loss makes: not a scale's overflow
    k = p.get("step")
    loss = run.steps[k]["loss"] if isinstance(k, int) and 0 <= k < len(run.steps) else None
    if not _finite(loss):
        return None
    what = (f"the gradient of {p['parameter']}" if p.get("kind") == PARAMETER_GRADIENT
            else str(p.get("detail") or "the gradient into the model's output"))
    return S.Symptom(SCALED_BACKWARD, side, f"{what} is Inf at step {k} while the loss itself is finite ({loss:.4g})",
                     layer=p["layer"], step=k, value=loss, extra={"what": what})


def precision_difference(a, b, flags) -> str | None:
    """Why two runs compute at different precisions (their layers' output dtypes at step 0, or TF32 switches
    among the math flags that differ, ``(name, A's, B's)``), or None."""
    da = {r["dtype"] for r in a.steps[0]["layers"].values()} if a.steps else set()
    db = {r["dtype"] for r in b.steps[0]["layers"].values()} if b.steps else set()
    if da != db:
        return f"A's layers output {', '.join(sorted(da))}, B's {', '.join(sorted(db))}"
    tf32 = [f"{k}: {x} | {y}" for k, x, y in flags if "tf32" in k.lower() or "precision" in k]
    return "the TF32 switches differ (" + "; ".join(tf32) + ")" if tf32 else None


def converges(run) -> bool | None:
    """compare's convergence rule on the run's own losses: every loss finite and the mean of the last
    ``CONVERGED_TAIL`` below ``CONVERGED_LOSS_RATIO`` x the first; None when fewer than
    ``CONVERGENCE_MIN_STEPS`` losses were recorded (not judged)."""
    losses = [s["loss"] for s in run.steps]
    if len(losses) < CONVERGENCE_MIN_STEPS or any(v is None for v in losses):
        return None
    if not all(_finite(v) for v in losses):
        return False
    tail = losses[-CONVERGED_TAIL:]
    return sum(tail) / len(tail) < CONVERGED_LOSS_RATIO * losses[0]
