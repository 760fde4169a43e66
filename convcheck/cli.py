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
    p = sub.add_parser("compare", help="run one model on two targets against a float64 judge")
    p.set_defaults(func=_run_compare)


def _run_compare(args) -> int:
    raise ConvcheckError("convcheck compare is not built yet")


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
