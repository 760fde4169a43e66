"""Two watched runs walked in the order a step runs (issue 42): outside data -> forward -> loss -> gradients ->
update. The first stage where the runs differ is the cause; what follows is consequence. This module holds the
stages no other detector reads:

- ``accumulation``: gradients that *add up* across steps in one run (``optimizer.zero_grad()`` missing): from a
  few fixed entries of every gradient (``steps.jsonl``'s ``grad_sample``), B's gradient at step k less B's at
  k-1 is A's at k, while B's at k is not;
- ``backward_difference``: the gradients differ, far beyond rounding, at a step whose forward and loss agree
  (a gradient hook, a second ``backward()``, a ``.grad`` changed by hand on one side);
- ``outcome``: whether two runs *end alike*, measured against the noise of their own losses (the spread a seed
  change gives, estimated from the batch-to-batch spread of each run's last losses around their trend), never as
  a fraction of how far the loss fell. A pair whose only difference is its precision policy is judged by it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from convcheck.diagnose.remedies import ACCUMULATION_REMEDIES, BACKWARD_REMEDIES, CLOSURE_REMEDIES
from convcheck.diagnose.watched_checks import pair_check
from convcheck.diagnose.watched_evidence import Setup
from convcheck.numerics.thresholds import (ACCUMULATION_FIT, BACKWARD_RTOL, GRAD_SHARE, NOISE_FACTOR,
                                           OUTCOME_MIN_STEPS, OUTCOME_TAIL)


WEIGHT_NORM = "(weights)"  # ``grad_sample``'s entry holding the weights' global norm (``watch/recipe.py``)


def _samples(run, k: int) -> dict:
    return {n: v for n, v in (run.steps[k].get("grad_sample") or {}).items() if n != WEIGHT_NORM}


def weight_norms(run) -> list[float | None]:
    """Each step's global weight norm (as the step began), None where it was not recorded."""
    out = []
    for s in run.steps:
        v = (s.get("grad_sample") or {}).get(WEIGHT_NORM)
        out.append(v[0] if isinstance(v, list) and len(v) == 1 and math.isfinite(v[0]) else None)
    return out


def _l1(xs) -> float:
    return sum(abs(x) for x in xs)


@pair_check("accumulation", order=30)
def accumulation(a, b, steps: int) -> Setup | None:
    """The first step (k >= 1) at which one run's gradients are its previous step's plus the other run's: that
    run never zeroes its gradients between steps."""
    for k in range(1, steps):
        sa, sb = _samples(a, k), _samples(b, k)
        pa, pb = _samples(a, k - 1), _samples(b, k - 1)
        names = [n for n in sa if n in sb and n in pa and n in pb and len(sa[n]) == len(sb[n]) == len(pa[n])
                 == len(pb[n])]
        if not names:
            continue
        scale = sum(_l1(sa[n]) + _l1(sb[n]) for n in names)
        plain = sum(_l1(y - x for x, y in zip(sa[n], sb[n])) for n in names)
        if scale == 0 or plain <= BACKWARD_RTOL * scale:
            continue  # the gradients agree at this step: nothing accumulates yet (the fit below tells the rest)
        for side, mine, other, before in (("B", sb, sa, pb), ("A", sa, sb, pa)):
            fit = sum(_l1(m - o - p for m, o, p in zip(mine[n], other[n], before[n])) for n in names)
            if fit <= ACCUMULATION_FIT * plain:
                return Setup(f"{side}'s gradients accumulate across steps: optimizer.zero_grad() is not called "
                             f"between its steps (from step {k})", "gradient accumulation",
                             evidence=[f"at step {k}, {side}'s sampled gradient entries are its step-{k - 1} "
                                       f"gradients plus {'A' if side == 'B' else 'B'}'s step-{k} ones (residual "
                                       f"{fit / plain:.2g} of their difference); the forward and the loss agree"],
                             remedies=list(ACCUMULATION_REMEDIES), step=k)
        return None
    return None


def gradient_parting(a, b, steps: int, tol: float) -> int | None:
    """The first aligned step at which some parameter's gradient norm differs by more than ``tol`` (relative to
    itself, or to ``GRAD_SHARE`` of the step's global gradient norm when it is smaller)."""
    for k in range(steps):
        ga, gb = a.steps[k].get("grad_norms") or {}, b.steps[k].get("grad_norms") or {}
        share = _share(ga, gb)
        if any(n in gb and _apart(ga[n], gb[n], tol, share) for n in ga):
            return k
    return None


def _share(ga: dict, gb: dict) -> float:
    """``GRAD_SHARE`` of the larger global gradient norm of a step: a parameter whose gradient is smaller (a bias
    feeding a BatchNorm, zero but for rounding) is held to that, not to itself."""
    norms = [math.sqrt(sum(v * v for v in g.values() if math.isfinite(v))) for g in (ga, gb)]
    return GRAD_SHARE * max(norms, default=0.0)


def _apart(x: float, y: float, tol: float, floor: float = 0.0) -> bool:
    if not (math.isfinite(x) and math.isfinite(y)):
        return math.isfinite(x) != math.isfinite(y)
    return max(x, y) > 0 and abs(x - y) > tol * max(x, y, floor)


def backward_difference(a, b, k: int, tol: float) -> Setup | None:
    """At step ``k``, whose data, forward and loss agree (the caller's check), gradients that differ beyond ``tol``
    (relative): the loss is built differently (a term still small, its sign or weight) or the backward differs."""
    ga, gb = a.steps[k].get("grad_norms") or {}, b.steps[k].get("grad_norms") or {}
    names = [n for n in ga if n in gb]
    share = _share(ga, gb)
    apart = [n for n in names if _apart(ga[n], gb[n], tol, share)]
    if not apart:
        return None
    worst = max(apart, key=lambda n: abs(ga[n] - gb[n]) / max(ga[n], gb[n], abs(ga[n] - gb[n])))
    la, lb = a.steps[k]["loss"], b.steps[k]["loss"]
    if la is not None and lb is not None and la != lb and math.isfinite(la) and math.isfinite(lb):
        loss = f"the loss differs by only {abs(la - lb) / max(abs(la), abs(lb)):.2g} (relative)"
    else:
        loss = "the loss agrees"
    evidence = [f"step {k}: {worst}'s gradient norm {ga[worst]:.6g} (A) | {gb[worst]:.6g} (B), beyond "
                f"{tol:.3g} (relative), with the same data, the layers' outputs and the loss within rounding"]
    remedies = list(BACKWARD_REMEDIES)
    evaluations = [r.steps[k].get("closure_evaluations") or 1 for r in (a, b)]
    if max(evaluations) > 1:  # a closure evaluated several times: its backward runs that often within the step
        evidence.append(f"step {k} evaluates the optimizer's closure {evaluations[0]} times in A and "
                        f"{evaluations[1]} in B: gradients added across its evaluations differ from a single one's")
        remedies = list(CLOSURE_REMEDIES) + remedies
    return Setup(f"the gradients differ at step {k} where the forward agrees and {loss}: the loss is built "
                 f"differently (a term, its sign or its weight) or the backward differs ({len(apart)} of "
                 f"{len(names)} parameters)", "backward", evidence=evidence, remedies=remedies, step=k)


@dataclass(frozen=True)
class Outcome:
    """How two runs end: each run's final loss (the mean of its last ``OUTCOME_TAIL`` share), the noise they are
    held to and whether they end alike (None: too few steps to judge)."""

    alike: bool | None
    final: tuple = (None, None)
    noise: float = 0.0
    worse: str | None = None  # the side that ends worse beyond the noise
    short: bool = False  # not judged because fewer than ``OUTCOME_MIN_STEPS`` aligned steps were recorded

    def text(self) -> str:
        if self.alike is None:
            return ("convergence not judged: too few steps" if self.short else
                    "convergence not judged: a loss of the last steps is missing or not finite")
        ea, eb = self.final
        verb = "end alike" if self.alike else f"end apart ({self.worse} worse)"
        return (f"the losses {verb}: {ea:.4g} (A) and {eb:.4g} (B) over the last steps, against a noise of "
                f"{self.noise:.3g} (the batch-to-batch spread of each run's last losses, a seed change's estimate)")


def _tail(run, steps: int) -> list[float] | None:
    n = max(3, int(steps * OUTCOME_TAIL))
    tail = [run.steps[k]["loss"] for k in range(steps - n, steps)]
    if any(v is None or not math.isfinite(v) for v in tail):
        return None
    return tail


def _spread(xs: list[float]) -> float:
    """The standard deviation of ``xs`` around their least-squares line (a falling loss's trend is not noise)."""
    n = len(xs)
    mx, my = (n - 1) / 2, sum(xs) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (x - my) for i, x in enumerate(xs)) / sxx if sxx else 0.0
    res = [x - (my + slope * (i - mx)) for i, x in enumerate(xs)]
    return math.sqrt(sum(r * r for r in res) / max(n - 2, 1))


def outcome(a, b, steps: int, tol: float) -> Outcome:
    """Whether the runs end alike: final losses within ``NOISE_FACTOR`` x the quieter run's spread, plus ``tol`` of
    the larger final loss (the precision's own rounding)."""
    if steps < OUTCOME_MIN_STEPS:
        return Outcome(None, short=True)
    ta, tb = _tail(a, steps), _tail(b, steps)
    if ta is None or tb is None:
        return Outcome(None)
    ea, eb = sum(ta) / len(ta), sum(tb) / len(tb)
    noise = min(_spread(ta), _spread(tb))  # the quieter run's: noise a precision adds is the effect, not the yardstick
    alike = abs(ea - eb) <= NOISE_FACTOR * noise + tol * max(abs(ea), abs(eb))
    return Outcome(alike, (ea, eb), noise, None if alike else ("A" if ea > eb else "B"))
