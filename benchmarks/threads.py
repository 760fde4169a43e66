#!/usr/bin/env python
"""The thread choice (issue 28): ``convcheck compare`` as a user runs it, with the choice and at fixed counts.

    python benchmarks/threads.py [--model lenet] [--rounds 2] [--busy] [-- EXTRA COMPARE OPTIONS]

Runs ``python -m convcheck compare --model MODEL --no-save`` in child processes, alternately: with no
thread setting (convcheck measures and keeps the faster of 1 and the default), with ``--threads 1``,
and with ``--threads <torch's default>``; ROUNDS rounds, the order rotated each round. ``--busy``
keeps one core busy for the whole run (``python -c 'while True: pass'``, the README's scenario).
Prints each run's wall time (torch's import included, alike for every mode), the header's
``threads:`` line and the load average, then each mode's median. Nothing is asserted; a shared
machine moves every figure, so read the modes against each other, round by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _default_threads() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, env=_env(), check=True)
    return int(out.stdout.strip())


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["CONVCHECK_NO_PROGRESS"] = "1"
    return env


def _one(model: str, mode: list[str], extra: list[str]) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "convcheck", "compare", "--model", model, "--no-save", *mode, *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()[-300:]}")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("threads:")), "threads: ?")
    return wall, line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="keep one core busy while measuring")
    ap.add_argument("extra", nargs="*", help="more compare options (after --)")
    args = ap.parse_args(argv)
    default = _default_threads()
    modes = {"chosen": [], "--threads 1": ["--threads", "1"], f"--threads {default}": ["--threads", str(default)]}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    walls: dict[str, list[float]] = {m: [] for m in modes}
    try:
        names = list(modes)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                wall, line = _one(args.model, modes[name], args.extra)
                walls[name].append(wall)
                print(f"round {r + 1} {name:>12}: {wall:6.1f} s  {line}  load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print(f"\n{args.model}, {'one core kept busy' if args.busy else 'no busy loop of ours'}, torch default "
          f"{default} threads: median wall s " + ", ".join(f"{m} {statistics.median(v):.1f}" for m, v in walls.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
