"""``diff``: a ``CompareResult`` rebuilt from two bundles and a judge, diagnosed like ``compare``'s.

The two bundles must have run the same model (spec and source hash), the same initial weights,
the same batches and the same options: a mismatch is a one-line ``UsageError`` saying what differs.
The judge is re-run here (``cpu:float64``: the model rebuilt from its spec, the batches regenerated
from the recorded data spec and seed, every hash checked) or read from a recorded float64 bundle;
each side's per-layer propagated errors are recomputed from its recorded arrays against it. The
local / intrinsic columns and the training curves are those recorded on each side (against the
judge of that side's machine). The distance between the two targets at each step comes from the
parameter snapshots both sides hold. Each side's environment is audited, and the two are diffed.
"""

from __future__ import annotations

import torch

from convcheck.bundle.common import JudgeRecord, config_of  # noqa: F401 - config_of re-exported
from convcheck.bundle.reader import Bundle
from convcheck.errors import UsageError

_SAME = ("init_sha256", "batches_sha256", "data_source")


class DifferentInputs(Exception):
    """Two recordings of one command that did not see the same data or start from the same weights: a finding
    (``verdict``, ``setup``, exit 1), as for two watched runs - not a usage error."""

    def __init__(self, verdict):
        super().__init__(verdict.headline)
        self.verdict = verdict


def input_difference(a: Bundle, b: Bundle):
    """The ``setup`` verdict naming what two bundles of the same command saw differently (their data, then their
    initial weights), chosen by the watched runs' rule W001 (one policy for both); None when they saw the same."""
    from convcheck.diagnose.registry import decide
    from convcheck.diagnose.remedies import BUNDLE_DATA_REMEDIES, BUNDLE_INIT_REMEDIES
    from convcheck.diagnose.rules.watched import watched_ok
    from convcheck.diagnose.watched_evidence import PairEvidence, Setup

    na, nb = str(a.path), str(b.path)
    found = []
    if a["data_source"] != b["data_source"] or a["batches_sha256"] != b["batches_sha256"]:
        what = (f"{na} read {a['data_source']}, {nb} {b['data_source']}" if a["data_source"] != b["data_source"]
                else f"the same source ({a['data_source']}), other batches")
        found.append(Setup(f"the runs did not see the same data: {what}", "data",
                           [f"batches (SHA-256 over all): {a['batches_sha256'][:16]} | {b['batches_sha256'][:16]}"],
                           list(BUNDLE_DATA_REMEDIES), step=0))
    if a["init_sha256"] != b["init_sha256"]:
        found.append(Setup("different initial weights: the recorded initial state differs, before any update",
                           "initial weights", [f"initial weights (SHA-256): {a['init_sha256'][:16]} | "
                                               f"{b['init_sha256'][:16]}"], list(BUNDLE_INIT_REMEDIES), step=0))
    if not found:
        return None
    return decide(PairEvidence(setup=tuple(found)), watched_ok)


def _differs(what: str, a, b, na: str, nb: str) -> UsageError:
    return UsageError(f"the bundles did not run the same {what}: {na} has {a!r}, {nb} has {b!r}")


def check_same_run(a: Bundle, b: Bundle) -> None:
    """Same model, options, code and tolerances, or a one-line error naming the first difference (two different
    commands: nothing to diagnose); then the same data and initial weights, or ``DifferentInputs`` (a finding)."""
    na, nb = str(a.path), str(b.path)
    ma, mb = a["model"], b["model"]
    if ma["spec"] != mb["spec"]:
        raise _differs("model", ma["spec"], mb["spec"], na, nb)
    if ma.get("source_sha256") and mb.get("source_sha256") and ma["source_sha256"] != mb["source_sha256"]:
        raise _differs("model source (SHA-256 of the file)", ma["source_sha256"][:12], mb["source_sha256"][:12],
                       na, nb)
    for key in sorted(set(a["config"]) | set(b["config"])):
        if a["config"].get(key) != b["config"].get(key):
            raise _differs(f"options ({key})", a["config"].get(key), b["config"].get(key), na, nb)
    for option in sorted(set(a["code_sha256"]) | set(b["code_sha256"])):
        ha, hb = a["code_sha256"].get(option), b["code_sha256"].get(option)
        if ha != hb:
            raise _differs(f"{option} code (SHA-256 of the file)", (ha or "none")[:12], (hb or "none")[:12], na, nb)
    if a["tolerances"] != b["tolerances"]:
        raise _differs("tolerances", a["tolerances"], b["tolerances"], na, nb)
    check_init_claims(a, b)
    verdict = input_difference(a, b)
    if verdict is not None:
        raise DifferentInputs(verdict)


# how close two recordings of the same initial weights are, in units of the coarser format's unit roundoff: one
# rounding each way (a float64 weight rounded to bfloat16 directly, or through float32) - other weights differ by
# their own size
_SAME_INIT_ROUNDOFFS = 2.0


def check_init_claims(a: Bundle, b: Bundle) -> None:
    """Manifests that claim other initial weights (``init_sha256``) than the ones both bundles recorded (the step-0
    parameter snapshots, the same values up to the coarser format's rounding) were edited or damaged: a one-line
    ``UsageError`` (exit 2), not a ``setup`` finding. Nothing is said when the claims agree, or when either bundle
    holds no step-0 snapshot to hold its claim against."""
    import numpy as np

    from convcheck.numerics.formats import unit_roundoff_of

    if a["init_sha256"] == b["init_sha256"]:
        return
    pa, pb = a["arrays"]["parameters"], b["arrays"]["parameters"]
    if [(p["name"], p["shape"]) for p in pa] != [(p["name"], p["shape"]) for p in pb] or not pa:
        return
    sa, sb = a.snapshot(0), b.snapshot(0)
    if sa is None or sb is None:
        return
    for xa, xb, da, db in zip(sa, sb, pa, pb):
        u = max(unit_roundoff_of(da["dtype"]), unit_roundoff_of(db["dtype"]))
        xa, xb = xa.astype(np.float64), xb.astype(np.float64)
        if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
            return
        if (np.abs(xa - xb) > _SAME_INIT_ROUNDOFFS * u * np.maximum(np.abs(xa), np.abs(xb))).any():
            return  # other weights indeed: the setup finding
    raise UsageError(f"the bundles' manifests claim other initial weights (init_sha256 {a['init_sha256'][:12]} in "
                     f"{a.path}, {b['init_sha256'][:12]} in {b.path}) than the step-0 parameters both recorded, which "
                     "are the same: a manifest was edited or damaged; record the run again")


def judge_here(a: Bundle, judge_spec: str | None, input_shape=None, num_classes=None) -> JudgeRecord:
    """Re-run the judge on this machine from the recorded model spec, seed and data spec: the stages of
    ``compare`` (``convcheck.stages``) with the judge alone, every recorded hash checked on the way."""
    from convcheck.bundle.record import source_sha256
    from convcheck.plan.seeded_data import hash_state_dict
    from convcheck.measure.parity.judge_pass import run_judge
    from convcheck.stages import caller_rng_kept, guarded, measure_loss_reduction, prepare, resolve
    from convcheck.targets.spec import default_judge, parse_judge

    judge, reason = (parse_judge(judge_spec), "re-run here (--judge)") if judge_spec else default_judge()
    check_code(a)
    m = a["model"]
    shape = tuple(m["input_shape"]) if m.get("input_shape") else input_shape
    cfg = config_of(a, None, judge)
    with caller_rng_kept(), guarded(None, cfg.steps):
        resolved = resolve(m["spec"], cfg, input_shape=shape, num_classes=m.get("num_classes") or num_classes,
                           targets_needed=0)
        here = source_sha256(resolved.model)
        if m.get("source_sha256") and here and here != m["source_sha256"]:
            raise UsageError(f"model {m['spec']}: its source file here (SHA-256 {here[:12]}) is not the one "
                             f"recorded ({m['source_sha256'][:12]})")
        run = prepare(resolved)
        if hash_state_dict(run.initial_state) != a["init_sha256"]:
            raise UsageError(f"the initial weights built here (seed {cfg.seed}) differ from the recorded ones "
                             "(SHA-256 of the weights)")
        first = run.data.first()
        _check_batches(run.data, a, cfg)
        torch.manual_seed(cfg.seed)
        calls, _, grads, _ = run_judge(run.build(judge), first, judge.runner, cfg.seed, run.recipe.loss)
        ratio = measure_loss_reduction(run, first)
    return JudgeRecord(str(judge), reason, {k: c.output for k, c in calls.items()}, grads, ratio, run.model,
                       run.recipe)


def _check_batches(stream, a: Bundle, cfg) -> None:
    """Every batch regenerated here hashes as recorded (one line naming the first that does not)."""
    recorded = a["batch_sha256"]
    for step, _ in enumerate(stream):
        if step < len(recorded) and stream.hashes[step] != recorded[step]:
            raise UsageError(f"batch {step} regenerated here from {cfg.data or 'synthetic'} with seed "
                             f"{cfg.seed} differs from the recorded one (SHA-256 {stream.hashes[step][:12]} "
                             f"vs {recorded[step][:12]})")
    if stream.all_hash != a["batches_sha256"]:
        raise UsageError("the batches regenerated here differ from the recorded ones (SHA-256 over all)")


def check_code(bundle: Bundle) -> None:
    """Before anything is imported: every ``FILE.py`` the bundle names (model, data, loss, optimizer,
    schedule) must be here with the bytes it recorded, so a bundle can only run code already trusted here."""
    import hashlib
    from pathlib import Path

    from convcheck.bundle.record import code_files

    recorded = bundle["code_sha256"]
    for option, path in code_files(bundle["model"]["spec"], bundle["config"]).items():
        if option not in recorded:
            raise UsageError(f"bundle {bundle.path}: {option} {path} has no recorded SHA-256; refusing to run it")
        try:
            here = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError as exc:
            raise UsageError(f"{option} {path} (named by bundle {bundle.path}) cannot be read here "
                             f"({exc.strerror or exc}); re-running the judge needs it") from None
        if here != recorded[option]:
            raise UsageError(f"{option} {path} here (SHA-256 {here[:12]}) is not the file the bundle recorded "
                             f"({recorded[option][:12]}); refusing to run it")


def judge_from_bundle(j: Bundle, a: Bundle) -> JudgeRecord:
    """The judge's outputs from a bundle recorded with a float64 target."""
    if not j["target"].endswith("float64"):
        raise UsageError(f"--judge {j.path}: recorded target {j['target']}, not a float64 one")
    check = [k for k in _SAME if j[k] != a[k]]
    if check or j["model"]["spec"] != a["model"]["spec"]:
        raise UsageError(f"--judge {j.path} did not run the same {check[0] if check else 'model'} as {a.path}")
    j.check_arrays()
    outputs = {e["key"]: torch.from_numpy(j.forward(i)) for i, e in enumerate(j["arrays"]["forward"])}
    grads = {e["param"]: torch.from_numpy(j.grad(i)) for i, e in enumerate(j["arrays"]["grads"])}
    return JudgeRecord(j["target"], f"recorded in {j.path}", outputs, grads)


def diff_bundles(path_a, path_b, judge: str | None = None, labels: tuple[str, str] = ("A", "B")):
    """``(CompareResult, [fingerprint A, fingerprint B], env differences)`` of two recorded runs.

    The same target spec on both sides (``cuda`` recorded on two machines) is named ``cuda@A`` and
    ``cuda@B`` (``labels``). ``judge``: a float64 target spec to re-run here (default: this machine's default judge), or the path
    of a bundle recorded with a float64 target."""
    import os

    from convcheck.bundle.reader import open_bundle
    from convcheck.bundle.rebuild import build_result
    from convcheck.env.diff import diff as env_diff
    from convcheck.plan.models import ResolvedModel
    from convcheck.plan.recipe import build_recipe

    a, b = open_bundle(path_a), open_bundle(path_b)
    check_same_run(a, b)
    a.check_arrays()
    b.check_arrays()
    if judge is not None and (os.path.lexists(judge) or judge.endswith(".zip")):
        rec = judge_from_bundle(open_bundle(judge), a)
        m = a["model"]
        cfg = config_of(a, None, None)
        rec.resolved = ResolvedModel(name=m.get("name") or m["spec"], factory=_no_factory(m["spec"]),
                                     input_shape=tuple(m["input_shape"]) if m.get("input_shape") else None,
                                     num_classes=m.get("num_classes"), source="bundle", spec=m["spec"],
                                     task=m["task"])
        rec.recipe = build_recipe(cfg, m["task"])
    else:
        rec = judge_here(a, judge)
    result, fps = build_result(a, b, rec, rec.resolved, rec.recipe, labels)
    return result, fps, env_diff(fps[0], fps[1])


def _no_factory(spec: str):
    def factory():
        raise UsageError(f"model {spec} is not built here (the judge came from a bundle)")

    return factory
