"""``convcheck diff`` of watched DDP runs (``watch/rankdiff.py``): the report on the terminal or ``--json``,
``--out DIR`` writes ``watch_diff.json`` (never over an earlier one without ``--force``); exit 0 or 1."""

from __future__ import annotations

import json


def run_ranked_diff(args) -> int:
    from pathlib import Path

    from convcheck.errors import UsageError
    from convcheck.files import atomic_write_text, check_writable_file
    from convcheck.watch.rankdiff import diff_ranked

    if args.judge:
        raise UsageError("diff --judge on DDP runs is not implemented; diff them without it, or judge one rank "
                         "(RUN/rank0)")
    result = diff_ranked(args.run_a, args.run_b)
    if args.out and not args.no_save:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = check_writable_file(Path(args.out) / "watch_diff.json", force=args.force, what="--out")
        atomic_write_text(path, json.dumps(result.to_dict(), indent=2) + "\n")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print("\n".join(result.lines()))
    return 0 if result else 1
