"""``convcheck record``: run one target against the judge and write a bundle (``convcheck.bundle``).

``--out RUN`` is a folder that must not exist yet, or be empty, or (with ``--force``) hold an earlier
bundle, whose files alone are replaced; with ``--zip`` it is the ``.zip`` to write. Only regular files
are ever written or replaced; a run that fails removes what it created.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from convcheck.errors import UsageError


def add_record_parser(sub, run) -> argparse.ArgumentParser:
    from convcheck.plan.options import declare_compare_options

    p = sub.add_parser("record", help="run one target against the judge and save a bundle to diff elsewhere",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Record one target's run (parity step arrays, curves, env) into a bundle; "
                                   "compare two bundles later with 'convcheck diff RUN_A RUN_B'.")
    p.add_argument("--model", default="lenet", help="as for compare (default %(default)s)")
    p.add_argument("--input-shape", default=None, metavar="C,H,W", help="input shape, where the model cannot tell")
    p.add_argument("--classes", type=int, default=None, metavar="N", help="number of classes, where the model cannot tell")
    p.add_argument("--target", required=True, metavar="SPEC", help="the one target to record, e.g. cuda or cpu:bf16")
    declare_compare_options(p.add_argument)
    for action in p._actions:  # record runs one --target: --targets is refused, so not offered in --help
        if action.dest == "targets":
            action.help = argparse.SUPPRESS
    p.add_argument("--out", required=True, metavar="RUN", help="the bundle folder (or .zip with --zip) to write")
    p.add_argument("--zip", action="store_true", help="write one .zip file instead of a folder")
    p.add_argument("--force", action="store_true", help="replace an earlier bundle at --out")
    p.add_argument("--layers", default=None, metavar="PATTERN",
                   help="keep the arrays of matching layers only (fnmatch on the layer name, e.g. 'layer4.*')")
    p.add_argument("--snapshot-steps", default=None, metavar="0,10,30",
                   help="save the parameters after these many training steps, or 'none' (default: every step "
                        "while that stays under 256 MB, else the last)")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read options from this TOML file instead of the nearest pyproject.toml's "
                        "[tool.convcheck] (as compare does; its targets are not read: record runs --target)")
    p.add_argument("--debug", action="store_true", help="on an error, print the full traceback as well")
    p.set_defaults(func=run)
    return p


def run_record(args) -> int:
    from convcheck.bundle.record import record_run
    from convcheck.bundle.writer import pack_zip, prepare_folder, staging_folder
    from convcheck.files import refuse_special
    from convcheck.plan.models import parse_input_shape
    from convcheck.plan.options import config_from_options

    if args.targets is not None:
        raise UsageError("record runs one target: give it with --target SPEC (diff compares two recordings)")
    config = config_from_options(vars(args))
    shape = parse_input_shape(args.input_shape) if args.input_shape else None
    out = Path(args.out)
    if args.zip:
        refuse_special(out, "--out")
        if out.exists() and not args.force:
            raise UsageError(f"--out {out} exists; pass --force to replace it")
        folder, created = staging_folder(out), []
        created = [folder]
    else:
        folder, created = prepare_folder(out, args.force)
    try:
        manifest = record_run(args.model, args.target, config, folder, input_shape=shape, num_classes=args.classes,
                              layers=args.layers, snapshot_steps=args.snapshot_steps)
        if args.zip:
            pack_zip(folder, out, force=args.force)
    except BaseException:
        for c in created:
            shutil.rmtree(c, ignore_errors=True)
        raise
    arrays = manifest["arrays"]
    print(f"recorded {args.model} on {manifest['target']} (judge {manifest['judge']}): "
          f"{len(arrays['forward'])} layer outputs, {len(arrays['grads'])} gradients, "
          f"{len(arrays['snapshots'])} snapshots -> {out}", file=sys.stderr)
    return 0
