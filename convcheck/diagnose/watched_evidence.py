"""What the verdict rules read of watched runs: ``PairEvidence`` (``convcheck diff A B``) and ``RunEvidence``
(``convcheck diff RUN --judge``), beside ``evidence.Evidence`` (a live comparison or two bundles).

Each is a frozen record of data that ``watch/`` measured and the detectors
(``detectors/watched.py``, ``detectors/watched_setup.py``) turned into symptoms; the rules of
``rules/watched.py`` read nothing else, so a test can build one by hand. ``registry.decide`` runs the rules
that read the record's type, by priority, as for a comparison.

A producer is the watch's record of the first NaN/Inf (``layer``, ``step``, ``direction``, ``kind``,
``detail``, ``op``, ``magnitude``, ``dtype``); a replay is the float64 judge's replay of one run's snapshot
steps (``analysis/replay.Replay``: ``flagged`` and ``overflows`` rows with ``step``, ``layer``, ``local``,
``floor`` and ``text()``, and ``summary()``), read through those members only.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from convcheck.numerics.formats import FORMATS

SIDES = "AB"
LOSS = "the loss"  # the producer's name when the loss's own code made the first NaN/Inf (``Watch.step``)


@dataclass(frozen=True)
class Parting:
    """Where two watched runs part beyond rounding: the step, the layer, and by how much."""

    step: int
    layer: str
    why: str
    size: float | None = None  # the relative difference, element by element (Inf: non-finite in one run only)


@dataclass(frozen=True)
class Setup:
    """One thing the runs were set up with differently (or one run's own divergence): its headline, the
    cause in a word (``sub_cause``), evidence, remedies, and the step it shows from."""

    headline: str
    sub_cause: str
    evidence: list = field(default_factory=list)
    remedies: list = field(default_factory=list)
    step: int | None = None


@dataclass(frozen=True)
class PairEvidence:
    """Two watched runs, A and B, aligned step by step (``analysis/diff.diff_watched``)."""

    steps: tuple[int, int] = (0, 0)
    data_step: int | None = None  # the first aligned step whose batches differ
    parting: Parting | None = None  # the first step and layer where the runs part beyond rounding
    loss_step: int | None = None  # the first step whose losses differ beyond ``loss_tol``
    loss_tol: float = 0.0
    loss_wander: tuple | None = None  # (first step apart, A's final, B's final): apart, but ending alike
    producers: tuple = (None, None)  # each run's first NaN/Inf producer
    replays: tuple = (None, None)  # each run's float64 replay
    setup: tuple[Setup, ...] = ()  # what the runs were set up with differently, in the order found
    stopped: tuple = (None, None)  # each run's ``stopped`` record (its block raised or was interrupted)
    env: tuple = ()  # the fingerprints' differences (``env.diff.Difference``)
    precision: str | None = None  # why the runs compute at different precisions; None when they do not
    own: tuple = ((), ())  # each run's own findings (``Symptom``s of ``detectors/watched.run_findings``)
    pair: tuple = ()  # what only the pair shows (recipe, loss scale, gradient underflow)
    divergence: tuple = (None, None)  # each run's own exploding loss (``Setup``), or None
    scaled_backward: tuple = (None, None)  # each run's fixed-loss-scale overflow (``Symptom``), or None
    converged: tuple = (None, None)  # each run's own convergence (compare's rule); None: too short to judge
    truncated: tuple = (None, None)  # each run's size-cap note when its record was cut (``max_bytes``), or None
    random_layers: tuple = ()  # the layers that draw random numbers (Dropout...), in A's model
    compiled_random: str | None = None  # one run compiled, the other eager, its random layers drawing differently
    outcome: object | None = None  # how the runs end against their own noise (``detectors/watched_causal.Outcome``)
    # both runs on the CPU at one thread count (kernels that repeat themselves bitwise), and their PYTHONHASHSEED
    # as each run had it: a parting there is an order in the user's code, not a kernel's
    cpu_repeatable: bool = False
    hash_seeds: tuple = (None, None)


@dataclass(frozen=True)
class RunEvidence:
    """One watched run against the float64 judge (``analysis/diff.judge_watched``)."""

    producer: dict | None = None
    replay: object | None = None
    divergence: Setup | None = None
    own: tuple = ()
    stopped: dict | None = None
    scaled_backward: object | None = None  # ``Symptom`` or None
    converged: bool | None = None  # compare's rule on the run's own losses; None: too short to judge
    steps: int = 0  # how many steps the run recorded
    truncated: str | None = None  # its size-cap note when the record was cut (``max_bytes``)
    eval_from: int | None = None  # the first step it trained with the model in eval mode (``model_eval``)
    setup: tuple = ()  # how the run was set up wrong on its own (``Setup``s: a clip before ``scaler.unscale_``)


@dataclass(frozen=True)
class RankFinding:
    """One rank of one DDP run against its reference rank: where DDP should have made them equal and did not."""

    run: str
    rank: int
    reference: int
    step: int | None
    kind: str  # "gradients", "parameters", "lr", "steps", "same data" or "epoch order"
    text: str

    def line(self) -> str:
        return f"{self.run}: rank {self.rank} against rank {self.reference}: {self.text}"


@dataclass(frozen=True)
class RankEvidence:
    """Watched DDP runs (``analysis/rankdiff.diff_ranked``): each run's ranks against its rank 0 (``findings``),
    and the verdicts of the rank-by-rank pairs (``per_rank``, each chosen from its ``PairEvidence``; empty for
    two ranks of one run)."""

    findings: tuple[RankFinding, ...] = ()
    per_rank: tuple = ()


# --- the words every watched verdict uses for a producer ----------------------------------------------

def producer_where(p: dict) -> str:
    """``att (own code: matmul, forward)``: the producer, the op inside it when the run named one."""
    op = p.get("op")
    op = f": {op[:60]}" if isinstance(op, str) else ""
    call = p.get("call")  # a layer called several times in the step: which call (issue 48)
    call = f", call {call} of the step" if isinstance(call, int) and not isinstance(call, bool) else ""
    return f"{p['layer']} ({p['kind']}{op}, {p['direction']}{call})"


def producer_text(p: dict) -> str:
    detail = [str(p["detail"])[:200]] if p.get("detail") else []
    detail += [magnitude_text(p)] if magnitude_text(p) else []
    src = source_text(p.get("source"))
    return f"{producer_where(p)} at step {p['step']}" + (f": {'; '.join(detail)}" if detail else "") \
        + (f" [{src}]" if src else "")


def source_text(src) -> str:
    """``file.py:12: w = e / e.sum(-1, keepdim=True)``, the producer's source line (``watch/sourceline.py``), the
    file relative to the current folder when inside it; "" for a missing or malformed record (untrusted)."""
    if not isinstance(src, dict) or not isinstance(src.get("file"), str) or not isinstance(src.get("line"), int) \
            or isinstance(src.get("line"), bool):
        return ""
    path = src["file"][:300]
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    code = src.get("code") if isinstance(src.get("code"), str) else ""
    return f"{path}:{src['line']}" + (f": {' '.join(code.split())[:160]}" if code else "")


_LARGEST = {f.dtype: f.largest for f in FORMATS if f.dtype in ("float16", "bfloat16", "float32", "float64")}


def magnitude_text(p: dict) -> str:
    """``values reach 7.6e+04 > 65504 (float16's largest)``: the producing op's float64 magnitude, from a
    producer's record (a field missing or of the wrong type says nothing: the record is untrusted)."""
    mag, dtype = p.get("magnitude"), p.get("dtype")
    if not isinstance(p.get("op"), str) or not isinstance(mag, (int, float)) or isinstance(mag, bool) \
            or math.isnan(mag):
        return ""
    limit = _LARGEST.get(dtype) if isinstance(dtype, str) else None
    if math.isinf(mag):
        return "non-finite in float64 too"
    if limit is not None and mag > limit:
        return f"values reach {mag:.3g} > {limit:.6g} ({dtype}'s largest)"
    return f"its float64 values reach {mag:.3g}"


def parting_lines(ev: PairEvidence) -> list[str]:
    if ev.parting is None:
        return []
    return [f"the runs part at step {ev.parting.step} in {ev.parting.layer}: {ev.parting.why}"]


def overflow_lines(replays, sides: str = SIDES) -> list[str]:
    return [f"{side}: {r.text()}" for side, rep in zip(sides, replays) if rep is not None for r in rep.overflows[:3]]


def first_flagged(replays) -> tuple[str, object] | None:
    """``(side, row)`` of the earliest layer call the judge found above its floor (None when none)."""
    rows = [(r.step, i, SIDES[i], r) for i, rep in enumerate(replays) if rep is not None for r in rep.flagged]
    return min(rows, key=lambda x: x[:2])[2:] if rows else None
