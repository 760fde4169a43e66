"""``convcheck diff`` of a DDP rank against a run of another world size (one process, issue 45): what DDP makes
equal to a run on the same global batch is compared, the rest is said to be each rank's share.

Under DDP each rank trains on its share of the global batch and the gradients are averaged across the ranks: the
mean of the ranks' mean losses' gradients is the whole batch's mean loss's gradient. So rank 0's averaged
gradients and its parameters are one process's on the whole batch, within rounding (the sums run in another
order); its batch, loss and layer activations are its share's and are not compared. Compared: the recipe and
settings (``diagnose/watched_checks.setup_findings``, less the loss's targets, which are a share too), the
gradient norms at every aligned step and, element by element, the gradients and parameters at the steps both
snapshotted (within ``BACKWARD_RTOL`` relative, at least ``PART_FACTOR`` roundoffs of the parameter's dtype); at
a snapshot step, whether the rank's batch is a share of the other's (each of its rows among the other's rows).
A gradient that parts is a ``Setup`` (the global batch is not the same, or the gradients were not averaged),
decided with the other setup findings by rule W001 in causal order; nothing found is ``ok``, saying what was
compared. The float64 judge is not run here (``convcheck diff RUN --judge`` runs it on either run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from convcheck.diagnose.detectors.watched_causal import gradient_parting
from convcheck.diagnose.registry import decide
from convcheck.diagnose.remedies import DATA_REMEDIES
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_checks import setup_findings
from convcheck.diagnose.watched_evidence import PairEvidence, Setup
from convcheck.errors import UsageError
from convcheck.numerics.formats import unit_roundoff_of
from convcheck.numerics.thresholds import BACKWARD_RTOL, PART_FACTOR
from convcheck.report.verdict_lines import verdict_lines
from convcheck.runformat.reader import WatchedRun, open_watched
from convcheck.runformat.schema import WATCH_DIFF_SCHEMA

SHARES = ("targets",)  # setup checks that read a batch's contents: a rank's are its share, not comparable
NOT_COMPARED = "the batches, the losses and the layers' activations (a rank's are its share of the global batch)"
UNAVERAGED = ("wrap the model in DistributedDataParallel (or all-reduce the gradients) so that each rank steps on "
              "the gradients averaged over the global batch")
GLOBAL_BATCH = ("compare against one process on the same global batch: world size x the per-rank batch, the same "
                "samples in the same steps (a DistributedSampler draws its own order: shuffle=False on both, or "
                "the same order)")


def world_of(run: WatchedRun) -> int:
    """The world size the run was watched in (1 without torch.distributed)."""
    d = run.manifest.get("distributed")
    w = d.get("world_size") if isinstance(d, dict) else None
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else 1


def _rank_of(run: WatchedRun) -> int | None:
    d = run.manifest.get("distributed")
    r = d.get("rank") if isinstance(d, dict) else None
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def describe(run: WatchedRun) -> str:
    w, r = world_of(run), _rank_of(run)
    return "one process" if w == 1 else f"rank {r} of {w}"


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    norm = max(float(np.linalg.norm(x)), float(np.linalg.norm(y)))
    return float(np.linalg.norm(x - y)) / norm if norm else 0.0


def _rows(a: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in a.reshape(a.shape[0], -1)} if a.ndim and a.shape[0] else set()


@dataclass(frozen=True)
class WorldDiff:
    a: str
    b: str
    who: tuple[str, str]  # "rank 0 of 2", "one process"
    steps: tuple[int, int]
    compared: tuple[str, ...] = ()  # what was compared and how it went, a line each
    setup: tuple[Setup, ...] = ()
    verdict: Verdict | None = None
    tolerance: float = BACKWARD_RTOL

    def __bool__(self) -> bool:
        return self.verdict is not None and self.verdict.category == "ok"

    def lines(self) -> list[str]:
        out = [f"watched runs of different world sizes: A = {self.a} ({self.who[0]}, {self.steps[0]} steps), "
               f"B = {self.b} ({self.who[1]}, {self.steps[1]} steps)",
               "compared: what DDP makes equal to a run on the same global batch - the averaged gradients, the "
               "parameters, the learning rates and the recipe; not compared: " + NOT_COMPARED]
        out += list(self.compared)
        out += [f"setup: {f.headline}" for f in self.setup]
        out += verdict_lines(self.verdict, "diff")
        return out

    def to_dict(self) -> dict:
        return {"schema": WATCH_DIFF_SCHEMA, "a": self.a, "b": self.b, "world": list(self.who),
                "steps": list(self.steps), "compared": list(self.compared), "not_compared": NOT_COMPARED,
                "setup": [{"headline": f.headline, "sub_cause": f.sub_cause, "step": f.step} for f in self.setup],
                "verdict": self.verdict.to_dict()}


@dataclass
class _Findings:
    lines: list[str] = field(default_factory=list)
    setup: list[Setup] = field(default_factory=list)


def _batch_lines(a: WatchedRun, b: WatchedRun, snapped: list[int], first: str | None) -> tuple[list[str], bool]:
    """At the snapshot steps, each run's batch rows at the first layer's input and whether the one of the larger
    world is a share of the other's: (lines, the global batches are the same size)."""
    wa, wb = world_of(a), world_of(b)
    sizes, shares = [], []
    for k in snapped:
        xa, xb = a.snapshot(k).get(f"in/{first}/0/0"), b.snapshot(k).get(f"in/{first}/0/0")
        if xa is None or xb is None or not xa.ndim or not xb.ndim:
            continue
        sizes.append((k, xa.shape[0], xb.shape[0]))
        small, big = (xa, xb) if wa > wb else (xb, xa)
        shares.append(_rows(small) <= _rows(big))
    if not sizes:
        return ["data: no snapshot step holds both runs' inputs: the global batch is not checked"], True
    k, na, nb = sizes[0]
    same = all(x * wa == y * wb for _, x, y in sizes)
    text = (f"data: at step {k} A's batch has {na} rows (x {wa} ranks = {na * wa}), B's {nb} (x {wb} = {nb * wb})"
            + (": the same global batch size" if same else ": not the same global batch size"))
    if all(shares):
        text += f"; at snapshot steps {', '.join(str(s) for s, *_ in sizes)} every row of the smaller share is " \
                "one of the other's"
    else:
        text += "; the smaller share holds rows the other's batch does not (another sample or order)"
    return [text], same


def _tensor_parting(a: WatchedRun, b: WatchedRun, snapped: list[int], dtypes: dict, tol: float) -> tuple | None:
    """(step, what, name, relative difference) of the first gradient or parameter at a snapshot step beyond ``tol``
    (at least ``PART_FACTOR`` roundoffs of its dtype)."""
    for k in snapped:
        sa, sb = a.snapshot(k), b.snapshot(k)
        for what in ("param", "grad"):
            for name, dtype in dtypes.items():
                x, y = sa.get(f"{what}/{name}"), sb.get(f"{what}/{name}")
                if x is None or y is None or x.shape != y.shape:
                    continue
                d = _rel(x, y) if np.isfinite(x).all() and np.isfinite(y).all() else math.inf
                if d > max(tol, PART_FACTOR * unit_roundoff_of(dtype)):
                    return k, what, name, d
    return None


def _parted(k: int, what: str, evidence: list[str], same_size: bool) -> Setup:
    cause = ("the global batch differs (another sample or order), or the gradients were not averaged across the "
             "ranks" if same_size else "the two runs do not train on the same global batch size")
    return Setup(f"{what} part from the other run's at step {k}, where DDP on the same global batch makes them "
                 f"equal: {cause}", "global batch", evidence=evidence,
                 remedies=[GLOBAL_BATCH, UNAVERAGED, *DATA_REMEDIES], step=k)


def _world_ok(ev: PairEvidence) -> Verdict:
    return Verdict("ok", "the runs agree where DDP makes a rank equal to a run on the same global batch (averaged "
                         "gradients, parameters, learning rates, recipe) within rounding; their batches, losses and "
                         "activations are each rank's share, not compared")


def diff_worlds(path_a, path_b) -> WorldDiff:
    """A DDP rank against a run of another world size (one process, or another DDP run's rank): what DDP makes
    equal on the same global batch compared, the verdict asked of ``diagnose/`` (rule W001, else ``ok``)."""
    a, b = open_watched(path_a), open_watched(path_b)
    for run in (a, b):
        if not run.steps:
            raise UsageError(f"watched run {run.path} recorded no step")
    pa = [(p["name"], p["shape"]) for p in a["model"]["parameters"]]
    if pa != [(p["name"], p["shape"]) for p in b["model"]["parameters"]]:
        raise UsageError(f"the watched runs did not watch the same model: {a.path} and {b.path} hold other parameters")
    steps = min(len(a.steps), len(b.steps))
    dtypes = {p["name"]: p.get("dtype", "float32") for p in a["model"]["parameters"]}
    tol = max(BACKWARD_RTOL, PART_FACTOR * max((unit_roundoff_of(t) for t in dtypes.values()), default=0.0))
    snapped = sorted({s["step"] for s in a["snapshots"]} & {s["step"] for s in b["snapshots"]} & set(range(steps)))
    layers = a.steps[snapped[0]]["layers"] if snapped else {}
    lines, same_size = _batch_lines(a, b, snapped, next(iter(layers), None))
    setup = [f for f in setup_findings(a, b, steps) if f.sub_cause not in SHARES]
    k = gradient_parting(a, b, steps, tol)
    if k is not None:
        ga, gb = a.steps[k]["grad_norms"], b.steps[k]["grad_norms"]
        name = max((n for n in ga if n in gb), key=lambda n: abs(ga[n] - gb[n]) / max(ga[n], gb[n], 1e-30))
        lines.append(f"gradients: part at step {k}: {name}'s norm {ga[name]:.6g} | {gb[name]:.6g}")
        if not any((f.step or 0) <= k for f in setup):  # not a consequence of a difference found before
            setup.append(_parted(k, "the averaged gradients", [lines[-1], lines[0]], same_size))
    else:
        lines.append(f"gradients: the norms agree within {tol:.3g} (relative) at every one of {steps} steps")
    found = _tensor_parting(a, b, snapped, dtypes, tol)
    if found is not None:
        s, what, name, d = found
        one, what = ("parameter", "the parameters") if what == "param" else ("gradient", "the gradients")
        lines.append(f"snapshots: {one} {name} differs by {d:.3g} (relative, element by element) at step {s}")
        if (k is None or s < k) and not any((f.step or 0) <= s for f in setup):
            setup.append(_parted(s, what, [lines[-1], lines[0]], same_size))
    elif snapped:
        lines.append(f"snapshots: the parameters and gradients agree element by element within {tol:.3g} at steps "
                     + ", ".join(map(str, snapped)))
    ev = PairEvidence(steps=(len(a.steps), len(b.steps)), setup=tuple(setup))
    return WorldDiff(str(a.path), str(b.path), (describe(a), describe(b)), ev.steps, tuple(lines), tuple(setup),
                     decide(ev, _world_ok), tol)
