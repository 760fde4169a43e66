"""``convcheck compare`` from parsed arguments to exit code: run, render, write the run folder.

The folder rules are ``convcheck.report.folder``'s (never clobber, unique
default names, empty folders of a failed run removed). When the machine stops
the run (Ctrl-C, out of memory, disk full) after it started measuring, a
``summary.json`` marked ``"complete": false`` records what is known (the model,
targets, configuration, environment and where the run stopped) and the one
error line says where it is.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from convcheck.errors import ConvcheckError, RunFailed, UsageError
from convcheck.exit_codes import classify, resource_reason
from convcheck.run_stage import RunStage


def run_compare(args) -> int:
    from convcheck.plan.models import parse_input_shape
    from convcheck.plan.options import config_from_options
    from convcheck.report.folder import RunFolder

    if args.out is not None and not str(args.out).strip():
        raise UsageError("--out is empty: name a folder (or pass --no-save to write no files)")
    if args.no_save and args.out is not None:
        raise UsageError(f"--no-save writes no files, --out {args.out} writes them there: pass one of the two")
    config = config_from_options(vars(args))  # bad numbers fail here, before any work
    from convcheck.targets.executors import serve

    served = serve(config)  # a process that serves another's run (torchrun's other ranks serve rank 0's)
    if served is not None:
        return served
    shape = parse_input_shape(args.input_shape) if args.input_shape else None
    fingerprint = findings = None
    if args.env:
        from convcheck.env import audit, load

        fingerprint = load(args.env)
        findings = audit(fingerprint)
    folder = None
    stage = RunStage(None, config.steps)
    try:
        if not args.no_save:  # a bad --out fails before the run, not after it
            folder = RunFolder.explicit(args.out, force=args.force) if args.out else RunFolder.default(args.model)
        result = _compare(args, config, shape, findings, fingerprint, stage)
    except BaseException as exc:
        _after_failure(exc, folder, stage, args, config, fingerprint)
        raise
    if getattr(args, "project_file", None):
        result = dataclasses.replace(result, notes=[*result.notes, f"options from {args.project_file} "
                                        f"({', '.join(args.project_keys)}); the command line overrides them"])
    _show(result, args)
    if folder is not None:
        _write(result, folder, args.force)
    return 0 if result.ok else 1


def _compare(args, config, shape, findings, fingerprint, stage: RunStage):
    from convcheck.pipeline import compare
    from convcheck.report.progress import progress_reporter

    with progress_reporter() as progress:
        stage.inner = progress
        return compare(args.model, config=config, input_shape=shape, num_classes=args.classes, progress=stage,
                       env_findings=findings, fingerprint=fingerprint)


def _show(result, args) -> None:
    if args.json:
        from convcheck.report.export import summary_dict

        summary = summary_dict(result)
        summary.setdefault("complete", True)  # as in summary.json: a run that ends here ran to its end
        print(json.dumps(summary, indent=2))
    else:
        from convcheck.report.text import make_console, render_compare

        render_compare(result, make_console())


def _write(result, folder, force: bool) -> None:
    from convcheck.cli.signals import held
    from convcheck.report.export import write_run

    with held():  # the run is done: a stop signal now waits for its report to be written whole
        try:
            path = folder.ensure()
            written = write_run(result, path, force=force)
        except BaseException:
            folder.discard_if_empty()
            raise
    from convcheck.report.verdict_lines import fit_prose, wrote_line

    print(fit_prose([wrote_line(path, [p.name for p in written])], sys.stderr), file=sys.stderr)


def _after_failure(exc: BaseException, folder, stage: RunStage, args, config, fingerprint) -> None:
    """The machine stopped a run that had started measuring: keep what is known, say where (raises
    ``RunFailed``). Anything else: remove the folders this run created and left empty."""
    stopped_by_machine = isinstance(exc, RunFailed) or (
        not isinstance(exc, ConvcheckError) and resource_reason(exc) is not None)
    if folder is not None and stopped_by_machine and stage.started:
        line = classify(exc, stage.describe()).line
        from convcheck.cli.signals import held

        with held():  # a second (third) Ctrl-C or TERM while what is known is saved cannot cut the save short
            try:
                from convcheck.report.export import write_partial

                kept = write_partial(folder.ensure(), _partial_info(line, stage, args, config, fingerprint),
                                     parity=stage.partial.get("parity"), curves=stage.partial.get("curves"))
            except (OSError, ConvcheckError):
                kept = None
        if kept is not None:
            raise RunFailed(f"{line}; kept what is known of the run in {kept} (complete: false)") from exc
    if folder is not None:
        from convcheck.cli.signals import held

        with held():
            folder.discard_if_empty()


def _partial_info(line: str, stage: RunStage, args, config, fingerprint) -> dict:
    return {
        "stopped": line,
        "stage": {"name": stage.stage, "where": stage.describe(), "done": stage.done, "total": stage.total},
        "model": {"spec": args.model, "input_shape": args.input_shape, "num_classes": args.classes},
        "targets": config.targets, "judge": config.judge, "seed": config.seed,
        "config": {"steps": config.steps, "batch_size": config.batch_size, "envelope": config.envelope,
                   "data": config.data, "tolerances": config.tolerances},
        "env": {"fingerprint": fingerprint.to_dict() if fingerprint is not None else None},
    }
