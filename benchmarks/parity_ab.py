#!/usr/bin/env python
"""Two or more versions of parity in one process, alternated run by run (issue 14, item 2).

    python benchmarks/parity_ab.py MODEL TARGET RUNS VARIANTS.py     # e.g. lenet cpu 60 my_variants.py

``VARIANTS.py`` defines ``VARIANTS = {name: setup}``: each ``setup()`` puts its version in place (a
monkeypatch of the code under test: the old function and the new one, a shortcut switched off and on).
Every round runs ``run_parity`` once per variant, in order, then one bare step in the judge's and in
the target's precision (the floor, sampled as the rounds go). A machine whose speed drifts (this VM's
floors move 10-15% between processes) drifts under every variant alike, which separate before/after
processes (``run.py`` on two checkouts) cannot promise: a change of a few percent shows here first.
Prints each variant's minimum and median and its median over the floor's median. Nothing is asserted.

Example ``VARIANTS.py`` (the own-code shortcut of ``judge_pass.passes_on`` off and on)::

    import convcheck.measure.parity.judge_pass as J
    new = J.passes_on
    def use(f):
        def setup(): J.passes_on = f
        return setup
    VARIANTS = {"replayed": use(lambda call, output: False), "passes_on": use(new)}
"""

from __future__ import annotations

import runpy
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import run as bench  # noqa: E402
from convcheck.measure.parity import run_parity  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    name, target, rounds, variants = argv[0], Target.parse(argv[1]), int(argv[2]), runpy.run_path(argv[3])["VARIANTS"]
    torch.set_num_threads(1)
    resolved = bench._resolved(name)
    batches = bench._batches(resolved, bench.MODEL_PLAN[name]["batch"], 2)
    build = bench.model_builder(resolved, bench.initial_state(resolved, bench.SEED))
    run = lambda: run_parity(build, batches[0], [target], judge=bench.JUDGE, seed=bench.SEED)  # noqa: E731
    floors = [bench.BareModel(name, batches, bench.JUDGE), bench.BareModel(name, batches, target)]
    for setup in variants.values():  # a warm-up of each
        setup()
        run()
    for m in floors:
        m.step()
    times: dict[str, list[float]] = {k: [] for k in variants}
    floor: list[float] = []
    for _ in range(rounds):
        for k, setup in variants.items():
            setup()
            times[k].append(bench._timed(run, target))
        floor.append(sum(m.time_step() for m in floors))
    f = statistics.median(floor)
    print(f"{name} {target}: floor median {f * 1e3:.2f} ms, min {min(floor) * 1e3:.2f} ms ({rounds} rounds)")
    for k, xs in times.items():
        print(f"  {k:16s} min {min(xs) * 1e3:9.2f} ms  median {statistics.median(xs) * 1e3:9.2f} ms  "
              f"x floor {statistics.median(xs) / f:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
