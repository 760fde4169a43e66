"""The ``convcheck`` command line: parses arguments, calls the library, renders.

No logic of its own lives here. Every ``ConvcheckError`` becomes a one-line
message on stderr and its exit code; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import sys

from convcheck.errors import ConvcheckError


# --- convcheck models ------------------------------------------------------

def _add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="list the reference models")
    p.set_defaults(func=_run_models)


def _run_models(args) -> int:
    from reference_models import list_models, get_spec

    for name in list_models():
        spec = get_spec(name)
        shape = "x".join(str(d) for d in spec.input_shape)
        print(f"{name:<12} {shape:<10} {spec.num_classes:>5} classes  {spec.description}")
    return 0


# --- convcheck env (section owned by the env work) --------------------------

def _add_env_parser(sub) -> None:
    p = sub.add_parser(
        "env",
        help="fingerprint and audit the driver/CUDA/cuDNN/GPU stack",
        description="Fingerprint the numeric stack (driver, CUDA, cuDNN, GPU, math flags) and audit it. "
        "Exit 1 when a critical finding exists.",
    )
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="audit a saved fingerprint JSON or `python -m torch.utils.collect_env` text "
                        "instead of this machine")
    p.add_argument("--against", metavar="OTHER",
                   help="also show the differences that matter for numerics against OTHER "
                        "(fingerprint JSON or collect_env text)")
    p.add_argument("--json", action="store_true", help="write fingerprint(s) and findings as JSON")
    p.add_argument("--save", metavar="FILE", help="write the fingerprint JSON to FILE")
    p.set_defaults(func=_run_env)


def _run_env(args) -> int:
    import json

    from convcheck import env
    from convcheck.report.env_text import print_env, render_env

    fp = env.load(args.from_file) if args.from_file else env.collect()
    other = env.load(args.against) if args.against else None
    findings = env.audit(fp)
    other_findings = env.audit(other) if other is not None else []
    differences = env.diff(fp, other) if other is not None else []
    if args.save:
        env.save(fp, args.save)
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

def _add_compare_parser(sub) -> None:
    from convcheck.options import declare_compare_options

    p = sub.add_parser("compare", help="run one model on two targets against a float64 judge")
    p.add_argument("--model", default="lenet",
                   help="zoo name (see 'convcheck models'), package.module:factory or path/file.py:factory "
                        "(default %(default)s)")
    p.add_argument("--input-shape", default=None, metavar="C,H,W", help="input shape, where the model cannot tell")
    p.add_argument("--classes", type=int, default=None, metavar="N", help="number of classes, where the model cannot tell")
    declare_compare_options(p.add_argument)
    p.add_argument("--env", default=None, metavar="FILE",
                   help="audit this fingerprint (JSON from 'convcheck env --save', or collect_env text) instead of "
                        "this machine, e.g. the GPU server where training fails")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout instead of the report")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write report.html, summary.json, layers.csv, curves.csv, env.json and plots there "
                        "(default reports/<UTC time>-<model>/)")
    p.add_argument("--no-save", action="store_true", help="write no files")
    p.set_defaults(func=_run_compare)


def _run_compare(args) -> int:
    import json
    from datetime import datetime, timezone

    from convcheck.pipeline import compare
    from convcheck.models import parse_input_shape
    from convcheck.options import config_from_options
    from convcheck.report.export import prepare_out_dir, summary_dict, write_run
    from convcheck.report.progress import progress_reporter
    from convcheck.report.text import make_console, render_compare

    config = config_from_options(vars(args))  # bad numbers fail here, before any work
    shape = parse_input_shape(args.input_shape) if args.input_shape else None
    fingerprint = findings = None
    if args.env:
        from convcheck.env import audit, load

        fingerprint = load(args.env)
        findings = audit(fingerprint)
    out = None
    if not args.no_save:
        out = args.out or f"reports/{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{_safe(args.model)}"
        if args.out:
            prepare_out_dir(out)  # a bad --out fails before the run, not after it
    with progress_reporter() as progress:
        result = compare(
            args.model, config=config, input_shape=shape, num_classes=args.classes, progress=progress,
            env_findings=findings, fingerprint=fingerprint,
        )
    if args.json:
        print(json.dumps(summary_dict(result), indent=2))
    else:
        render_compare(result, make_console())
    if out:
        write_run(result, out)
        print(f"wrote {out}/report.html, summary.json, layers.csv, curves.csv, env.json, loss.png, layers.png",
              file=sys.stderr)
    return 0 if result else 1


def _safe(text: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text.rsplit("/", 1)[-1])[:40]


# --- entry point -------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convcheck",
        description="Why does the same PyTorch model converge on one device and not on another?",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_compare_parser(sub)
    _add_env_parser(sub)
    _add_models_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ConvcheckError as exc:
        print(f"convcheck: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("convcheck: interrupted", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
