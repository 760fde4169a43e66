#!/usr/bin/env python
"""The time ``round_to`` takes inside ``run_parity``, main's checks against this tree's (issue 28).

    python benchmarks/rounding_cost.py MODEL TARGET ROUNDS      # e.g. cifar_cnn cpu:emulate-tf32 4

One process, one thread: each round runs ``run_parity`` once with main's ``round_to`` internals and once
with this tree's (``variants/round_to_main.py``), timing what ``_has_subnormal`` and ``_round_bits`` take
(the subnormal test and the bit rounding: every TF32 rounding of the floors and the emulated target)
and the whole run. Prints min and median of each after a warm-up round. Nothing is asserted.
"""

from __future__ import annotations

import runpy
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import run as bench  # noqa: E402
import convcheck.targets.runners.precision as P  # noqa: E402
from convcheck.measure.parity import run_parity  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    name, target, rounds = argv[0], Target.parse(argv[1]), int(argv[2])
    variants = runpy.run_path(str(HERE / "variants" / "round_to_main.py"))["VARIANTS"]
    torch.set_num_threads(1)
    resolved = bench._resolved(name)
    batches = bench._batches(resolved, bench.MODEL_PLAN[name]["batch"], 2)
    build = bench.model_builder(resolved, bench.initial_state(resolved, bench.SEED))
    spent: dict[str, list[float]] = {k: [] for k in variants}
    total: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):
        for k, setup in variants.items():
            setup()
            fns, acc = (P._has_subnormal, P._round_bits), [0.0]

            def timed(f):
                def call(*a, **kw):
                    t0 = time.perf_counter()
                    try:
                        return f(*a, **kw)
                    finally:
                        acc[0] += time.perf_counter() - t0
                return call

            P._has_subnormal, P._round_bits = timed(fns[0]), timed(fns[1])
            t0 = time.perf_counter()
            try:
                run_parity(build, batches[0], [target], judge=bench.JUDGE, seed=bench.SEED)
            finally:
                P._has_subnormal, P._round_bits = fns
            if r:  # round 0 warms up
                spent[k].append(acc[0])
                total[k].append(time.perf_counter() - t0)
    for k in variants:
        print(f"{name} {target} {k:6s}: rounding min {min(spent[k]) * 1e3:8.1f} ms  median "
              f"{statistics.median(spent[k]) * 1e3:8.1f} ms;  run_parity min {min(total[k]) * 1e3:8.1f} ms  "
              f"median {statistics.median(total[k]) * 1e3:8.1f} ms  ({rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
