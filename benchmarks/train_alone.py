#!/usr/bin/env python
"""Training alone against its floor, for a before/after of one tree against another (issue 14, item 2).

    python benchmarks/train_alone.py ROOT MODEL REPEATS PAIR     # e.g. . resnet18 3 cpu,cpu:bf16

Imports convcheck and ``benchmarks/run.py`` from ROOT (a checkout: alternate two of them, one process
each, to compare). In one process, one thread: ``run_training`` on ``make_arms(PAIR, envelope=3)`` for
the model's planned steps (``run.MODEL_PLAN``), REPEATS times after a warm-up, each followed by one bare
step of every arm's precision (``run.BareModel``); prints the median against the steps x the sum over
arms of the median bare steps. ``run.py`` times training only once per parity target set and with
the other measurements around it; this times nothing else. Nothing is asserted.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    root = str(Path(argv[0]).resolve())
    sys.path[:0] = [root, str(Path(root) / "benchmarks")]
    import torch

    import run as bench  # noqa: E402 - from ROOT
    import convcheck
    from convcheck.targets.spec import Target
    from convcheck.measure.train import TrainConfig, make_arms, run_training

    if not convcheck.__file__.startswith(root):
        print(f"convcheck came from {convcheck.__file__}, not {root}", file=sys.stderr)
        return 2
    name, reps, pair = argv[1], int(argv[2]), [Target.parse(s) for s in argv[3].split(",")]
    torch.set_num_threads(1)
    plan = bench.MODEL_PLAN[name]
    resolved = bench._resolved(name)
    steps = plan["steps"]
    batches = bench._batches(resolved, plan["batch"], steps)
    build = bench.model_builder(resolved, bench.initial_state(resolved, 0))
    arms = make_arms(pair, 3, 0, bench.JUDGE)
    cfg = TrainConfig(steps=steps, seed=0)
    bare = {str(a.target): None for a in arms}
    for spec in bare:
        bare[spec] = bench.BareModel(name, batches, Target.parse(spec))
        bare[spec].step()
    run_training(build, batches, arms, cfg)  # warm-up
    times, floors = [], {spec: [] for spec in bare}
    for _ in range(reps):
        times.append(bench._timed(lambda: run_training(build, batches, arms, cfg)))
        for spec, m in bare.items():
            floors[spec].append(bench._timed(m.step))
    floor = steps * sum(statistics.median(floors[str(a.target)]) for a in arms)
    took = statistics.median(times)
    print(f"{root} {name} {argv[3]}: training {took:.3f} s, floor {floor:.3f} s -> {took / floor:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
