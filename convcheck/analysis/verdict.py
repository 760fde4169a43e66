"""The verdict of watched runs, asked of ``diagnose/``: the measurements of ``diff.py`` and the detectors'
symptoms (``diagnose/detectors/watched.py``, ``watched_setup.py``) gathered into ``PairEvidence`` /
``RunEvidence``, then ``diagnose.registry.decide`` - the chooser ``compare`` and bundles use - runs the rules
that read them (``diagnose/rules/watched.py``, ``watched_run.py``). Nothing is decided here."""

from __future__ import annotations

from dataclasses import replace

from convcheck.diagnose.detectors.watched import (converges, first_nonfinite, precision_difference, random_layers,
                                                  scaled_backward)
from convcheck.diagnose.detectors.watched_setup import clip_before_unscale, compiled_random, divergence, eval_from
from convcheck.diagnose.detectors.watched_scaler import step_without_scaler
from convcheck.diagnose.registry import decide as choose
from convcheck.diagnose.remedies import only_used_formats
from convcheck.diagnose.rules.watched_coverage import pair_ok
from convcheck.diagnose.rules.watched_run import run_ok
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import PairEvidence, RunEvidence


def pair_evidence(d, a, b, runs: tuple[RunEvidence, RunEvidence] | None = None) -> PairEvidence:
    """What the rules read of two watched runs: ``d`` (``diff.WatchDiff``, its verdict not yet set), the runs
    themselves (``reader.WatchedRun``) and what each run shows on its own (``runs``: ``run_evidence`` of A and of
    B, the records their judge's rules read, gathered once and shared; gathered here when not given)."""
    ra, rb = runs or (run_evidence(a, d.replays[0], d.own[0], "A"), run_evidence(b, d.replays[1], d.own[1], "B"))
    return PairEvidence(
        steps=d.steps, data_step=d.data_step, parting=d.parting, loss_step=d.loss_step, loss_tol=d.loss_tol,
        loss_wander=d.loss_wander, producers=d.producers, replays=(ra.replay, rb.replay), setup=tuple(d.setup),
        stopped=(ra.stopped, rb.stopped), env=tuple(d.env), own=(ra.own, rb.own), outcome=d.outcome,
        cpu_repeatable=cpu_repeatable(a, b), hash_seeds=tuple(r["math_flags"].get("PYTHONHASHSEED") for r in (a, b)),
        precision=precision_difference(a, b, d.flags) or ("; ".join(d.policy) if d.policy else None),
        pair=d.pair, divergence=(ra.divergence, rb.divergence),
        scaled_backward=(ra.scaled_backward, rb.scaled_backward), converged=(ra.converged, rb.converged),
        truncated=(ra.truncated, rb.truncated), random_layers=random_layers(a),
        compiled_random=compiled_random(a, b, random_layers(a)))


def cpu_repeatable(a, b) -> bool:
    """Both runs on the CPU at the same thread count: torch's CPU kernels repeat themselves bitwise there."""
    devices = {str(r["model"].get("device", "")).split(":")[0] for r in (a, b)}
    threads = {r["math_flags"].get("threads") for r in (a, b)}
    return devices == {"cpu"} and len(threads) == 1


def size_cap(run) -> str | None:
    """The note the watch left when its size cap cut the record (``max_bytes``) - or an error in its own code
    (``watch_error``: the note says which) - or None."""
    if not run.manifest.get("truncated"):
        return None
    return next((n for n in run.manifest.get("notes", []) if n.startswith("recording stopped at step")),
                "recording stopped at its size cap (max_bytes)")


def run_evidence(run, replay, own=(), side: str = "the run") -> RunEvidence:
    """What the rules read of one watched run held against the judge (``replay``), gathered once: a pair's
    evidence takes each run's from here (``side`` "A" or "B" names it in the texts)."""
    setup = (step_without_scaler(run, "-"), clip_before_unscale(run, "-"))
    return RunEvidence(producer=first_nonfinite(run), replay=replay, divergence=divergence(run), own=tuple(own),
                       stopped=run.manifest.get("stopped"), scaled_backward=scaled_backward(run, side),
                       converged=converges(run), steps=len(run.steps), truncated=size_cap(run),
                       eval_from=eval_from(run), setup=tuple(f for f in setup if f is not None))


def formats_of(run) -> set[str]:
    """The reduced-precision formats ``run`` computed in (``diagnose.remedies.formats_named``'s names): its weights'
    and layers' dtypes, autocast, the loss's format, TF32 where a CUDA run allowed it."""
    names = {"float16": "float16", "bfloat16": "bfloat16"}
    dtypes = {p.get("dtype") for p in run.manifest.get("model", {}).get("parameters", []) if isinstance(p, dict)}
    for st in run.steps:
        dtypes.update(row.get("dtype") for row in (st.get("layers") or {}).values() if isinstance(row, dict))
        dtypes.update((st.get("autocast"), st.get("loss_dtype")))
    out = {names[d] for d in dtypes if d in names}
    flags = run.manifest.get("math_flags") or {}
    if str(run.manifest.get("model", {}).get("device", "")).startswith("cuda") and (
            flags.get("matmul.allow_tf32") is True or flags.get("cudnn.allow_tf32") is True
            or flags.get("float32_matmul_precision") in ("high", "medium")):
        out.add("tf32")
    return out


def _formats_kept(v: Verdict, used: set[str]) -> Verdict:
    """The one place a watched verdict's remedies are held to the formats its runs used (issue 43)."""
    kept = only_used_formats(v.remedies, used)
    return v if kept == list(v.remedies) else replace(v, remedies=kept)


def decide(d, a, b, runs: tuple[RunEvidence, RunEvidence] | None = None) -> Verdict:
    v = choose(pair_evidence(d, a, b, runs), pair_ok)  # ``watched_ok``, held against the judge's coverage
    return _formats_kept(v, formats_of(a) | formats_of(b))


def decide_single(run, replay, own=()) -> Verdict:
    return _formats_kept(choose(run_evidence(run, replay, own), run_ok), formats_of(run))
