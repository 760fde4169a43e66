"""``convcheck diff`` of watched DDP runs (``watch/rankdiff.py``): rank by rank (each pair with ``--judge``'s
replay, as ``run_watched_diff``) and across ranks; shown and written as ``cli/diff.py``'s watched diffs
(``watch_diff.json`` under ``--out``, never over an earlier one without ``--force``); exit 0 or 1."""

from __future__ import annotations


def run_ranked_diff(args) -> int:
    from convcheck.cli.diff import _show_watched, _watch_judge
    from convcheck.watch.rankdiff import diff_ranked

    return _show_watched(diff_ranked(args.run_a, args.run_b, judge=_watch_judge(args.judge)), "watch_diff.json", args)
