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
    p = sub.add_parser("env", help="fingerprint and audit the driver/CUDA/cuDNN/GPU stack")
    p.set_defaults(func=_run_env)


def _run_env(args) -> int:
    raise ConvcheckError("convcheck env is not built yet")


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
