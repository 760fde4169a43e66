"""``convcheck diff RUN_A RUN_B``: two recorded runs diagnosed like ``convcheck compare``'s pair.

Same report on the terminal (or ``--json``), same run folder (``summary.json``, ``layers.csv``, ...),
plus ``env_a.json``, ``env_b.json`` (each side's fingerprint) and ``env_diff.json`` (what differs).
"""

from __future__ import annotations

import argparse
import json
import sys

from convcheck.cli.run_paths import not_a_run, removed_if_empty


def add_diff_parser(sub, run) -> argparse.ArgumentParser:
    p = sub.add_parser("diff", help="diagnose two recorded runs (bundles from 'convcheck record' or runs from "
                                    "convcheck.watch), or one watched run against --judge",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", metavar="RUN_A", help="a bundle folder or .zip")
    p.add_argument("run_b", metavar="RUN_B", nargs="?", default=None,
                   help="a bundle folder or .zip (left out: one watched run diagnosed against --judge)")
    p.add_argument("--judge", default=None, metavar="SPEC|RUN_J",
                   help="a float64 target to re-run the judge here (default: this machine's judge), or a bundle "
                        "recorded with a float64 target; with one watched run, the judge it is diagnosed against "
                        "(e.g. cpu:float64)")
    p.add_argument("--trust-run", action="store_true",
                   help="watched runs: load the model the run recorded by value (a pickle, the script's classes) "
                        "even when it was not recorded by you on this machine; a run folder from elsewhere is code")
    p.add_argument("--backends", action="store_true",
                   help="watched runs compiled with torch.compile: re-run the recorded step under eager, aot_eager, "
                        "aot_eager_decomp_partition and inductor, name the first backend that changes the result, and "
                        "write a repro (repro_backends.py) into --out")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout instead of the report")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the report files there (default: two bundles: a new folder "
                        "reports/<UTC time, ms>-<model>/; watched runs: no files without --out)")
    p.add_argument("--csv", default=None, metavar="PATH",
                   help="with two watched runs: write the per-step, per-layer table (each output statistic's relative "
                        "error, B against A) to PATH as CSV, with --no-save too")
    p.add_argument("--force", action="store_true",
                   help="let --out replace the report files of an earlier run, and --csv an existing file")
    p.add_argument("--no-save", action="store_true", help="write no report files (the file --csv names is written)")
    p.add_argument("--debug", action="store_true", help="on an error, print the full traceback as well")
    p.set_defaults(func=run)
    return p


def run_diff(args) -> int:
    from convcheck.cli.diff_watched import run_watched, run_watched_diff, run_watched_judge, watch_judge
    from convcheck.errors import UsageError
    from convcheck.analysis.rankdiff import is_ranked_pair
    from convcheck.runformat.reader import schema_of

    if args.out is not None and not str(args.out).strip():
        raise UsageError("--out is empty: name a folder (or pass --no-save to write no files)")
    if args.no_save and args.out is not None:
        raise UsageError(f"--no-save writes no files, --out {args.out} writes them there: pass one of the two")
    csv = getattr(args, "csv", None)
    if args.run_b is None:
        if csv is not None:
            raise UsageError("--csv writes the table of two watched runs, B against A; diff RUN --judge has one run: "
                             "name a second run to tabulate")
        return run_watched_judge(args)
    if is_ranked_pair(args.run_a, args.run_b):  # watched under torchrun/DDP: one folder per rank
        from convcheck.analysis.rankdiff import diff_ranked

        if csv is not None:
            raise UsageError("--csv: a DDP diff (a folder per rank) is not one pair of runs: diff one rank folder of "
                             "each run for its table, e.g. convcheck diff RUN_A/rank0 RUN_B/rank0 --csv PATH")

        # rank by rank (each pair with --judge's replay) and across ranks, shown as any watched diff
        judge = watch_judge(args.judge)
        return run_watched(args, "watch_diff.json", lambda: diff_ranked(args.run_a, args.run_b, judge=judge))
    kinds = [schema_of(p) for p in (args.run_a, args.run_b)]
    if any(k == "convcheck.watch/1" for k in kinds):
        return run_watched_diff(args, kinds)
    for path in (args.run_a, args.run_b):  # neither is watched: a path that is no bundle at all said as such
        why = not_a_run(path, strict=False)
        if why:
            raise UsageError(why)
    if csv is not None:
        raise UsageError("--csv writes the table of two watched runs (convcheck.watch); of recorded runs, --out DIR "
                         "writes layers.csv")
    from convcheck.bundle.diff import DifferentInputs, diff_bundles
    from convcheck.report.folder import RunFolder

    folder = None
    if not args.no_save:
        folder = RunFolder.explicit(args.out, force=args.force) if args.out else None
    try:
        with removed_if_empty(folder):  # a bundle refused (or not paired): the --out folder this run made goes too
            result, fps, differences = diff_bundles(args.run_a, args.run_b, judge=args.judge)
    except DifferentInputs as found:  # a finding, as for watched runs: the verdict, exit 1, nothing paired
        return _show_inputs(found.verdict, args.run_a, args.run_b, args.json)
    result = _mark_diff(result, args.run_a, args.run_b)
    return _finish(result, fps, differences, folder, args)


def _show_inputs(verdict, run_a, run_b, as_json: bool) -> int:
    """Two bundles that saw different data or weights: the ``setup`` verdict alone (nothing to pair, no report)."""
    from convcheck.report.export import SUMMARY_SCHEMA
    from convcheck.report.verdict_lines import fit_prose, verdict_lines

    if as_json:  # compare's summary document, with the verdict only: nothing was paired
        print(json.dumps({"schema": SUMMARY_SCHEMA, "complete": True, "a": str(run_a), "b": str(run_b),
                          "verdict": verdict.to_dict()}, indent=2))
    else:
        print(fit_prose([f"recorded runs: A = {run_a}, B = {run_b}", *verdict_lines(verdict, "diff"),
                         "no report written: runs that saw different inputs are not compared step by step"],
                        sys.stdout))
    return 1


def _mark_diff(result, run_a, run_b):
    """The result as a diff of the two runs (``diff_of``: the reports title it so, ``report.text.is_diff``), with
    the note naming them."""
    from dataclasses import replace

    from convcheck.report.summary import DIFF_NOTE

    return replace(result, notes=[f"{DIFF_NOTE} {run_a} and {run_b}", *result.notes], diff_of=(str(run_a), str(run_b)))


def _show(result, differences, args) -> None:
    if args.json:
        from convcheck.report.export import summary_dict

        summary = summary_dict(result)
        summary.setdefault("complete", True)
        summary["env_diff"] = [d.to_dict() for d in differences]
        print(json.dumps(summary, indent=2))
        return
    from convcheck.report.text import make_console, render_compare

    console = make_console()
    render_compare(result, console)
    if differences:
        console.print(f"environments of {result.config.targets[0]} and {result.config.targets[1]} differ in:")
        for d in differences:
            console.print(f"  {d.field}: {d.left} | {d.right}", markup=False, highlight=False)
    else:
        console.print("the two environments match in every recorded field")


def _write(result, fps, differences, folder, force: bool) -> None:
    from convcheck.files import atomic_write_text
    from convcheck.report.export import write_run

    try:
        path = folder.ensure()
        written = write_run(result, path, force=force)
        for name, data in (("env_a.json", fps[0].to_dict()), ("env_b.json", fps[1].to_dict()),
                           ("env_diff.json", [d.to_dict() for d in differences])):
            written.append(atomic_write_text(path / name, json.dumps(data, indent=2) + "\n"))
    except BaseException:
        folder.discard_if_empty()
        raise
    from convcheck.report.verdict_lines import fit_prose, wrote_line

    print(fit_prose([wrote_line(path, [p.name for p in written])], sys.stderr), file=sys.stderr)


def run_against(args) -> int:
    """``compare --against RUN --targets SPEC``: record SPEC here with RUN's model and options (in a
    temporary folder), then diff the two like ``convcheck diff RUN HERE``."""
    from convcheck.bundle.diff import DifferentInputs, config_of
    from convcheck.bundle.reader import open_bundle
    from convcheck.errors import UsageError
    from convcheck.report.folder import RunFolder

    why = not_a_run(args.against, strict=False)  # a report folder, a FIFO: said as diff says it
    if why:
        raise UsageError(why.replace("diff: ", "--against ", 1).replace("diff reads", "--against reads"))
    recorded = open_bundle(args.against)
    spec = args.targets
    if not spec or "," in spec:
        raise UsageError("--against RUN runs one target here: give it with --targets SPEC (e.g. --targets cuda)")
    if args.model != "lenet" and not same_model(args.model, recorded["model"]["spec"]):
        raise UsageError(f"--model {args.model}: the run in {args.against} recorded {recorded['model']['spec']}")
    folder = None
    if args.out is not None and not str(args.out).strip():
        raise UsageError("--out is empty: name a folder (or pass --no-save to write no files)")
    if not args.no_save:
        folder = RunFolder.explicit(args.out, force=args.force) if args.out else None
    shape, classes = _recorded_io(recorded["model"], args)
    _same_source_here(recorded["model"], (recorded["code_sha256"] or {}).get("model"), args.against)
    cfg = config_of(recorded, None, args.judge)
    try:
        return _against(args, spec, recorded, cfg, shape, classes, folder)
    except DifferentInputs as found:
        return _show_inputs(found.verdict, args.against, f"{spec} (here)", args.json)


def _against(args, spec, recorded, cfg, shape, classes, folder) -> int:
    """``compare --against``'s run here and its diff against the recorded bundle (``DifferentInputs`` raised)."""
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from convcheck.bundle.diff import DifferentInputs, diff_bundles
    from convcheck.bundle.record import record_run
    from convcheck.errors import UsageError

    with removed_if_empty(folder), tempfile.TemporaryDirectory(prefix="convcheck-against-") as tmp:
        here = Path(tmp) / "here"
        here.mkdir()
        record_run(recorded["model"]["spec"], spec, cfg, here, snapshot_steps=None, input_shape=shape,
                   num_classes=classes)
        try:
            result, fps, differences = diff_bundles(args.against, here, judge=args.judge)
        except UsageError as e:  # the run made here is no folder of the user's: name it as they asked for it
            raise UsageError(str(e).replace(str(here), f"{spec} (here)")) from None
        except DifferentInputs as found:  # a finding (shown below, exit 1), the run made here named as asked for
            v = found.verdict
            named = lambda t: t.replace(str(here), f"{spec} (here)")  # noqa: E731
            raise DifferentInputs(replace(v, headline=named(v.headline), evidence=[named(e) for e in v.evidence]))
    result = _mark_diff(result, args.against, f"{spec} (here)")
    return _finish(result, fps, differences, folder, args)


def _same_source_here(model: dict, code_sha: str | None, against) -> None:
    """A ``FILE.py:factory`` model whose file here is not the one recorded is refused before anything runs
    (the diff would refuse it after a whole recording)."""
    import hashlib
    from pathlib import Path

    from convcheck.errors import UsageError

    file, _, _ = str(model.get("spec", "")).rpartition(":")
    recorded = model.get("source_sha256") or code_sha
    path = Path(file).expanduser()
    if not recorded or not file.endswith(".py") or not path.is_file():
        return
    here = hashlib.sha256(path.read_bytes()).hexdigest()
    if here != recorded:
        raise UsageError(f"model {model['spec']}: its file here (SHA-256 {here[:12]}) is not the one the run in "
                         f"{against} recorded ({recorded[:12]}): compare the same code")


def _recorded_io(model: dict, args) -> tuple:
    """The input shape and class count the recorded run used (its manifest's), else ``--input-shape`` /
    ``--classes``; a given value the run did not record with is refused: the two sides must see the same
    inputs."""
    from convcheck.errors import UsageError
    from convcheck.plan.models import parse_input_shape

    shape = tuple(model["input_shape"]) if model.get("input_shape") else None
    classes = model.get("num_classes")
    given = parse_input_shape(args.input_shape) if getattr(args, "input_shape", None) else None
    if given is not None and shape is not None and given != shape:
        raise UsageError(f"--input-shape {'x'.join(map(str, given))}: the run in {args.against} was recorded with "
                         f"input {'x'.join(map(str, shape))}")
    asked = getattr(args, "classes", None)
    if asked is not None and classes is not None and asked != classes:
        raise UsageError(f"--classes {asked}: the run in {args.against} was recorded with {classes} classes")
    return shape or given, classes if classes is not None else asked


def same_model(given: str, recorded: str) -> bool:
    """``given`` (``--model`` or ``[tool.convcheck]``'s, which the project file makes absolute) names the
    recorded model: the same text, or the same ``FILE.py:factory`` with the recorded file relative to where it
    was recorded (its path a tail of the given one's)."""
    from pathlib import Path

    if given == recorded:
        return True
    g_file, _, g_name = given.rpartition(":")
    r_file, _, r_name = recorded.rpartition(":")
    if g_name != r_name or not g_file.endswith(".py") or not r_file.endswith(".py"):
        return False
    g, r = Path(g_file).expanduser().resolve(), Path(r_file)
    if r.is_absolute():
        return g == r.resolve()
    parts = [p for p in r.parts if p != "."]
    return ".." not in parts and list(g.parts[-len(parts):]) == parts


def _finish(result, fps, differences, folder, args) -> int:
    """Show the comparison, write its folder (a default one unless --out or --no-save), exit 0 or 1."""
    from convcheck.report.folder import RunFolder

    if folder is None and not args.no_save:
        folder = RunFolder.default(result.model.name)
    _show(result, differences, args)
    if folder is not None:
        _write(result, fps, differences, folder, args.force)
    return 0 if result.ok else 1
