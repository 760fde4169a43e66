"""The ``convcheck`` command line: parses arguments, calls the library, renders.

No logic of its own lives here. Every failure becomes its exit code and one
line on stderr (``convcheck.exit_codes``): 0 ok, 1 discrepancy, 2 usage or input
error (the user's model or data failing included), 3 out of memory / disk
full / interrupted, 4 a bug in convcheck (the only case with a traceback,
unless ``--debug``).
"""

from __future__ import annotations

import argparse
import sys

from convcheck.errors import UsageError
from convcheck.exit_codes import EXIT_CODES


def _exit_codes_text() -> str:
    return "exit codes:\n" + "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and an epilog computed only when help is shown."""

    epilog_factory = None

    def format_help(self) -> str:
        if self.epilog_factory is not None:
            self.epilog = self.epilog_factory()
        return super().format_help()

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_did_you_mean(message)} (see '{self.prog} --help')\n")


def _did_you_mean(message: str) -> str:
    """argparse's ``invalid choice: 'compair' (choose from ...)`` with the nearest choice named (issue 47)."""
    import difflib
    import re

    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if m is None:
        return message
    choices = re.findall(r"'([^']*)'", m.group(2))
    near = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
    return f"{message}; did you mean '{near[0]}'?" if near else message


def short_usage(parser) -> str:
    """What ``convcheck`` with no command prints (issue 47): the usage and the commands, one line each, as other
    command lines do - not the whole help."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows = [(c.dest, c.help or "") for c in sub._choices_actions]
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"usage: {parser.prog} [--version] [--debug] COMMAND [options]", "", "commands:",
                      *(f"  {name:<{width}}  {text}" for name, text in rows), "",
                      f"'{parser.prog} COMMAND --help' for a command's options, '{parser.prog} --help' for more"]) + "\n"


def _add_debug(p) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="on an error, print the full traceback as well (the exit code is unchanged)")


# --- convcheck models ------------------------------------------------------

def _add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="list the reference models")
    _add_debug(p)
    p.set_defaults(func=_run_models)


def _run_models(args) -> int:
    from reference_models import get_spec, list_models

    rows = []
    for name in list_models():
        spec = get_spec(name)
        classes = f"{spec.num_classes} {'class' if spec.num_classes == 1 else 'classes'}"
        if getattr(spec, "task", "classification") == "regression":
            classes = f"{spec.num_classes} output" + ("s" if spec.num_classes != 1 else "")
        rows.append((name, "x".join(str(d) for d in spec.input_shape), classes, spec.description))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]  # columns as wide as their longest entry
    for name, shape, classes, description in rows:
        print(f"{name:<{widths[0]}}  {shape:<{widths[1]}}  {classes:>{widths[2]}}  {description}")
    return 0


# --- convcheck targets -----------------------------------------------------

def _add_targets_parser(sub) -> None:
    p = sub.add_parser("targets", help="list every kind of target (the runner registry) and which run here")
    _add_debug(p)
    p.set_defaults(func=_run_targets)


def _target_kinds() -> list[tuple[str, type]]:
    """``(mode, runner class)`` for every registered mode, in the registry's order."""
    from convcheck.targets.runners import known_modes, runner_classes

    return [(mode, next(c for c in runner_classes() if mode in c.modes)) for mode in known_modes()]


def _run_targets(args) -> int:
    from convcheck.targets.runners import runnable_specs

    here = set(runnable_specs())
    for mode, cls in _target_kinds():
        for device in cls.devices:
            spec = device if mode == "float32" else f"{device}:{mode}"
            mark = "here" if spec in here else ""
            print(f"{spec:<22} {mark:<5} {cls.descriptions.get(mode, mode)}")
    from convcheck.targets.spec import DDP_DESCRIPTION, data_parallel_here

    for form, runs in data_parallel_here().items():
        print(f"{form:<22} {'here' if runs else '':<5} {DDP_DESCRIPTION}")
    return 0


# --- convcheck env (section owned by the env work) --------------------------

def _add_env_parser(sub) -> None:
    p = sub.add_parser(
        "env",
        help="fingerprint and audit the driver/CUDA/cuDNN/GPU stack",
        description="Fingerprint the numeric stack (driver, CUDA, cuDNN, GPU, math flags) and audit it. "
        "Exit 1 when a critical finding exists.",
        epilog=_exit_codes_text(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="audit a saved fingerprint JSON or `python -m torch.utils.collect_env` text "
                        "(UTF-8 or UTF-16, as pasted) instead of this machine")
    p.add_argument("--against", metavar="OTHER",
                   help="also show the differences that matter for numerics against OTHER "
                        "(fingerprint JSON or collect_env text)")
    p.add_argument("--json", action="store_true", help="write fingerprint(s) and findings as JSON")
    p.add_argument("--save", metavar="FILE",
                   help="write the fingerprint JSON to FILE (a regular file; an existing one only with --force)")
    p.add_argument("--force", action="store_true", help="let --save overwrite an existing regular file")
    _add_debug(p)
    p.set_defaults(func=_run_env)


def _run_env(args) -> int:
    import json

    from convcheck import env
    from convcheck.files import check_writable_file
    from convcheck.report.env_text import print_env, render_env

    if args.save:  # before any work: a path that must not be written fails now
        check_writable_file(args.save, force=args.force, what="--save")
    fp = env.load(args.from_file) if args.from_file else env.collect()
    other = env.load(args.against) if args.against else None
    findings = env.audit(fp)
    other_findings = env.audit(other) if other is not None else []
    differences = env.diff(fp, other) if other is not None else []
    if args.save:
        env.save(fp, args.save, force=args.force)
    if args.json:
        out = {"schema": "convcheck.env/1", "fingerprint": fp.to_dict(),
               "findings": [f.to_dict() for f in findings]}
        if other is not None:
            out["against"] = {"fingerprint": other.to_dict(),
                              "findings": [f.to_dict() for f in other_findings],
                              "differences": [d.to_dict() for d in differences]}
        print(json.dumps(out, indent=2))
    else:
        print_env(render_env(fp, findings, other=other, other_findings=other_findings,
                             differences=differences))
        if args.save:
            print(f"fingerprint saved to {args.save}")
    critical = any(f.severity == "critical" for f in [*findings, *other_findings])
    return 1 if critical else 0


# --- convcheck compare -----------------------------------------------------

def _compare_epilog() -> str:
    from convcheck.targets.spec import DDP_DESCRIPTION, DDP_EXAMPLES, DDP_FORMS, DEVICES, SPEC_EXAMPLES, SPEC_FORM

    lines = [f"targets: {SPEC_FORM}, e.g. {SPEC_EXAMPLES} (DEVICE: {', '.join(DEVICES)}; MODE defaults to "
             "float32; 'convcheck targets' lists which run here)"]
    for mode, cls in _target_kinds():
        devices = ", ".join(f"{d}:{mode}" for d in cls.devices)
        lines.append(f"  {mode:<13} {cls.descriptions.get(mode, mode)}: {devices}")
    lines.append(f"data-parallel targets: {' or '.join(DDP_FORMS)}, e.g. {DDP_EXAMPLES}: {DDP_DESCRIPTION}")
    return "\n".join(lines) + "\n\n" + _exit_codes_text()


def _add_compare_parser(sub) -> argparse.ArgumentParser:
    from convcheck.plan.options import declare_compare_options

    p = sub.add_parser("compare", help="run one model on two targets against a float64 judge",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.epilog_factory = _compare_epilog
    p.add_argument("--model", default="lenet",
                   help="zoo name (see 'convcheck models'), package.module:factory or path/file.py:factory "
                        "(default %(default)s)")
    p.add_argument("--input-shape", default=None, metavar="C,H,W", help="input shape, where the model cannot tell")
    p.add_argument("--classes", type=int, default=None, metavar="N", help="number of classes, where the model cannot tell")
    declare_compare_options(p.add_argument)
    p.add_argument("--env", default=None, metavar="FILE",
                   help="audit this fingerprint (JSON from 'convcheck env --save', or collect_env text) instead of "
                        "this machine, e.g. the GPU server where training fails")
    p.add_argument("--against", default=None, metavar="RUN",
                   help="run one target here (--targets SPEC) with the options recorded in the bundle RUN "
                        "('convcheck record') and diagnose it against that recorded run")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout instead of the report")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write report.html, summary.json, layers.csv, curves.csv, env.json and plots there "
                        "(default: a new folder reports/<UTC time, ms>-<model>/)")
    p.add_argument("--force", action="store_true", help="let --out replace the report files of an earlier run")
    p.add_argument("--no-save", action="store_true", help="write no files")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read options from this TOML file ([tool.convcheck] table, or top-level keys) instead of "
                        "the nearest pyproject.toml's [tool.convcheck]; options given here override it")
    _add_debug(p)
    p.set_defaults(func=_run_compare)
    return p


def _with_project(parser, argv, args):
    """Options from the project file first, then the command line's on top (parsed into a namespace
    that already holds the file's values, so only options actually given replace them). ``compare`` and
    ``record`` read it alike; a key the command has no option for (``targets`` for ``record``) is left out."""
    from convcheck.plan.project import load_project

    values, file = load_project(args.config)
    if not values:
        return args
    sub = parser.subcommands[args.command]
    dests = {action.dest for action in sub._actions} - ({"targets"} if args.command == "record" else set())
    values = {k: v for k, v in values.items() if k in dests}
    for action in sub._actions:  # argparse would convert string values itself, and exit
        value = values.get(action.dest)
        if isinstance(value, str) and callable(action.type):
            try:
                values[action.dest] = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise UsageError(f"{file}: [tool.convcheck] {action.dest.replace('_', '-')} = {value!r} is not "
                                 f"a valid {getattr(action.type, '__name__', 'value')}") from None
    given = {k for k in values if getattr(args, k, None) != sub.get_default(k)}  # on the command line
    sub.set_defaults(**values)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.project_file = str(file)  # named in the report's notes (stderr keeps its one-line contract)
    args.project_keys = sorted(values)
    args.project_values = {k: v for k, v in values.items() if k not in given}  # what the file still decides
    return args


# how error messages name an option that its key does not spell ("learning rate must be a positive number")
# (the start of a message, or of its part after a colon: "target 'gpu': unknown device", not "the target's labels")
_SAID_AS = {"lr": ("learning rate ",), "targets": ("target '",), "classes": ("number of classes ",),
            "input_shape": ("input shape ",)}


def from_project(exc: BaseException, args) -> BaseException:
    """A usage error about a value that came from the project file, saying so: ``--warmup 3 is not shorter
    than the run (30 steps) (warmup = 3 from /p/pyproject.toml)``; any other error as it is."""
    import re

    values = getattr(args, "project_values", None)
    if not values or not isinstance(exc, UsageError) or not exc.args:
        return exc
    message = str(exc)
    named = []
    for key, value in values.items():
        forms = {key, key.replace("_", "-"), key.replace("_", " ")}
        if any(re.search(rf"(?<!\w){re.escape(form)}(?![\w-])", message) for form in forms) or any(
                message.startswith(said) or f": {said}" in message for said in _SAID_AS.get(key, ())):
            named.append(f"{key.replace('_', '-')} = {value!r}")
    if not named:
        return exc
    try:
        return type(exc)(f"{message} ({', '.join(named)} from {args.project_file})")
    except TypeError:  # an error class that takes more than its message
        return exc


def _run_compare(args) -> int:
    from convcheck.targets.executors import before_threads

    before_threads(getattr(args, "targets", None))  # each kind of target sets what torch reads as it loads
    from convcheck.cli.compare import run_compare

    if args.against:
        from convcheck.cli.diff import run_against

        return run_against(args)

    return run_compare(args)


# --- entry point -------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from convcheck import __version__

    parser = _Parser(
        prog="convcheck",
        description="Why does the same PyTorch model converge on one device and not on another?",
        epilog=_exit_codes_text(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"convcheck {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the full traceback as well (the exit code is unchanged)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.compare_parser = _add_compare_parser(sub)
    parser.subcommands = {"compare": parser.compare_parser}
    _add_env_parser(sub)
    _add_models_parser(sub)
    _add_targets_parser(sub)
    from convcheck.cli.diff import add_diff_parser, run_diff
    from convcheck.cli.record import add_record_parser, run_record

    parser.subcommands["record"] = add_record_parser(sub, run_record)
    add_diff_parser(sub, run_diff)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line. ``argv=None`` is the process's own command line: once its outcome is decided,
    stop signals are ignored until it exits (a Ctrl-C after the report is written changes nothing), and the
    process ends then, whatever threads the user's code left running (``end_process``)."""
    code = _main(argv)
    if argv is None:
        end_process(code)
    return code


def end_process(code: int) -> None:
    """The process ended now with ``code`` when the user's code (a model factory, a data loader) left a
    non-daemon thread running, which would keep it alive after the report (issue 47): the output flushed, then
    ``os._exit``. Nothing happens when no such thread is left (the interpreter's own exit runs)."""
    import os
    import threading

    left = [t for t in threading.enumerate()
            if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if not left:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 0)


def _main(argv: list[str] | None) -> int:
    from convcheck.cli.signals import stop_signals
    from convcheck.exit_codes import report, user_exit

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # no command: the usage and the commands where errors go; a usage error
        sys.stderr.write(short_usage(parser))
        return 2
    with stop_signals(restore=argv is not None):
        running = False
        try:
            if args.command in parser.subcommands:  # compare and record read [tool.convcheck]
                args = _with_project(parser, argv, args)
            running = True
            return args.func(args)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes its exit code and one line
            # a SystemExit while the command runs is the user's code's (convcheck's own code never raises one:
            # `--model sys:exit` builds its model with sys.exit); before it, argparse's own exit
            if isinstance(exc, SystemExit) and not running and not user_exit(exc):
                raise
            exc = from_project(exc, args)
            return report(exc, debug=args.debug, hint=" (--debug shows the traceback)")


if __name__ == "__main__":
    sys.exit(main())
