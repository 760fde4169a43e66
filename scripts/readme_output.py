"""The output blocks of README.md and the docs/ pages, produced from real runs: ``--write`` regenerates them,
``--check`` (the slow test ``tests/test_readme.py``) fails when a page's text differs from what the runs print now.

A block that shows output is the code block right after a marker line in README.md or a docs/*.md page:

    <!-- readme-output: full convcheck compare --model lenet -->      the command's whole terminal output
    <!-- readme-output: ends convcheck compare --model ... -->        its header (to the "judge" line),
                                                                      "...", then from "Training" to the end
    <!-- readme-output: verdicts -->                                  "=== COMMAND" sections: each command's
                                                                      verdict lines and "(exit N)"
    <!-- readme-output: session -->                                   a shell session: the block's own "$ "
                                                                      lines run in turn (``VAR=value``
                                                                      prefixes, ``python`` or ``convcheck``),
                                                                      each followed by what it printed; in a
                                                                      fresh folder holding a link to examples/

Every command runs from the repository root as a user would, with ``--no-save`` added, ``COLUMNS=100``,
``OMP_NUM_THREADS=1`` (a run's rounding depends on the thread count: the blocks are reproducible on one thread)
and no progress bar. ``--check`` compares the words exactly and the numbers to ``REL_TOL`` (relative), so a
last-digit change on another CPU does not fail it, while a changed wording, verdict or a number that moved does.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))  # every page that may hold output blocks
MARKER = re.compile(r"^<!-- readme-output: (full|ends|verdicts|session)(?: (.*?))? -->$")
REL_TOL = 0.05
WIDTH = 100
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:e[-+]?\d+)?", re.IGNORECASE)


def run(command: str) -> tuple[str, int, float]:
    """``(stdout, exit code, seconds)`` of one ``convcheck ...`` command line."""
    argv = shlex.split(command)
    assert argv[0] == "convcheck", command
    env = {**os.environ, "COLUMNS": str(WIDTH), "OMP_NUM_THREADS": "1", "CONVCHECK_NO_PROGRESS": "1"}
    env.pop("NO_COLOR", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "convcheck", *argv[1:], "--no-save"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    return done.stdout, done.returncode, time.monotonic() - start


def session(current: list[str]) -> list[str]:
    """A ``session`` block now: each ``$ `` line of ``current`` run in one fresh folder, then its output."""
    import tempfile

    out_lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="readme-session-") as tmp:
        (Path(tmp) / "examples").symlink_to(ROOT / "examples")
        for line in current:
            if not line.startswith("$ "):
                continue
            argv = shlex.split(line[2:])
            env = {**os.environ, "COLUMNS": str(WIDTH), "OMP_NUM_THREADS": "1", "CONVCHECK_NO_PROGRESS": "1"}
            env.pop("NO_COLOR", None)
            while argv and "=" in argv[0] and not argv[0].startswith("-"):
                key, _, value = argv.pop(0).partition("=")
                env[key] = value
            assert argv and argv[0] in ("python", "convcheck"), line
            argv = [sys.executable, *argv[1:]] if argv[0] == "python" else \
                [sys.executable, "-m", "convcheck", *argv[1:], "--no-save"]
            done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
            out_lines += [line, *done.stdout.rstrip("\n").splitlines()] if done.stdout.strip() else [line]
    return out_lines


def produce(kind: str, arg: str | None, current: list[str]) -> list[str]:
    """The block's lines as the runs print them now."""
    if kind == "session":
        return session(current)
    if kind == "full":
        out, _, _ = run(arg)
        return out.rstrip("\n").splitlines()
    if kind == "ends":
        lines = run(arg)[0].rstrip("\n").splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("judge "))
        tail = next(i for i, line in enumerate(lines) if line.startswith("Training"))
        return lines[:head + 1] + ["..."] + lines[tail:]
    out_lines: list[str] = []
    for line in current:  # verdicts: the commands are the block's own "=== " lines
        if not line.startswith("=== "):
            continue
        command = line[4:]
        out, code, _ = run(command)
        lines = out.rstrip("\n").splitlines()
        start = next((i for i, x in enumerate(lines) if x.startswith("Verdict:")), len(lines))
        verdict = [x for x in lines[start:] if x.strip() and not x.startswith("wrote ")]
        if out_lines:
            out_lines.append("")
        out_lines += [line, *verdict, f"(exit {code})"]
    return out_lines


def blocks(text: str, name: str = "README.md"):
    """``(kind, arg, first line index, end line index)`` of every marked block (the lines inside the fence)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        start = i + 1
        if not lines[start].startswith("```"):
            raise SystemExit(f"{name}:{start + 1}: a readme-output marker must be followed by a code block")
        end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
        yield m.group(1), m.group(2), start + 1, end


# Lines whose figures the CPU's kernels decide, not convcheck: the one-ulp envelope's runs (Adam's first step
# follows the sign of near-zero gradients, which the summation order of an AVX2 or AVX-512 kernel decides: an
# envelope spread of 0.0026 on one machine is 7.9e-07 on another), the drift measured against that spread, the
# parity table's float32 local errors (1e-8..1e-7, their last bits), and a verification's allowance (read from
# the envelope). Their words are compared - the band a drift falls in ("rounding noise"), the flag column, the
# layer order, the verdict - their values are not (issue 36: the README check passes on any machine).
CHAOTIC = (re.compile(r"^\s*\d+\s+\S+\s+\S+\s+\S+\.\.\S+\s"),  # a loss-table row with its envelope columns
           re.compile(r"x the spread of"),  # a drift against the envelope's spread
           re.compile(r"^\s*\S+\s+(?:fwd|grad)\s"),  # a parity-table row
           re.compile(r"with local error \S+, \S+x the rounding of its result"),
           re.compile(r"; allowed \d+%\)"))


def chaotic(line: str) -> bool:
    return any(p.search(line) for p in CHAOTIC)


def unwrap_prose(lines: list[str]) -> list[str]:
    """The verdict's prose as one line each again: the terminal wraps it to the width (``COLUMNS``), so a
    number one digit wider on another machine moves a break; ``CHAOTIC`` is matched on the whole line."""
    from convcheck.report.verdict_lines import unwrap_prose as unwrap

    return unwrap(lines)


def same(expected: str, got: str, rel_tol: float = REL_TOL) -> bool:
    """The words equal, each number within ``rel_tol`` (whitespace runs ignored: a wider number moves a column);
    on a ``CHAOTIC`` line the words alone. Wrapped prose is compared unwrapped (``unwrap_prose``)."""
    la, lb = unwrap_prose(expected.split("\n")), unwrap_prose(got.split("\n"))  # a verdict's wrapped lines whole
    if len(la) == len(lb) and len(la) > 1:
        return all(same(x, y, rel_tol) for x, y in zip(la, lb))
    if chaotic(expected) and chaotic(got):
        return [" ".join(w.split()) for w in NUMBER.split(expected)] == [" ".join(w.split()) for w in NUMBER.split(got)]
    words_a, words_b = NUMBER.split(expected), NUMBER.split(got)
    if [" ".join(w.split()) for w in words_a] != [" ".join(w.split()) for w in words_b]:
        return False
    for a, b in zip(NUMBER.findall(expected), NUMBER.findall(got)):
        x, y = float(a), float(b)
        if abs(x - y) > rel_tol * max(abs(x), abs(y)) and not (x == y):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the output blocks of README.md and docs/*.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from what the runs print")
    parser.add_argument("--only", default=None, help="only the blocks whose marker contains this text")
    args = parser.parse_args(argv)
    failed = []
    for page in PAGES:
        failed += _page(page, args)
    for f in failed:
        print(f, file=sys.stderr)
    return 1 if failed else 0


def _page(page: Path, args) -> list[str]:
    """One page's blocks checked (the differences, as messages) or, with ``--write``, regenerated."""
    name = str(page.relative_to(ROOT))
    text = page.read_text()
    lines = text.split("\n")
    failed = []
    found = [b for b in blocks(text, name) if not args.only or args.only in f"{b[0]} {b[1] or ''}"]
    for kind, arg, start, end in reversed(found):
        current = lines[start:end]
        fresh = produce(kind, arg, current)
        if args.write:
            lines[start:end] = fresh
        elif not same("\n".join(current), "\n".join(fresh)):
            failed.append(f"{name}:{start + 1}: the {kind} block ({arg or 'its commands'}) differs from what "
                          "the runs print now:\n" + "\n".join(difflib.unified_diff(current, fresh, name, "now",
                                                                                  lineterm="")))
    if args.write and found:
        page.write_text("\n".join(lines))
        print(f"{name}: output blocks regenerated")
    return failed


if __name__ == "__main__":
    sys.exit(main())
