"""The verdict of a watched-run diff, in ``compare``'s categories (``diagnose/verdict.py``).

In order: different data (``setup``), non-finite values on one side or from different producers
(``numerics``), a parting beyond rounding explained by different precisions (``numerics``), by different
stacks (``version``), or by nothing recorded (``nondeterminism``); otherwise ``ok``."""

from __future__ import annotations

from dataclasses import dataclass

from convcheck.diagnose.verdict import Verdict

DATA_REMEDIES = ["give the DataLoader a seeded generator (DataLoader(..., generator=torch.Generator().manual_seed(s)))"
                 " and its workers a worker_init_fn, or call convcheck.seed_everything(seed) before building it",
                 "check the sampler (shuffle=, DistributedSampler.set_epoch) and num_workers are the same on both"]


@dataclass(frozen=True)
class Parting:
    """Where two watched runs part beyond rounding: the step, the layer, and by how much."""

    step: int
    layer: str
    why: str


def producer_text(p: dict) -> str:
    return f"{p['layer']} ({p['kind']}, {p['direction']}) at step {p['step']}" + (
        f": {p['detail']}" if p.get("detail") else "")

DETERMINISM_REMEDIES = ["torch.use_deterministic_algorithms(True) and torch.backends.cudnn.benchmark = False "
                        "on both sides (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA)"]
VERSION_REMEDIES = ["run both sides with the same torch / CUDA / cuDNN build, then diff again"]


def _dtypes(run, step: int) -> set[str]:
    return {r["dtype"] for r in run.steps[step]["layers"].values()} if run.steps else set()


def _precision(d, a, b) -> str | None:
    """Why the two runs compute at different precisions, or None."""
    da, db = _dtypes(a, 0), _dtypes(b, 0)
    if da != db:
        return f"A's layers output {', '.join(sorted(da))}, B's {', '.join(sorted(db))}"
    tf32 = [f"{k}: {x} | {y}" for k, x, y in d.flags if "tf32" in k.lower() or "precision" in k]
    return "the TF32 switches differ (" + "; ".join(tf32) + ")" if tf32 else None


def _nonfinite(d) -> Verdict | None:
    pa, pb = d.producers
    if pa is None and pb is None:
        return None
    if pa is not None and pb is not None and (pa["layer"], pa["step"]) == (pb["layer"], pb["step"]):
        return None
    side, p = ("B", pb) if pa is None or (pb is not None and pb["step"] < pa["step"]) else ("A", pa)
    other = "A" if side == "B" else "B"
    state = "stays finite" if d.producers["AB".index(other)] is None else "turns non-finite later or elsewhere"
    return Verdict("numerics", f"{side} turns non-finite at step {p['step']} in {p['layer']} "
                               f"({p['kind']}, {p['direction']}); {other} {state}",
                   evidence=[f"first non-finite in {side}: {producer_text(p)}"] + _parting_lines(d),
                   remedies=["keep that layer's operation in float32 (autocast(enabled=False) around it), or "
                             "rescale its operands (e.g. divide the scores by sqrt(d) before the matmul)"],
                   target=side, layer=p["layer"], sub_cause="overflow" if p["direction"] == "forward" else "backward")


def _parting_lines(d) -> list[str]:
    if d.parting is None:
        return []
    return [f"the runs part at step {d.parting.step} in {d.parting.layer}: {d.parting.why}"]


def decide(d, a, b) -> Verdict:
    if d.data_step is not None:
        return Verdict("setup", f"the runs did not see the same data: different data from step {d.data_step} "
                                "(batch hashes differ)",
                       evidence=[f"batch hashes of step {d.data_step} differ; a loader, sampler or worker-seeding "
                                 "difference, not the numerics"] + _parting_lines(d),
                       remedies=list(DATA_REMEDIES), sub_cause="data order")
    found = _nonfinite(d)
    if found is not None:
        return found
    part = d.parting
    if part is None and d.loss_step is not None:
        part = Parting(d.loss_step, "the loss", "the losses differ by more than 1e-3 (relative)")
    if part is None:
        extra = [f"A ran {d.steps[0]} steps, B {d.steps[1]}: compared the first {min(d.steps)}"] \
            if d.steps[0] != d.steps[1] else []
        return Verdict("ok", "the two watched runs agree within rounding at every aligned step", evidence=extra)
    where = f"the runs part at step {part.step} in {part.layer}"
    lines = [f"{where}: {part.why}"]
    why = _precision(d, a, b)
    if why is not None:
        return Verdict("numerics", f"{where}: they compute at different precisions", evidence=lines + [why],
                       remedies=["run that layer in float32 on the lower-precision side, or check it against "
                                 "the float64 judge with convcheck compare"], layer=part.layer,
                       sub_cause="precision")
    if d.env:
        return Verdict("version", f"{where}; the stacks differ", evidence=lines + [
            f"{x.field}: {x.left} | {x.right} ({x.why})" for x in d.env], remedies=list(VERSION_REMEDIES),
            layer=part.layer)
    return Verdict("nondeterminism", f"{where} with the same data, precision and stack", evidence=lines,
                   remedies=list(DETERMINISM_REMEDIES), layer=part.layer)
