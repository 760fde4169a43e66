"""``convcheck diff`` of watched runs (``convcheck.watch``): two runs, DDP rank folders, or one run against the
judge; the ``--out`` folder (``watch_diff.json`` and, for a pair, the tables and page of
``report/watch_report.py``) and ``--csv`` checked before any work, never inside a run."""

from __future__ import annotations

import json
import sys

from convcheck.cli.run_paths import not_a_run, removed_if_empty


def run_watched(args, name: str, compute, *, pair: tuple | None = None, csv=None) -> int:
    """A watched diff (``compute()``) with its ``--out`` checked (and made) first; the folder goes again,
    if this run made it, when ``compute`` fails. ``pair``: two watched runs whose tables
    (``analysis/tables.py``) go into the folder (``report/watch_report.py``) and to ``csv`` (``--csv``, checked
    by ``_csv_file``)."""
    from convcheck.report.watch_report import REPORT_FILES

    folder = _watched_out(args, name, also=REPORT_FILES if pair else ())
    with removed_if_empty(folder):
        result = compute()
        tables = None
        if pair and (folder is not None or csv is not None):
            from convcheck.analysis.tables import watch_tables

            tables = watch_tables(*pair)
        backends = _backends(args, pair or (args.run_a,), folder) if getattr(args, "backends", False) else None
    return _show_watched(result, name, args, folder, tables=tables, csv=csv, backends=backends)


def _backends(args, paths, folder) -> list:
    """``--backends``: each compiled run re-run backend by backend at its recorded step (``analysis/backends.py``),
    the repro written into ``--out``: ``[(side, Bisection)]``."""
    from convcheck.analysis.backends import bisect_backends, write_repro
    from convcheck.runformat.reader import open_watched

    out = []
    for side, path in zip("AB" if len(paths) > 1 else "-", paths):
        run = open_watched(path)
        if not (run.manifest.get("compiled") or {}).get("how"):
            continue
        b = bisect_backends(run, trust=getattr(args, "trust_run", False))
        if folder is not None and b.first is not None:
            b.repro = write_repro(run, b, folder.path if len(paths) == 1 else folder.path / f"backends_{side}")
        out.append((side, b))
    return out


def _watched_out(args, name: str, also: tuple = ()):
    """``--out`` of a watched diff as ``compare --out``'s (``RunFolder.explicit``: never through a device, FIFO
    or link; ``name``, then the files ``also`` written beside it, replaced only with ``--force``), and never a
    run's folder or one inside a run."""
    from pathlib import Path

    from convcheck.errors import UsageError
    from convcheck.report.folder import RunFolder, check_report_files

    if not args.out or args.no_save:
        return None
    out = Path(args.out)
    where = _run_around(out, args)
    if where:
        raise UsageError(f"--out {out}: {where}; diff never writes into a run: name another folder")
    folder = RunFolder.explicit(out, force=args.force, files=(name,))
    try:  # the report's own file said first (as ever), then the tables beside it
        check_report_files(folder.path, force=args.force, files=also)
    except UsageError:
        folder.discard_if_empty()
        raise
    return folder


def _run_around(out, args, this: str = "that folder") -> str | None:
    """Why the folder ``out`` is no place for diff's files (it is a run, or inside one: links followed, a run
    being diffed or not), in words starting with ``this``; None when it is neither."""
    from pathlib import Path

    from convcheck.errors import UsageError
    from convcheck.runformat.ranks import rank_folders
    from convcheck.runformat.reader import schema_of

    runs = [Path(r) for r in (args.run_a, args.run_b) if r is not None]
    try:  # the folder and every folder above it, links followed: a link to a run, or a folder inside one
        chain = [q for q in [out.resolve(), *out.resolve().parents] if q.is_dir()]
    except (OSError, RuntimeError):  # a link loop: RunFolder.explicit says what is there
        chain = []
    for q in chain:
        try:
            ranked = rank_folders(q) is not None
        except (UsageError, OSError):
            ranked = False
        kind = schema_of(q)
        if ranked or kind is not None:
            what = "a recorded run (convcheck record)" if kind and kind.startswith("convcheck.bundle") else \
                "a watched run (convcheck.watch)"
            return f"{this} is {what}" if q == out.resolve() else f"{this} is inside the run {q} ({what})"
    try:
        inside = next((r for r in runs if r.is_dir() and out.resolve().is_relative_to(r.resolve())), None)
    except (OSError, RuntimeError):  # a link loop: RunFolder.explicit says what is there
        inside = None
    return None if inside is None else f"{this} is inside the run {inside}"


def _csv_file(args):
    """``--csv PATH`` of a watched pair, checked before anything is computed: nothing there or a regular file
    (replaced only with ``--force``; never a folder, link, FIFO or device), its folder there, never inside a run
    nor one of the files ``--out`` writes. Each refusal one line."""
    import os
    from pathlib import Path

    from convcheck.errors import UsageError
    from convcheck.files import check_writable_file
    from convcheck.report.watch_report import REPORT_FILES

    if not str(args.csv).strip():
        raise UsageError("--csv is empty: name a file")
    path = check_writable_file(Path(args.csv), force=args.force, what="--csv")
    if not path.parent.is_dir():
        raise UsageError(f"--csv {path}: its folder {path.parent} does not exist")
    where = _run_around(path.parent, args, this="its folder")
    if where:
        raise UsageError(f"--csv {path}: {where}; diff never writes into a run: name another file")
    if args.out and not args.no_save and path.name in ("watch_diff.json", *REPORT_FILES) \
            and os.path.abspath(path.parent) == os.path.abspath(args.out):
        raise UsageError(f"--csv {path}: --out {args.out} writes that file; name another (watch_layers.csv there "
                         "holds the same table)")
    return path


def run_watched_diff(args, kinds) -> int:
    """Two runs from ``convcheck.watch``: their diff and verdict (``convcheck/analysis/diff.py``)."""
    from convcheck.errors import UsageError
    from convcheck.analysis.diff import diff_watched

    for path, kind in zip((args.run_a, args.run_b), kinds):
        if kind is None:  # not a run at all: what is wrong with that path
            raise UsageError(not_a_run(path) or f"diff: {path}: not a watched run or a recorded bundle")
    if kinds[0] != kinds[1]:
        raise UsageError("diff: one run is watched (convcheck.watch) and the other recorded (convcheck record); "
                         "diff two of the same kind")
    csv = _csv_file(args) if getattr(args, "csv", None) is not None else None  # before any work
    judge, trust = watch_judge(args.judge), getattr(args, "trust_run", False)  # --trust-run: load recorded code
    return run_watched(args, "watch_diff.json", lambda: diff_watched(args.run_a, args.run_b, judge=judge, trust=trust),
                    pair=(args.run_a, args.run_b), csv=csv)


def watch_judge(spec):
    """``--judge`` for watched runs: a float64 target spec (a recorded judge bundle is for recorded runs)."""
    from convcheck.errors import UsageError
    from convcheck.targets.spec import parse_judge

    if spec is None:
        return None
    if not str(spec).strip() or "/" in str(spec) or "\\" in str(spec):
        raise UsageError(f"--judge {spec!r}: with watched runs, name a float64 target of this machine "
                         "(cpu:float64 or cuda:float64)")
    return str(parse_judge(str(spec).strip()))


def run_watched_judge(args) -> int:
    """``convcheck diff RUN --judge SPEC``: one watched run against the float64 judge."""
    from convcheck.errors import UsageError
    from convcheck.targets.spec import default_judge
    from convcheck.analysis.diff import judge_watched
    from convcheck.runformat.reader import schema_of

    kind = schema_of(args.run_a)
    if kind is None:
        raise UsageError(not_a_run(args.run_a) or f"diff: {args.run_a}: not a watched run or a recorded bundle")
    if kind != "convcheck.watch/1":
        raise UsageError(f"diff: {args.run_a} is not a watched run (convcheck.watch); a recorded run needs a "
                         "second one: convcheck diff RUN_A RUN_B")
    judge = watch_judge(args.judge) or str(default_judge()[0])
    trust = getattr(args, "trust_run", False)  # --trust-run: load the model the run recorded by value
    return run_watched(args, "watch_judge.json", lambda: judge_watched(args.run_a, judge, trust))


def _show_watched(result, name: str, args, folder, *, tables=None, csv=None, backends=None) -> int:
    """Write the folder (``name``, and with ``tables`` the tables and the page of ``report/watch_report.py``)
    and ``--csv`` (``csv``: the per-layer table), then show the diff; exit 0 when it is ok, 5 when it is
    inconclusive (the judge could not check what the verdict rests on), else 1."""
    from convcheck.files import atomic_write_text, check_writable_file, write_error

    if folder is not None:
        path = check_writable_file(folder.path / name, force=args.force, what="--out")
        atomic_write_text(path, json.dumps(result.to_dict(), indent=2) + "\n")
        if tables is not None:
            from convcheck.report.watch_report import write_watch_report

            try:
                write_watch_report(folder.path, result, tables, force=args.force)
            except OSError as exc:
                raise write_error(exc, exc.filename or folder.path) from None
    if csv is not None:
        path = check_writable_file(csv, force=args.force, what="--csv")  # again: a file made since the check
        try:
            atomic_write_text(path, tables.layers.csv())
        except OSError as exc:
            raise write_error(exc, path) from None
    if args.json:
        doc = result.to_dict()
        if backends is not None:
            doc["backends"] = {side: b.to_dict() for side, b in backends}
        print(json.dumps(doc, indent=2))
    else:
        if backends is not None:  # said before the verdict's lines end the report
            print("\n".join(f"{'' if side == '-' else side + ': '}{x}" for side, b in backends for x in b.lines())
                  or "backends: no compiled run to bisect")
        from convcheck.report.verdict_lines import fit_prose

        print(fit_prose(result.lines(), sys.stdout))  # wrapped to the terminal (--json keeps every line whole)
    from convcheck.exit_codes import verdict_exit

    return 0 if result else verdict_exit(getattr(getattr(result, "verdict", None), "category", None))


