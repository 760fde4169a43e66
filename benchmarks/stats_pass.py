"""What one tensor's statistics cost (issue 45): ``watch/stats.measure`` now against an earlier revision's, in one
process, alternated call by call.

The tensors are 1M-element float32 (``--numel``) outputs of the kinds a model makes: both signs and no zero (a
Linear's), ReLU's (zeros), positive (a softmax's), and a bfloat16 one; each is measured ``--calls`` times per
round by each version in turn, and the figure is the median over ``--rounds`` rounds of each round's fastest
call (a shared machine's noise only ever adds time). One thread (``--threads``): a loaded machine's other cores
make intra-op parallel timings swing by 10x. The recorded values of both versions are compared too (relative
difference of each statistic, expected at rounding).

    python benchmarks/stats_pass.py --before 94502ac
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from convcheck.watch import stats as now  # noqa: E402


def load_before(rev: str):
    """``convcheck/watch/stats.py`` as it was at ``rev``, imported as a module of its own."""
    text = subprocess.run(["git", "show", f"{rev}:convcheck/watch/stats.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "stats_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("stats_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tensors(numel: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    return {"linear (both signs)": x, "relu (zeros)": torch.relu(x), "softmax (positive)": x.exp(),
            "bfloat16 (both signs)": x.bfloat16()}


def fastest(fn, t, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(t)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="94502ac", help="the revision to compare with (default: before issue 45's "
                                                       "one-pass change)")
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = load_before(args.before)
    print(f"stats.measure on {args.numel} elements, {args.threads} thread(s), median over {args.rounds} rounds of "
          f"the fastest of {args.calls} calls; before = {args.before}")
    print(f"{'tensor':24s} {'before ms':>10s} {'now ms':>10s} {'now/before':>11s} {'largest value diff':>19s}")
    for name, t in tensors(args.numel).items():
        b, n = [], []
        for _ in range(args.rounds):
            b.append(fastest(before.measure, t, args.calls))
            n.append(fastest(now.measure, t, args.calls))
        rb, rn = before.finish(before.measure(t)), now.finish(now.measure(t))
        diff = max((abs(rn[k] - rb[k]) / max(abs(rb[k]), abs(rn[k])) if rb[k] != rn[k] else 0.0)
                   for k in ("max_abs", "mean", "std", "zeros", "min_nonzero") if rb[k] is not None)
        mb, mn = statistics.median(b) * 1e3, statistics.median(n) * 1e3
        print(f"{name:24s} {mb:10.3f} {mn:10.3f} {mn / mb:11.2f} {diff:19.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
