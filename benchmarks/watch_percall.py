"""Where ``convcheck.watch``'s time goes inside a training step (issue 45), timed in the loop itself.

A micro-benchmark of ``stats.measure`` on one tensor says little here: inside a step every torch op costs two to
three times what it costs in a tight loop (the model's own ops keep the caches cold), and a change that wins in
isolation can be lost end to end (``benchmarks/results/watch_overhead-i45-percall.md``). This wraps the watch's own
functions with a ``perf_counter_ns`` timer while ``benchmarks/watch_overhead.py``'s loop runs watched, and prints
each one's time per call and per step (nested functions are counted inside their callers too; the timers' own
cost, ~0.3 us a call, is included).

    OMP_NUM_THREADS=1 python benchmarks/watch_percall.py --model char_gru --steps 4 --rounds 5

``--ab``: no timers; bare and watched rounds alternated in one process, printing the median process time of a step
each way, the watched/bare ratio and the watch's extra time per leaf call (what one change moves; run it from two
checkouts alternately, ``python CHECKOUT/benchmarks/watch_percall.py --ab``, to compare them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convcheck  # noqa: E402
from convcheck.watch import attach, producers, recorder, stats  # noqa: E402
from watch_overhead import _spec, _steps  # noqa: E402

# (owner, attribute): the watch's per-call path first, then its once-a-step work
TIMED = [(attach, "_pre"), (attach, "_post"), (recorder.Watch, "_forward"), (recorder.Watch, "_measure_leaf"),
         (stats, "measure"), (stats, "merge"), (producers.ProducerHooks, "_check_producer"),
         (producers.ProducerHooks, "_note_call"), (torch.Tensor, "register_hook"), (stats, "finite"),
         (recorder.Watch, "_root_pre"), (recorder.Watch, "_root_forward"), (recorder.Watch, "_read_grads"),
         (recorder.Watch, "step"), (recorder.Watch, "_end_step")]


def _timed(fn, key, totals):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            got = totals.setdefault(key, [0, 0])
            got[0] += time.perf_counter_ns() - t0
            got[1] += 1
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="char_gru")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ab", action="store_true", help="bare and watched rounds alternated, no timers")
    args = p.parse_args()
    spec = _spec(args.model)
    torch.manual_seed(0)
    model = spec.factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    make = getattr(spec, "batch", None) or (lambda n, device: (
        torch.randn(n, *spec.input_shape), torch.randint(0, spec.num_classes, (n,))))
    batches = [make(args.batch, "cpu") for _ in range(args.steps)]
    _steps(model, opt, batches[:2])  # warm up
    if args.ab:
        return _ab(model, opt, batches, args.rounds)
    totals: dict = {}
    for owner, name in TIMED:  # before the watch opens: attach registers the module-level hooks it finds then
        if hasattr(owner, name):
            setattr(owner, name, _timed(getattr(owner, name), name, totals))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            with convcheck.watch(model, opt, out=Path(tmp) / f"w{r}", snapshot_steps=()) as w:
                _steps(model, opt, batches, w)
    steps = args.steps * args.rounds
    print(f"{args.model}, {steps} watched steps, {torch.get_num_threads()} threads")
    for _, name in TIMED:
        if name in totals:
            ns, n = totals[name]
            print(f"  {name:<16} {ns / n / 1e3:8.1f} us a call x {n / steps:5.0f} a step = {ns / steps / 1e3:7.0f} us a step")


def _leaf_calls(model, batch) -> int:
    """How many leaf module calls one forward makes (a cell unrolled over time: one per time step)."""
    count = [0]
    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1)) for m in leaves]
    try:
        with torch.no_grad():
            model(batch[0])
    finally:
        for h in handles:
            h.remove()
    return count[0]


def _ab(model, opt, batches, rounds: int) -> None:
    calls = _leaf_calls(model, batches[0]) * len(batches)
    bare, watched = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            bare.append(_steps(model, opt, batches)[1])
            with convcheck.watch(model, opt, out=Path(tmp) / f"w{r}", snapshot_steps=()) as w:
                watched.append(_steps(model, opt, batches, w)[1])
    b, wt = statistics.median(bare), statistics.median(watched)
    print(f"bare {b / len(batches) * 1e3:.2f} ms a step, watched {wt / len(batches) * 1e3:.2f} ms, ratio "
          f"{statistics.median(x / y for x, y in zip(watched, bare)):.3f}, extra {(wt - b) / calls * 1e6:.1f} us per "
          f"leaf call ({calls // len(batches)} a step)")


if __name__ == "__main__":
    main()
