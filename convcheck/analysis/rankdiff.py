"""``convcheck diff`` of watched DDP runs (``ranks.py``): rank by rank, and across the ranks of each run.

Two DDP runs (folders of ``rank0/`` .. ``rank<N-1>/``, the same N) are diffed rank k against rank k with
``diff.diff_watched``. Within each run, every rank is held against rank 0: the ranks see different
batches by design (the sampler shards the data), so their batch hashes, losses and activations are not
compared; what DDP makes equal is: the parameters (at the steps both snapshotted), the averaged
gradients' norms at every step (within ``PART_FACTOR`` roundoffs of the parameter's dtype) and the
learning rates. A rank whose gradients part from rank 0's was not averaged with it (the model not
wrapped in DDP, ``no_sync()`` left on, a parameter outside the reduction): a ``setup`` finding, as is
every rank seeing the same batches (no ``DistributedSampler``). ``diff RUN/rank0 RUN/rank1`` (two ranks of
one run) is that across-ranks check alone, never a "different data" finding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from convcheck.runformat.schema import WATCH_DIFF_SCHEMA
from convcheck.diagnose.registry import decide as choose
from convcheck.diagnose.rules.watched_ranks import ranks_otherwise
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import RankEvidence, RankFinding
from convcheck.errors import UsageError
from convcheck.report.verdict_lines import verdict_lines
from convcheck.numerics.formats import unit_roundoff_of
from convcheck.numerics.thresholds import PART_FACTOR
from convcheck.analysis.diff import WatchDiff, diff_watched
from convcheck.runformat.ranks import RANK_DIR, rank_folders
from convcheck.runformat.reader import WatchedRun, open_watched


def _distributed(run: WatchedRun) -> dict:
    d = run.manifest.get("distributed")
    if not (isinstance(d, dict) and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool)
                                        for k in ("rank", "world_size"))
            and 0 <= d["rank"] < d["world_size"] <= 10**6):
        raise UsageError(f"watched run {run.path}: its manifest has no valid distributed rank "
                         "(it was not watched under torch.distributed)")
    return d


def _unit(dtypes: dict, name: str) -> float:
    return unit_roundoff_of(dtypes.get(name, "float32"))


def _rel(x: float, y: float) -> float:
    if x == y:
        return 0.0
    scale = max(abs(x), abs(y))
    return abs(x - y) / scale if scale > 0 and math.isfinite(scale) else math.inf


def against(ref: WatchedRun, other: WatchedRun, run: str) -> list[RankFinding]:
    """What rank ``other`` of a DDP run does differently from ``ref`` (rank 0) where DDP makes them equal."""
    r0, rk = _distributed(ref)["rank"], _distributed(other)["rank"]
    if [(p["name"], p["shape"]) for p in ref["model"]["parameters"]] != \
            [(p["name"], p["shape"]) for p in other["model"]["parameters"]]:
        raise UsageError(f"watched runs {ref.path} and {other.path} are ranks of one run with different models")
    dtypes = {p["name"]: p.get("dtype", "float32") for p in ref["model"]["parameters"]}
    found = []

    def add(step, kind, text):
        found.append(RankFinding(run, rk, r0, step, kind, text))

    if len(ref.steps) != len(other.steps):
        add(None, "steps", f"{len(other.steps)} steps recorded, rank {r0} {len(ref.steps)}: compared the first "
                           f"{min(len(ref.steps), len(other.steps))}")
    steps = min(len(ref.steps), len(other.steps))
    snapped = {s["step"] for s in ref["snapshots"]} & {s["step"] for s in other["snapshots"]}
    for k in range(steps):
        if k in snapped:
            sa, sb = ref.snapshot(k), other.snapshot(k)
            for name in dtypes:
                x, y = sa.get(f"param/{name}"), sb.get(f"param/{name}")
                if x is not None and y is not None and x.shape == y.shape and not np.array_equal(x, y):
                    d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                    add(k, "parameters", f"parameter {name} differs at the start of step {k} (max |difference| "
                                         f"{d:.3g}): the ranks no longer hold the same model")
                    return found
        a, b = ref.steps[k], other.steps[k]
        if a["lr"] != b["lr"]:
            add(k, "lr", f"learning rates {b['lr']} at step {k}, rank {r0} {a['lr']}")
            return found
        for name, x in a["grad_norms"].items():
            y = b["grad_norms"].get(name)
            if y is None:
                add(k, "gradients", f"no gradient for {name} at step {k}, rank {r0} has one")
                return found
            d = _rel(x, y)
            if d > PART_FACTOR * _unit(dtypes, name):
                add(k, "gradients", f"the gradient of {name} at step {k} has norm {y:.6g}, rank {r0}'s {x:.6g} "
                                    f"({d:.3g} relative): the gradients were not averaged across the ranks, so "
                                    "the ranks' parameters part after this step")
                return found
    hashes = [(ref.steps[k]["batch_sha256"], other.steps[k]["batch_sha256"]) for k in range(steps)]
    if hashes and all(x and x == y for x, y in hashes):
        add(0, "same data", f"the same batches as rank {r0} at every step: the data is not sharded across the "
                            "ranks (each rank trains on the same batches)")
    return found


def epoch_repeat(run: WatchedRun) -> int | None:
    """The length of an epoch when the run's batches repeat in the same order epoch after epoch: the smallest
    P whose first P batches are all different and every step k's batches are step k+P's (at least one whole
    epoch repeated); None otherwise."""
    hashes = [tuple(s["batch_sha256"]) for s in run.steps]
    n = len(hashes)
    for p in (k for k in range(2, n // 2 + 1) if hashes[k] == hashes[0] and hashes[0]):
        if len(set(hashes[:p])) == p and all(hashes[k] == hashes[k + p] for k in range(n - p)):
            return p
    return None


def across(runs: list[WatchedRun], label: str) -> list[RankFinding]:
    """Every rank of one DDP run against rank 0 (the first of ``runs``); and rank 0's epochs in one order."""
    worlds = {_distributed(r)["world_size"] for r in runs}
    if len(worlds) != 1:
        raise UsageError(f"{label}: its ranks report different world sizes ({', '.join(map(str, sorted(worlds)))})")
    found = [f for r in runs[1:] for f in against(runs[0], r, label)]
    sampler = runs[0].manifest.get("sampler")
    told_no_epoch = isinstance(sampler, dict) and sampler.get("shuffle") is True and len(sampler.get("epochs") or []) <= 1
    p = epoch_repeat(runs[0]) if told_no_epoch else None  # shuffle=False repeats its order by choice
    if p is not None:
        r0 = _distributed(runs[0])["rank"]
        found.append(RankFinding(label, r0, r0, p, "epoch order",
                                 f"the same batches in the same order every epoch: steps {p}.. repeat steps 0..{p - 1}; "
                                 "its DistributedSampler shuffles but was told one epoch only"))
    return found


@dataclass(frozen=True)
class RankedDiff:
    a: str
    b: str
    world: int
    per_rank: list[WatchDiff] = field(default_factory=list)
    findings: list[RankFinding] = field(default_factory=list)
    verdict: Verdict | None = None

    def __bool__(self) -> bool:
        return self.verdict is not None and self.verdict.category == "ok"

    def lines(self) -> list[str]:
        if not self.per_rank:
            out = [f"ranks of one DDP run: A = {self.a}, B = {self.b} (world size {self.world})"]
        else:
            out = [f"DDP runs: A = {self.a}, B = {self.b}, {self.world} ranks each, diffed rank by rank"]
        explained = any(f.kind != "steps" for f in self.findings)
        for k, d in enumerate(self.per_rank):
            note = " (a consequence of the finding across ranks below)" if explained and not d else ""
            out.append(f"rank {k}: {d.verdict.category}: {d.verdict.headline}{note}")
        if self.per_rank:
            for run in ("A", "B"):
                mine = [f for f in self.findings if f.run == run]
                out.append(f"across the ranks of {run}: " + ("the parameters, averaged gradients and learning "
                                                            "rates agree at every step" if not mine else
                                                            f"{len(mine)} finding(s) against rank 0"))
        v = self.verdict
        out += [f"  - {f.line()}" for f in self.findings if f.line() not in v.evidence]
        out += verdict_lines(v, "diff")
        return out

    def to_dict(self) -> dict:
        return {"schema": WATCH_DIFF_SCHEMA, "a": self.a, "b": self.b, "world_size": self.world,
                "per_rank": [d.to_dict() for d in self.per_rank],
                "across_ranks": [vars(f) for f in self.findings], "verdict": self.verdict.to_dict()}


def _decide(findings: list[RankFinding], per_rank: list[WatchDiff]) -> Verdict:
    """The verdict, asked of ``diagnose/``: the across-ranks rules, else the first rank pair's own verdict."""
    return choose(RankEvidence(tuple(findings), tuple(d.verdict for d in per_rank)), ranks_otherwise)


def _worlds(path_a, path_b) -> tuple[int, int] | None:
    """The world sizes of two watched runs when they differ (a DDP rank against one process), else None (or
    when either is no readable run: the plain diff says why)."""
    from convcheck.analysis.worlddiff import world_of

    try:
        wa, wb = world_of(open_watched(path_a)), world_of(open_watched(path_b))
    except Exception:  # noqa: BLE001 - routing only: the diff that follows reports an unreadable run
        return None
    return (wa, wb) if wa != wb else None


def is_ranked_pair(path_a, path_b) -> bool:
    """Whether ``diff PATH_A PATH_B`` is a DDP diff: either is a folder of rank folders, or the two are
    rank folders of one run (``RUN/rank0 RUN/rank1``)."""
    if rank_folders(path_a) is not None or rank_folders(path_b) is not None:
        return True
    if _worlds(path_a, path_b) is not None:  # a DDP rank against one process (``worlddiff.py``)
        return True
    a, b = Path(path_a), Path(path_b)
    try:
        same = a.resolve().parent == b.resolve().parent and a.resolve() != b.resolve()
    except OSError:
        return False
    return same and all(RANK_DIR.fullmatch(p.name) for p in (a, b))


def diff_ranked(path_a, path_b, judge: str | None = None):
    """Two DDP runs rank by rank (and each run's ranks against its rank 0), two ranks of one run, or a rank against a
    run of another world size (``worlddiff.WorldDiff``);
    ``judge``: the float64 target that replays each rank pair's snapshot steps (``diff.diff_watched``)."""
    fa, fb = rank_folders(path_a), rank_folders(path_b)
    if fa is None and fb is None and _worlds(path_a, path_b) is not None:
        from convcheck.analysis.worlddiff import diff_worlds

        return diff_worlds(path_a, path_b)  # a DDP rank against a run of another world size
    if fa is None and fb is None:  # two ranks of one run
        ra, rb = open_watched(path_a), open_watched(path_b)
        world = _distributed(ra)["world_size"]
        findings = across([ra, rb], str(Path(path_a).parent))
        return RankedDiff(str(path_a), str(path_b), world, [], findings, _decide(findings, []))
    if fa is None or fb is None:
        single, ranked = (path_a, path_b) if fa is None else (path_b, path_a)
        raise UsageError(f"diff: {ranked} is a DDP run (one folder per rank) and {single} one process's run; diff two DDP runs "
                         f"with the same number of ranks, or one rank of each (e.g. {Path(ranked) / 'rank0'})")
    if len(fa) != len(fb):
        raise UsageError(f"diff: {path_a} ran on {len(fa)} ranks and {path_b} on {len(fb)}; diff them rank by "
                         f"rank needs the same number (or diff one rank of each: {fa[0]} {fb[0]})")
    runs_a, runs_b = [open_watched(p) for p in fa], [open_watched(p) for p in fb]
    for k, (x, y) in enumerate(zip(runs_a, runs_b)):
        for r, p in ((x, fa[k]), (y, fb[k])):
            if _distributed(r)["rank"] != k:
                raise UsageError(f"watched run {p}: its manifest says rank {_distributed(r)['rank']}, not {k}")
    findings = across(runs_a, "A") + across(runs_b, "B")
    per_rank = [diff_watched(x, y, judge=judge) for x, y in zip(fa, fb)]
    return RankedDiff(str(path_a), str(path_b), len(fa), per_rank, findings, _decide(findings, per_rank))
