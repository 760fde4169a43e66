#!/usr/bin/env python
"""Where one ``run_parity`` spends its time, phase by phase (issue 14, item 2).

    python benchmarks/parity_phases.py MODEL TARGET [RUNS]     # e.g. lenet cpu 40

In one process, one thread: ``run_parity`` of the zoo model (``run.MODEL_PLAN``'s batch) for TARGET
against this machine's judge, RUNS times after a warm-up, with its phases wrapped in timers (the
builds, the judge's pass, the target's pass and inside it each leaf call's measurement, the
local runs, the forward rows' errors, the own-code rows, the gradient rows; the float64 floors'
forward/backward). Prints each phase's median and minimum per run, then the floor (one bare step
in the judge's and in the target's precision, min of 7). Phases nest (indented): a phase's time
includes those under it. Nothing is asserted.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import run as bench  # noqa: E402
import convcheck.measure.parity as parity  # noqa: E402
from convcheck.measure.parity import floor, target_pass  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402

PHASES = [  # (owner, attribute, label): indented labels nest in the one above
    (parity, "run_judge", "judge's pass"),
    (target_pass.TargetPass, "run", "target's pass"),
    (target_pass.TargetPass, "_measure_call", "  leaf calls' rows"),
    (target_pass.TargetPass, "_local_output", "    local runs"),
    (target_pass, "cast_args", "      judge's inputs cast"),
    (target_pass, "local_forward_backward", "      forward/backward of a layer"),
    (target_pass, "target_call", "      forward of a layer"),
    (target_pass.TargetPass, "_local_checks", "      gradient rows' local columns"),
    (floor.FloorMeter, "grads", "        gradient floors"),
    (floor, "reference_forward_backward", "          float64 forward/backward"),
    (target_pass.Judged, "take", "    judge's output read (Judged.take)"),
    (target_pass.TargetPass, "_propagated", "    propagated error"),
    (target_pass.TargetPass, "_row", "    row and NaN/Inf counts"),
    (target_pass.TargetPass, "_forward_errors", "    forward rows' errors"),
    (target_pass.TargetPass, "_grad_out", "  output gradients' NaN/Inf counts"),
    (target_pass.TargetPass, "_grad_in", "  input gradients' NaN/Inf counts"),
    (target_pass.TargetPass, "_measure_parent", "  own-code rows"),
    (target_pass.TargetPass, "_grad_rows", "  gradient rows"),
]


def _wrap(times: dict, owner, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - t0

    setattr(owner, attr, timed)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    name, target, runs = argv[0], Target.parse(argv[1]), int(argv[2]) if len(argv) == 3 else 20
    torch.set_num_threads(1)
    resolved = bench._resolved(name)
    batches = bench._batches(resolved, bench.MODEL_PLAN[name]["batch"], 2)
    made = bench.model_builder(resolved, bench.initial_state(resolved, bench.SEED))
    times: dict[str, float] = collections.defaultdict(float)

    def build(t):
        t0 = time.perf_counter()
        try:
            return made(t)
        finally:
            times["builds"] += time.perf_counter() - t0

    for owner, attr, label in PHASES:
        _wrap(times, owner, attr, label)
    run = lambda: parity.run_parity(build, batches[0], [target], judge=bench.JUDGE, seed=bench.SEED)  # noqa: E731
    run()
    per_run, totals = [], []
    for _ in range(runs):
        times.clear()
        t0 = time.perf_counter()
        run()
        totals.append(time.perf_counter() - t0)
        per_run.append(dict(times))
    print(f"{name} {target}: run_parity median {statistics.median(totals) * 1e3:.2f} ms, "
          f"min {min(totals) * 1e3:.2f} ms ({runs} runs)")
    for label in ["builds"] + [p[2] for p in PHASES]:
        v = [r.get(label, 0.0) for r in per_run]
        print(f"  {label:34s} median {statistics.median(v) * 1e3:8.2f} ms   min {min(v) * 1e3:8.2f} ms")
    floors = [bench.BareModel(name, batches, bench.JUDGE), bench.BareModel(name, batches, target)]
    for m in floors:
        m.step()
    steps = [min(m.time_step() for _ in range(7)) for m in floors]
    print(f"  floor: bare step @{bench.JUDGE} {steps[0] * 1e3:.2f} ms + @{target} {steps[1] * 1e3:.2f} ms "
          f"= {sum(steps) * 1e3:.2f} ms; run_parity min x{min(totals) / sum(steps):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
