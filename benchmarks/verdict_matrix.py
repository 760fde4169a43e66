"""The watched diff's fault matrix (issue 42): generated cases, each two watched runs and ``diff_watched``.

    python benchmarks/verdict_matrix.py [--set tuned|heldout] [--families mlp,cnn,...] [--faults no_zero_grad,...]
                                        [--out benchmarks/results/verdict_matrix.md] [--jobs N] [--list] [--steps N]

``--set heldout`` runs the held-out matrix instead (``matrix/heldout.py``: families, faults and a loop the diff's
method was never tuned on; written to ``benchmarks/results/verdict_matrix-heldout.md`` unless ``--out`` says).

Every case is a model family (``matrix/families.py``) and a kind (``matrix/cases.py``): a planted fault, run B
against a healthy run A of the same family (same seed, data, initial weights), or a healthy variation (truth ``ok``).
Each case runs in its own process (a pool of ``--jobs``, one task a process): first both runs in plain torch,
checking that the fault does what it claims (a fault that does not show is a bug in the matrix: the case is
``INVALID`` and the matrix exits 2), then both runs under ``convcheck.watch`` into a temporary folder and
``convcheck.analysis.diff.diff_watched``. A case is right when the verdict's category is its truth and its headline,
sub-cause or evidence names the cause (one of the case's words). A case that crashes counts as wrong, with the
exception. Prints the confusion table (truth rows x diagnosed columns), the % right, the false alarms on healthy
cases and each wrong case with its headline, and writes them with the command and the date to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from matrix.cases import KINDS, CaseInvalid, all_cases, named  # noqa: E402
from matrix.families import FAMILIES  # noqa: E402

COLUMNS = ("ok", "numerics", "layer", "version", "hardware", "setup", "nondeterminism", "inconclusive", "crash")
ROWS = ("ok", "setup", "numerics")


def run_case(family: str, kind: str, check: bool = True) -> dict:
    """One case, in this process: the plain-torch check, two watched runs, their diff. Never raises."""
    from matrix.loop import train

    k, fam = KINDS[kind], FAMILIES[family]
    res = {"family": family, "kind": kind, "truth": k.truth, "words": list(k.words), "category": None,
           "headline": None, "sub_cause": None, "evidence": [], "named": False, "right": False, "status": "ok",
           "error": None}
    t0 = time.perf_counter()
    try:
        if check:
            a, b = train(fam, k.a), train(fam, k.b)
            k.check(fam, a, b)
        from convcheck.analysis.diff import diff_watched

        with tempfile.TemporaryDirectory(prefix="verdict-matrix-") as tmp:
            train(fam, k.a, out=Path(tmp) / "A")
            train(fam, k.b, out=Path(tmp) / "B")
            v = diff_watched(Path(tmp) / "A", Path(tmp) / "B").verdict.to_dict()
        res.update(category=v["category"], headline=v["headline"], sub_cause=v.get("sub_cause"),
                   evidence=list(v.get("evidence") or []))
        res["named"] = named(k.words, v)
        res["right"] = v["category"] == k.truth and res["named"]
    except CaseInvalid as e:
        res.update(status="invalid", error=f"the fault did not manifest: {e}")
    except BaseException as e:  # noqa: BLE001 - a crash is a wrong case, never the end of the matrix
        tb = traceback.format_exc(limit=4).strip().splitlines()
        res.update(status="crash", category="crash", error=f"{type(e).__name__}: {e}"[:400], traceback=tb[-6:])
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _task(args):
    if args[0] == "heldout":
        from matrix.heldout import run_case as run_heldout

        return run_heldout(*args[1:])
    return run_case(*args[1:])


def run_all(cases, jobs: int = 1, progress=None, which: str = "tuned") -> list[dict]:
    """Every case in its own process (spawned, one task per process): no global state leaks between cases."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the spawned workers' own thread pools: one thread each
    ctx = mp.get_context("spawn")
    out = []
    with ctx.Pool(processes=max(1, jobs), maxtasksperchild=1) as pool:
        check = not os.environ.get("CONVCHECK_MATRIX_STEPS")
        for r in pool.imap_unordered(_task, [(which, c.family, c.kind, check) for c in cases]):
            out.append(r)
            if progress:
                progress(r, len(out), len(cases))
    order = {(c.family, c.kind): i for i, c in enumerate(cases)}
    return sorted(out, key=lambda r: order[(r["family"], r["kind"])])


def confusion(results) -> dict:
    table = {t: {c: 0 for c in COLUMNS} for t in ROWS}
    for r in results:
        if r["status"] == "invalid":
            continue
        table[r["truth"]][r["category"] if r["category"] in COLUMNS else "crash"] += 1
    return table


def summary(results) -> dict:
    scored = [r for r in results if r["status"] != "invalid"]
    right = [r for r in scored if r["right"]]
    cat = [r for r in scored if r["category"] == r["truth"]]
    healthy = [r for r in scored if r["truth"] == "ok"]
    alarms = [r for r in healthy if r["category"] not in ("ok", "inconclusive")]  # a finding (exit 1) or a crash
    return {"cases": len(scored), "right": len(right), "category_right": len(cat), "healthy": len(healthy),
            "false_alarms": len(alarms), "invalid": len(results) - len(scored),
            "inconclusive_healthy": sum(r["category"] == "inconclusive" for r in healthy),
            "wrong": [r for r in scored if not r["right"]], "invalid_cases": [r for r in results
                                                                            if r["status"] == "invalid"]}


def _pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "-"


def _short(s, n=150):
    s = " ".join(str(s or "").split())
    return s if len(s) <= n else s[:n - 1] + "…"


def report(results, command: str, seconds: float, jobs: int, kinds=None, families=None,
           title: str = "# The watched diff's verdict matrix (issue 42)", date: str | None = None,
           commit: str | None = None) -> str:
    """The matrix's page; ``date`` and ``commit`` where it is written again from a run's JSON (default: now, HEAD)."""
    kinds = KINDS if kinds is None else kinds
    families = FAMILIES if families is None else families
    s = summary(results)
    table = confusion(results)
    cols = [c for c in COLUMNS if any(table[t][c] for t in ROWS) or c in ("ok", "setup", "numerics")]
    lines = [title, "",
             f"- command: `{command}`",
             f"- date: {date or _dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- commit: {commit}" if commit else f"- commit: {_git('rev-parse', '--short', 'HEAD')}"
             + (" (+ uncommitted changes under convcheck/)" if _git('status', '--porcelain', 'convcheck') else ""),
             f"- machine: {platform.machine()}, {os.cpu_count()} cpus, torch {_torch_version()}, --jobs {jobs}, "
             f"{seconds:.0f} s wall", "",
             f"**Right (category right and cause named): {s['right']}/{s['cases']} = {_pct(s['right'], s['cases'])}**; "
             f"category right: {s['category_right']}/{s['cases']} = {_pct(s['category_right'], s['cases'])}; "
             f"**false alarms on healthy cases: {s['false_alarms']}/{s['healthy']}**"
             + (f" (a finding, exit 1; `inconclusive`, exit 5, on {s['inconclusive_healthy']} more)"
                if s["inconclusive_healthy"] else "")
             + (f"; INVALID cases (fault did not manifest — a matrix bug): {s['invalid']}" if s["invalid"] else ""),
             "", "## Confusion (truth rows × diagnosed columns)", "",
             "| truth \\ diagnosed | " + " | ".join(cols) + " | total |",
             "|---|" + "---:|" * (len(cols) + 1)]
    for t in ROWS:
        row = table[t]
        lines.append(f"| **{t}** | " + " | ".join(str(row[c]) for c in cols) + f" | {sum(row.values())} |")
    lines += ["", "## By kind (right / cases)", "", "| kind | truth | " + " | ".join(families) + " |",
              "|---|---|" + "---|" * len(families)]
    by = {(r["family"], r["kind"]): r for r in results}
    for kind, k in kinds.items():
        cells = []
        for f in families:
            r = by.get((f, kind))
            if r is None:
                cells.append("")
            elif r["status"] == "invalid":
                cells.append("INVALID")
            else:
                mark = "✓" if r["right"] else ("~" if r["category"] == r["truth"] else "✗")
                cells.append(f"{mark} {r['category']}")
        if any(cells):
            lines.append(f"| {kind} | {k.truth} | " + " | ".join(cells) + " |")
    lines += ["", "✓ right; ~ category right, cause not named; ✗ wrong category.", "",
              "## Wrong cases", ""]
    for r in s["wrong"]:
        what = r["error"] if r["status"] == "crash" else r["headline"]
        why = "" if r["category"] != r["truth"] else f" (not named: none of {r['words']})"
        lines.append(f"- `{r['family']}/{r['kind']}` truth {r['truth']} → **{r['category']}**"
                     + (f" [{r['sub_cause']}]" if r.get("sub_cause") else "") + f": {_short(what)}{why}")
    if not s["wrong"]:
        lines.append("none")
    if s["invalid_cases"]:
        lines += ["", "## INVALID cases (the planted fault did not manifest in plain torch)", ""]
        lines += [f"- `{r['family']}/{r['kind']}`: {r['error']}" for r in s["invalid_cases"]]
    lines += ["", "## Cases", "", "| family | kind | truth | diagnosed | sub-cause | headline | s |",
              "|---|---|---|---|---|---|---:|"]
    for r in results:
        lines.append(f"| {r['family']} | {r['kind']} | {r['truth']} | {r['category'] or r['status']} | "
                     f"{r.get('sub_cause') or ''} | {_short(r['headline'] or r['error'], 110).replace('|', '/')} | "
                     f"{r['seconds']} |")
    lines += ["", "## Kinds", ""]
    lines += [f"- `{k.name}` ({k.truth}): {k.about}" for k in kinds.values()]
    lines += ["", "## Families", ""]
    lines += [f"- `{f.name}`: {f.about}" for f in families.values()]
    return "\n".join(lines) + "\n"


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", dest="which", choices=("tuned", "heldout"), default="tuned",
                   help="tuned: the matrix the diff was tuned on (default); heldout: matrix/heldout.py")
    p.add_argument("--families", default="", help="comma-separated (default: all): " + ",".join(FAMILIES))
    p.add_argument("--faults", default="", help="comma-separated kinds, faults or variations (default: all): "
                   + ",".join(KINDS))
    p.add_argument("--out", default=None, help="default: benchmarks/results/verdict_matrix.md "
                   "(--set heldout: verdict_matrix-heldout.md)")
    p.add_argument("--json", default=None, help="also write every case's result as JSON here")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--steps", type=int, default=None,
                   help="every run this many steps (a short matrix: what the verdicts say with too few steps to judge "
                        "the outcome); the plain-torch check that a fault shows is skipped (it assumes the full length)")
    args = p.parse_args(argv)
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be a positive whole number")
        os.environ["CONVCHECK_MATRIX_STEPS"] = str(args.steps)  # read by matrix/loop.py and matrix/heldout.py
    if args.which == "heldout":
        from matrix import heldout

        set_kinds, set_families, set_cases = heldout.KINDS, heldout.FAMILIES, heldout.all_cases
        title = "# The watched diff's held-out verdict matrix (families and faults it was never tuned on)"
        args.out = args.out or str(HERE / "results" / "verdict_matrix-heldout.md")
    else:
        set_kinds, set_families, set_cases = KINDS, FAMILIES, all_cases
        title = "# The watched diff's verdict matrix (issue 42)"
        args.out = args.out or str(HERE / "results" / "verdict_matrix.md")
    fams = [f for f in args.families.split(",") if f]
    kinds = [k for k in args.faults.split(",") if k]
    bad = [f for f in fams if f not in set_families] + [k for k in kinds if k not in set_kinds]
    if bad:
        p.error(f"unknown: {', '.join(bad)}")
    cases = set_cases(fams or None, kinds or None)
    if args.list:
        for c in cases:
            print(c.name, set_kinds[c.kind].truth)
        return 0
    command = "python benchmarks/verdict_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()

    def progress(r, i, n):
        mark = {"invalid": "INVALID", "crash": "CRASH"}.get(r["status"], "right" if r["right"] else "WRONG")
        print(f"[{i}/{n}] {r['family']}/{r['kind']}: {mark}: {r['category']}: {_short(r['headline'] or r['error'], 110)}"
              f" ({r['seconds']} s)", flush=True)

    results = run_all(cases, args.jobs, progress, args.which)
    seconds = time.perf_counter() - t0
    text = report(results, command.strip(), seconds, args.jobs, set_kinds, set_families, title)
    print()
    print(text[:text.index("## Cases")] if "## Cases" in text else text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(f"written: {out}")
    return 2 if summary(results)["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
