"""``convcheck diff RUN_A RUN_B`` on two watched runs: steps aligned by index, the first difference in
the data, the step and layer where the two part beyond rounding, the first non-finite producer of each,
the environments diffed; a ``Verdict`` in ``compare``'s categories (exit 0 ok, 1 otherwise).

"Beyond rounding": at a step both runs snapshotted, a layer's input or output differs element by element
by more than ``PART_FACTOR`` unit roundoffs of the coarser dtype (relative norm); at other steps, its output
statistics (max |x|, mean, std) of the two runs differ by more than
``PART_FACTOR`` unit roundoffs of the coarser of the two output dtypes (relative to the layer's std, or
its max |x| when the std is 0); NaN/Inf present on one side only always parts.

At each run's snapshot steps every leaf call is replayed through the float64 judge of this machine
(``replay.py``: local error against the measured floor, as ``compare`` does) when the model's class is
importable here; otherwise one line says why and the diff goes on without it. ``judge_watched`` is
``convcheck diff RUN --judge SPEC``: one watched run against the judge alone.
"""

from __future__ import annotations

import math

import numpy as np
from dataclasses import dataclass, field, replace

from convcheck.runformat.schema import WATCH_DIFF_SCHEMA
from convcheck.runformat.statistics import declared
from convcheck.diagnose.detectors.watched import (first_nonfinite, gradient_underflow, precision_difference,
                                                  random_layers, recipe_difference,
                                                  run_findings)
from convcheck.diagnose.detectors.watched_setup import compiled_random
from convcheck.diagnose.detectors.watched_causal import Outcome, backward_difference, gradient_parting, outcome
from convcheck.diagnose.detectors.watched_data import same_batches
from convcheck.diagnose.detectors.watched_recipe import precision_policy
from convcheck.diagnose.watched_checks import setup_findings
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import Parting, producer_text
from convcheck.env.diff import diff as env_diff
from convcheck.env.fingerprint import Fingerprint
from convcheck.errors import UsageError
from convcheck.report.verdict_lines import verdict_lines
from convcheck.numerics.formats import FLOAT32, coarsest_dtype, unit_roundoff_of
from convcheck.numerics.thresholds import (BACKWARD_RTOL, ENDS_ALIKE_FALL, ENDS_ALIKE_RATIO, LOSS_RTOL,
                                          LOSS_SPIKE, PART_FACTOR)
from convcheck.runformat.reader import WatchedRun, open_watched
from convcheck.analysis.run_lines import hidden_layers, judge_lines, scaler_notes, stopped_line, symptom_dict
from convcheck.analysis.replay import Replay, replay_run
from convcheck.analysis.verdict import decide, decide_single, run_evidence, size_cap



@dataclass(frozen=True)
class WatchDiff:
    a: str
    b: str
    steps: tuple[int, int]
    data_step: int | None
    parting: Parting | None
    loss_step: int | None
    producers: tuple[dict | None, dict | None]
    env: list = field(default_factory=list)
    flags: list = field(default_factory=list)
    replays: tuple = (None, None)  # each run's ``replay.Replay`` (the float64 judge at its snapshot steps)
    setup: tuple = ()  # ``setup.Setup``: what the runs were set up with differently (optimizer, lr, initial weights)
    stopped: tuple = (None, None)  # each run's ``stopped`` (its block raised or was interrupted), or None
    verdict: Verdict | None = None
    loss_tol: float = LOSS_RTOL  # the relative loss difference beyond rounding (``loss_tolerance``)
    # (first step apart, A's final loss, B's final loss): losses at different precisions that wandered apart
    # step by step but end alike (``_loss_parting``); None otherwise
    loss_wander: tuple | None = None
    own: tuple = ((), ())  # each run's own findings (``diagnose.detectors.watched.run_findings``): Symptoms
    pair: tuple = ()  # what only the pair shows: a recipe difference at step 0, a gradient underflow (Symptoms)
    truncated: tuple = (None, None)  # each run's size-cap note when its record was cut (max_bytes), or None
    compiled: tuple = (None, None)  # each run's ``hidden_layers`` line when torch.compile hid its layers, or None
    scaler_notes: tuple = ((), ())  # each run's notes of its GradScaler's use (``scaler_use.py``)
    outcome: Outcome | None = None  # how the runs end, against their own noise (``watched_causal.outcome``)
    policy: tuple = ()  # how the runs' precision policies differ (``watched_recipe.precision_policy``)

    def __bool__(self) -> bool:
        return self.verdict is not None and self.verdict.category == "ok"

    def lines(self) -> list[str]:
        out = [f"watched runs: A = {self.a} ({self.steps[0]} steps), B = {self.b} ({self.steps[1]} steps)"]
        out += [stopped_line(side, s) for side, s in zip("AB", self.stopped) if s is not None]
        out += [f"truncated: {side}'s {note}" for side, note in zip("AB", self.truncated) if note]
        out += [f"compiled: {side}'s {note}" for side, note in zip("AB", self.compiled) if note]
        out += [f"note: {side}: {n}" for side, notes in zip("AB", self.scaler_notes) for n in notes]
        out.append("data: " + ("the same batches at every aligned step" if self.data_step is None else
                               f"different data from step {self.data_step} (batch hashes differ)"))
        out.append("parting: " + ("none beyond rounding" if self.parting is None else
                                  f"step {self.parting.step}, layer {self.parting.layer}: {self.parting.why}"))
        if self.policy:
            out.append("precision: " + "; ".join(self.policy))
        if self.outcome is not None:
            out.append("outcome: " + self.outcome.text())
        out += [f"setup: {f.headline}" for f in self.setup]
        out += [f"{s.arm} on its own: {s.label}: {s.evidence}" for side in self.own for s in side]
        out += [f"pair: {s.label}: {s.evidence}" for s in self.pair]
        for side, p in zip("AB", self.producers):
            if p is not None:
                out.append(f"first non-finite in {side}: {producer_text(p)}")
        out += judge_lines(self.replays)
        out += [f"version: {d.field}: {d.left} | {d.right}" for d in self.env]
        out += [f"math flag: {k}: {va} | {vb}" for k, va, vb in self.flags]
        v = self.verdict
        out += verdict_lines(v, "diff")
        return out

    def to_dict(self) -> dict:
        return {"schema": WATCH_DIFF_SCHEMA, "a": self.a, "b": self.b, "steps": list(self.steps),
                "data_step": self.data_step,
                "parting": None if self.parting is None else vars(self.parting), "loss_step": self.loss_step,
                "first_nonfinite": list(self.producers), "env_diff": [d.to_dict() for d in self.env],
                "math_flags_diff": [list(f) for f in self.flags],
                "judge_replay": [None if r is None else r.to_dict() for r in self.replays],
                "setup": [{"headline": f.headline, "sub_cause": f.sub_cause, "step": f.step} for f in self.setup],
                "stopped": list(self.stopped), "truncated": list(self.truncated), "compiled": list(self.compiled),
                "own_findings": [[symptom_dict(s) for s in side] for side in self.own],
                "pair_findings": [symptom_dict(s) for s in self.pair],
                "precision_policy": list(self.policy),
                "outcome": None if self.outcome is None else {"alike": self.outcome.alike,
                                                               "final": list(self.outcome.final),
                                                               "noise": self.outcome.noise},
                "verdict": self.verdict.to_dict()}


@dataclass(frozen=True)
class WatchJudge:
    """``convcheck diff RUN --judge SPEC``: one watched run held against the float64 judge."""

    run: str
    steps: int
    producer: dict | None
    replay: Replay
    verdict: Verdict
    stopped: dict | None = None
    own: tuple = ()  # the run's own findings (``diagnose.detectors.watched.run_findings``)
    compiled: str | None = None  # ``hidden_layers``: torch.compile hid the run's layers
    notes: tuple = ()  # ``scaler_notes``

    def __bool__(self) -> bool:
        return self.verdict.category == "ok"

    def lines(self) -> list[str]:
        out = [f"watched run: {self.run} ({self.steps} steps)"]
        if self.stopped is not None:
            out.append(stopped_line("-", self.stopped))
        if self.compiled:
            out.append(f"compiled: the run's {self.compiled}")
        out += [f"note: {n}" for n in self.notes]
        out.append("first non-finite: " + ("none" if self.producer is None else producer_text(self.producer)))
        out += judge_lines((self.replay,), sides="-")
        out += [f"on its own: {s.label}: {s.evidence}" for s in self.own]
        v = self.verdict
        out += verdict_lines(v, "diff")
        return out

    def to_dict(self) -> dict:
        return {"schema": WATCH_DIFF_SCHEMA, "run": self.run, "steps": self.steps, "first_nonfinite": self.producer,
                "judge_replay": self.replay.to_dict(), "stopped": self.stopped, "compiled": self.compiled,
                "own_findings": [symptom_dict(s) for s in self.own], "verdict": self.verdict.to_dict()}


def refuse_empty(run: WatchedRun) -> None:
    """A run that recorded no step has nothing to diagnose: one line saying why it may be empty (exit 2),
    never an ``ok`` beside a real run."""
    if run.steps:
        return
    stopped = run.manifest.get("stopped")
    if isinstance(run.manifest.get("watch_error"), dict):  # convcheck's own error stopped the recording
        why = next((n for n in run.manifest.get("notes", []) if n.startswith("recording stopped at step")),
                   "the watch stopped recording before the first step ended")
    elif run.manifest.get("truncated"):
        why = "its size cap (max_bytes) was reached before the first step ended"
    elif stopped:
        why = f"the block stopped with {stopped['exception']} before its first step ended"
    else:
        why = "the loop never ended a step: no optimizer.step() inside the block (or w.step() never called)"
    raise UsageError(f"watched run {run.path} recorded no step: {why}")


def judge_watched(path, judge: str, trust: bool = False) -> WatchJudge:
    """One watched run against the float64 judge ``judge`` (a float64 target of this machine); ``trust``: load
    its model recorded by value even when this user did not sign it (``--trust-run``)."""
    run = open_watched(path)
    refuse_empty(run)
    replay = replay_run(run, judge, trust=trust)
    own = tuple(run_findings(run, "the run"))
    return WatchJudge(str(run.path), len(run.steps), first_nonfinite(run), replay, decide_single(run, replay, own),
                      stopped=run.manifest.get("stopped"), own=own, compiled=hidden_layers(run),
                      notes=scaler_notes(run))


def _rel(x: float, y: float, scale: float) -> float:
    if x == y:
        return 0.0
    return abs(x - y) / scale if scale > 0 else math.inf


def layer_distance(ra: dict, rb: dict, computed: str | None = None) -> tuple[float, str]:
    """``(distance in units of the coarser dtype's roundoff, why)`` between one layer's two rows; ``computed``: the
    coarser format a run computed in (its autocast dtype), when coarser than the rows' storage dtypes."""
    if (ra["nan"] + ra["inf"] > 0) != (rb["nan"] + rb["inf"] > 0):
        side = "A" if ra["nan"] + ra["inf"] else "B"
        return math.inf, f"non-finite values in {side} only"
    u = max(unit_roundoff_of(ra["dtype"]), unit_roundoff_of(rb["dtype"]))
    coarser = _coarser(ra, rb)
    if computed is not None and unit_roundoff_of(computed) > u:
        u, coarser = unit_roundoff_of(computed), f"{computed} (autocast)"
    # each declared statistic by its tolerance family (``runformat/statistics.py``): a magnitude against itself,
    # a location (the mean) against the layer's spread; one a run lacks (recorded before it was declared) left out
    spread = max(ra["std"], rb["std"]) or max(ra["max_abs"], rb["max_abs"])
    parts = {s.title: _rel(ra[s.name], rb[s.name],
                           max(abs(ra[s.name]), abs(rb[s.name])) if s.family == "scale" else spread)
             for s in declared() if s.family in ("scale", "location")
             and isinstance(ra.get(s.name), (int, float)) and isinstance(rb.get(s.name), (int, float))}
    what, d = max(parts.items(), key=lambda kv: kv[1])
    return d / u, f"{what} differs by {d:.3g} (relative), {d / u:.3g}x the roundoff of {coarser}"


def _coarser(ra: dict, rb: dict) -> str:
    return coarsest_dtype((ra["dtype"], rb["dtype"]))


def _dtypes_at(run: WatchedRun, step: int) -> dict[str, str]:
    e = next(s for s in run["snapshots"] if s["step"] == step)
    return {x["key"]: x["dtype"] for x in e["arrays"]}


def snapshot_parting(a: WatchedRun, b: WatchedRun, step: int) -> Parting | None:
    """Element by element at a step both runs snapshotted: each leaf's first input, then its first output,
    in the order the layers ran; an input that parts while the layer before did not was made by own code."""
    sa, sb = a.snapshot(step), b.snapshot(step)
    da, db = _dtypes_at(a, step), _dtypes_at(b, step)
    same_batch = same_batches(a, b, step)
    for i, layer in enumerate(a.steps[step]["layers"]):
        for what, key in (("input", f"in/{layer}/0/0"), ("output", f"out/{layer}/0/0")):
            if key not in sa or key not in sb or sa[key].shape != sb[key].shape:
                continue
            x, y = sa[key].astype(np.float64), sb[key].astype(np.float64)
            fa, fb = np.isfinite(x).all(), np.isfinite(y).all()
            if fa != fb:
                return Parting(step, layer, f"its {what} is non-finite in {'B' if fa else 'A'} only", math.inf)
            if not fa:
                continue
            norm = max(np.linalg.norm(x), np.linalg.norm(y))
            d = float(np.linalg.norm(x - y) / norm) if norm else 0.0
            u = max(unit_roundoff_of(da[key]), unit_roundoff_of(db[key]))
            if d > PART_FACTOR * u:
                coarser = coarsest_dtype((da[key], db[key]))
                origin = ("" if what != "input" else " (the batch: the runs were given different data)"
                          if not same_batch and i == 0 else " (made by the own code that runs before it)")
                return Parting(step, layer, f"its {what}{origin} differs by {d:.3g} (relative, element by "
                                            f"element), {d / u:.3g}x the roundoff of {coarser}", d)
    return None


def first_parting(a: WatchedRun, b: WatchedRun, steps: int) -> Parting | None:
    snapped = {s["step"] for s in a["snapshots"]} & {s["step"] for s in b["snapshots"]}
    for k in range(steps):
        if k in snapped:
            found = snapshot_parting(a, b, k)
            if found is not None:
                return found
        la, lb = a.steps[k]["layers"], b.steps[k]["layers"]
        computed = autocast_at(a, b, k)
        for name in la:
            if name in lb:
                d, why = layer_distance(la[name], lb[name], computed)
                if d > PART_FACTOR:
                    return Parting(k, name, why)
    return None


def autocast_at(a: WatchedRun, b: WatchedRun, k: int) -> str | None:
    """The coarser autocast dtype either run's step ``k`` ran under (None without autocast)."""
    fmts = [f for f in (a.steps[k].get("autocast"), b.steps[k].get("autocast")) if f]
    return coarsest_dtype(fmts) if fmts else None


def _first_data_difference(a: WatchedRun, b: WatchedRun, steps: int) -> int | None:
    """The first aligned step whose batches differ; a step trained in eval mode on either side recorded no batch
    (not a data difference: ``eval_mode_difference`` names it)."""
    return next((k for k in range(steps) if not (a.steps[k].get("model_eval") or b.steps[k].get("model_eval"))
                 and not same_batches(a, b, k)), None)


def _loss_unit(a: WatchedRun, b: WatchedRun) -> float:
    """The unit roundoff of the coarser of the two runs' precisions (their layers' output dtypes at step 0)."""
    dtypes = {r["dtype"] for run in (a, b) if run.steps for r in run.steps[0]["layers"].values()}
    dtypes |= {run.steps[0]["autocast"] for run in (a, b) if run.steps and run.steps[0].get("autocast")}
    return max((unit_roundoff_of(t) for t in dtypes), default=FLOAT32.unit_roundoff)


def loss_tolerance(a: WatchedRun, b: WatchedRun) -> float:
    """Two losses differ beyond rounding past ``PART_FACTOR`` unit roundoffs of the coarser run's precision
    (relative), never below 1e-3 (a float32 pair's reductions in another order)."""
    return max(LOSS_RTOL, PART_FACTOR * _loss_unit(a, b))


def _final_losses(run: WatchedRun, steps: int) -> float | None:
    """The mean of the last tenth (at least one) of a run's first ``steps`` losses; None when any is missing
    or non-finite."""
    tail = [run.steps[k]["loss"] for k in range(steps - max(1, steps // 10), steps)] if steps else []
    if not tail or any(v is None or not math.isfinite(v) for v in tail):
        return None
    return sum(tail) / len(tail)




def ends_alike(ea: float, eb: float, x0: float, y0: float, tol: float) -> bool:
    """Whether two final losses end alike (``ENDS_ALIKE_RATIO``, ``tol`` of the larger, ``ENDS_ALIKE_FALL``
    of the fall from the first losses ``x0``, ``y0``)."""
    lo, hi = sorted((abs(ea), abs(eb)))
    gap = abs(ea - eb)
    fall = max(x0 - ea, y0 - eb, 0.0)
    same_sign = (ea >= 0) == (eb >= 0)  # an NLL or ELBO can end below 0: -0.5 and 0.45 are not alike
    return (same_sign and hi <= ENDS_ALIKE_RATIO * lo) or gap <= tol * hi or gap <= ENDS_ALIKE_FALL * fall


def _loss_parting(a: WatchedRun, b: WatchedRun, steps: int, end: Outcome | None = None,
                  policy: tuple = ()) -> tuple[int | None, tuple | None]:
    """``(step, wander)``: the first step whose losses differ beyond ``loss_tolerance`` (None when none, or
    when two runs at different precisions end alike: ``ends_alike``, no spike above ``LOSS_SPIKE``); and,
    when they wandered apart but end alike, ``(first step apart, A's final, B's final)`` for the ok verdict to
    say. Runs of one precision keep the strict step-by-step check (nondeterminism shows in the loss)."""
    tol = loss_tolerance(a, b)
    first = None
    for k in range(steps):
        x, y = a.steps[k]["loss"], b.steps[k]["loss"]
        if x is not None and y is not None and x != y and not (abs(x - y) <= tol * max(abs(x), abs(y))):
            first = k
            break
    # at step 0 (the same weights, the same batch) the precision's own tolerance is all rounding can explain: a
    # loss apart beyond it there (another random mask, another loss) is no drift to be judged by the outcome
    if first is None or first == 0 or (_loss_unit(a, b) <= FLOAT32.unit_roundoff and not policy):
        return first, None
    if end is not None and end.alike is not None:  # measured against the runs' own noise (issue 42)
        return (None, (first, *end.final)) if end.alike else (first, None)
    ea, eb = _final_losses(a, steps), _final_losses(b, steps)
    x0, y0 = a.steps[0]["loss"], b.steps[0]["loss"]
    if ea is None or eb is None or x0 is None or y0 is None or not math.isfinite(x0 + y0):
        return first, None
    gaps = [abs(a.steps[k]["loss"] - b.steps[k]["loss"]) for k in range(steps)
            if a.steps[k]["loss"] is not None and b.steps[k]["loss"] is not None]
    if max(gaps, default=0.0) > LOSS_SPIKE * max(abs(x0), abs(y0)) or not ends_alike(ea, eb, x0, y0, tol):
        return first, None
    return None, (first, ea, eb)


def _backward(a, b, steps, policy, data_step, parting, loss_step) -> tuple:
    """Causal order inside a step: gradients that part before any data, layer output or loss does were made by
    the loss's construction or the backward (``watched_causal.backward_difference``), held to ``PART_FACTOR``
    roundoffs, never below ``BACKWARD_RTOL``; asked only of runs of one precision policy (at different ones, a
    small parameter's gradient differs by more than any fixed share: accumulation is told apart on its own)."""
    if policy:  # at different precisions a small parameter's gradient differs by more than 5% (a bias's, 11%)
        return ()
    tol = max(BACKWARD_RTOL, PART_FACTOR * _loss_unit(a, b))
    k = gradient_parting(a, b, steps, tol)
    if k is None or any(s is not None and s <= k for s in (data_step, loss_step)):
        return ()
    if parting is not None and (parting.step < k or parting.step == k and not _after_first_evaluation(a, b, k)):
        return ()
    found = backward_difference(a, b, k, tol)
    return (found,) if found is not None else ()


def _after_first_evaluation(a: WatchedRun, b: WatchedRun, k: int) -> bool:
    """Whether step ``k``'s parting came after its gradients: an optimizer that evaluated a closure several times
    (LBFGS) moved the parameters between the evaluations, and the first evaluation - the snapshot's calls - agrees
    element by element; the statistics, merged over every evaluation, part only after the first update."""
    if not (a.steps[k].get("closure_evaluations") and b.steps[k].get("closure_evaluations")):
        return False
    snapped = {s["step"] for s in a["snapshots"]} & {s["step"] for s in b["snapshots"]}
    return k in snapped and snapshot_parting(a, b, k) is None


def diff_watched(path_a, path_b, judge: str | None = None, trust: bool = False) -> WatchDiff:
    """Two watched runs compared; a one-line ``UsageError`` when they did not watch the same model.
    ``judge``: the float64 target that replays the snapshot steps (default: this machine's judge)."""
    a, b = open_watched(path_a), open_watched(path_b)
    for run in (a, b):
        refuse_empty(run)
    pa = [(p["name"], p["shape"]) for p in a["model"]["parameters"]]
    pb = [(p["name"], p["shape"]) for p in b["model"]["parameters"]]
    if pa != pb:
        first = next((x, y) for x, y in zip(pa + [None], pb + [None]) if x != y)
        raise UsageError(f"the watched runs did not watch the same model: {a.path} has parameter {first[0]}, "
                         f"{b.path} has {first[1]}")
    steps = min(len(a.steps), len(b.steps))
    env = env_diff(Fingerprint.from_dict(a["fingerprint"]), Fingerprint.from_dict(b["fingerprint"]))
    fa, fb = a["math_flags"], b["math_flags"]
    flags = [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k) and k != "threads"]
    # the setup checks registered in ``diagnose/detectors/`` (``watched_checks``), in the order a step uses them
    setup = setup_findings(a, b, steps)
    # the recorded policy, else what the layers' output dtypes show (an autocast entered inside the model's own
    # call - accelerate's, Lightning's - is not seen as the call starts)
    policy = tuple(precision_policy(a, b)) or tuple(x for x in (precision_difference(a, b, flags),) if x)
    end = outcome(a, b, steps, loss_tolerance(a, b))
    loss_step, wander = _loss_parting(a, b, steps, end, policy)
    data_step = _first_data_difference(a, b, steps)
    parting = first_parting(a, b, steps)
    setup += _backward(a, b, steps, policy, data_step, parting, loss_step)
    pair = []
    if steps and data_step != 0 and not any(f.step == 0 and f.sub_cause == "initial weights" for f in setup) \
            and (parting is None or parting.step > 0) \
            and compiled_random(a, b, random_layers(a)) is None:  # the same weights, batch and masks: step 0 agrees
        pair.append(recipe_difference(a, b, loss_tolerance(a, b)))
    pair.append(gradient_underflow(a, b))
    result = WatchDiff(str(a.path), str(b.path), (len(a.steps), len(b.steps)), data_step,
                       parting, loss_step,
                       (first_nonfinite(a), first_nonfinite(b)), env, flags, setup=setup,
                       stopped=(a.manifest.get("stopped"), b.manifest.get("stopped")),
                       loss_tol=loss_tolerance(a, b), loss_wander=wander,
                       own=(tuple(run_findings(a, "A")), tuple(run_findings(b, "B"))),
                       truncated=(size_cap(a), size_cap(b)), compiled=(hidden_layers(a), hidden_layers(b)),
                       scaler_notes=(scaler_notes(a), scaler_notes(b)),
                       pair=tuple(x for x in pair if x is not None), outcome=end, policy=policy)
    if judge is None:
        from convcheck.targets.spec import default_judge

        judge = str(default_judge()[0])
    result = replace(result, replays=(replay_run(a, judge, trust=trust), replay_run(b, judge, trust=trust)))
    # each run's evidence gathered once, as its own judge reads it, and shared with the pair's
    runs = tuple(run_evidence(r, replay, own, side) for r, replay, own, side in zip((a, b), result.replays, result.own, "AB"))
    return replace(result, verdict=decide(result, a, b, runs))
