"""What one tensor's statistics cost (issue 45): ``watch/stats.measure`` now against an earlier revision's, in one
process, alternated call by call.

The tensors are outputs of the kinds a model makes, ``--numel`` elements each (a comma-separated list; a batch of
16 NCHW images of 32 channels where the size allows, ``tensors``): both signs and no zero (a conv's, a Linear's),
ReLU's (half zeros), a max-pool of ReLU's (a quarter zeros), positive (a softmax's), a channels_last conv output, and
a bfloat16 one; each is measured ``--calls`` times per round by each version in turn, and the figure is the median
over ``--rounds`` rounds of each round's fastest call (a shared machine's noise only ever adds time). One thread
(``--threads``): a loaded machine's other cores make intra-op parallel timings swing by 10x. The recorded values of
both versions are compared too (the largest relative difference of the finished statistics, and whether the raw sum
and sum of squares are the same bit for bit).

``--in-loop MODELS`` (cifar_cnn,resnet18,transformer: ``watch_overhead.py``'s): the same two versions timed inside the
watched training loop instead, per layer: ``stats.measure`` wrapped with a timer while the watch runs, rounds
alternating the two versions (a micro-benchmark's warm caches make every pass look two to four times cheaper than
it is between a model's own ops). Prints each leaf output's shape, kind (both signs, zeros, positive), median us a
call each way, and the totals a step.

    python benchmarks/stats_pass.py --before 94502ac
    OMP_NUM_THREADS=1 python benchmarks/stats_pass.py --before HEAD --numel 131072,524288,3211264
    OMP_NUM_THREADS=1 python benchmarks/stats_pass.py --before HEAD --in-loop cifar_cnn,transformer --rounds 8
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
    """The kinds of output measured, ``numel`` elements each (a batch of 16 images of 32 channels, H x 2, where
    ``numel`` is a multiple of 1024; else one row, with no channels_last form)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, numel // 1024, 2, generator=g) if numel % 1024 == 0 else torch.randn(numel, generator=g)
    relu = torch.relu(x)
    out = {"conv (both signs)": x, "relu (half zeros)": relu, "softmax (positive)": x.exp(),
           "bfloat16 (both signs)": x.bfloat16()}
    if x.dim() == 4:  # a 1x2 max-pool of the ReLU's: a quarter zeros, half the elements
        out["maxpool of relu"] = torch.nn.functional.max_pool2d(relu, (1, 2))
        out["channels_last conv"] = x.contiguous(memory_format=torch.channels_last)
    return out


def fastest(fn, t, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(t)
        best = min(best, time.perf_counter() - t0)
    return best


def in_loop(before, model_name: str, rounds: int, steps: int = 4, batch: int = 16) -> None:
    """Per layer, ``measure``'s time inside the watched loop of ``model_name``, the two versions alternated by round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import convcheck
    from watch_overhead import _spec, _steps

    spec = _spec(model_name)
    torch.manual_seed(0)
    model = spec.factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(batch, *spec.input_shape), torch.randint(0, spec.num_classes, (batch,)))
               for _ in range(steps)]
    _steps(model, opt, batches[:2])  # warm up
    original = now.measure
    times: dict = {"before": {}, "now": {}}
    kinds: dict = {}
    state = {"fn": original, "side": "now", "call": 0}

    def timed(t):
        t0 = time.perf_counter_ns()
        row = state["fn"](t)
        took = (time.perf_counter_ns() - t0) / 1e3
        i = state["call"]
        state["call"] += 1
        times[state["side"]].setdefault(i, []).append(took)
        if i not in kinds:
            kinds[i] = (tuple(t.shape), "zeros" if row["zeros"] else "both" if float(t.detach().amin()) < 0 else "pos")
        return row

    now.measure = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                sides = [("before", before.measure), ("now", original)]
                for side, fn in sides if r % 2 == 0 else sides[::-1]:
                    state["fn"], state["side"] = fn, side
                    with convcheck.watch(model, opt, out=Path(tmp) / f"{side}{r}", snapshot_steps=()) as w:
                        for x, y in batches:
                            state["call"] = 0
                            loss = torch.nn.functional.cross_entropy(model(x), y)
                            opt.zero_grad()
                            loss.backward()
                            opt.step()
                            w.step(loss)
    finally:
        now.measure = original
    print(f"{model_name}: stats.measure in the watched loop, median us a call over {rounds} rounds x {steps} steps "
          f"(batch {batch})")
    print(f"{'#':>3} {'shape':22s} {'kind':6s} {'before':>9s} {'now':>9s} {'now/before':>11s}")
    totals: dict = {}
    for i in sorted(kinds):
        b, n = statistics.median(times["before"][i]), statistics.median(times["now"][i])
        for key in (kinds[i][1], "all"):
            got = totals.setdefault(key, [0, 0.0, 0.0])
            got[0], got[1], got[2] = got[0] + 1, got[1] + b, got[2] + n
        print(f"{i:3d} {str(kinds[i][0]):22s} {kinds[i][1]:6s} {b:9.1f} {n:9.1f} {n / b:11.2f}")
    for key, (count, b, n) in totals.items():
        print(f"    {key:5s} x{count:<3d} a step: before {b / 1e3:7.2f} ms, now {n / 1e3:7.2f} ms ({n / b:.2f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="94502ac", help="the revision to compare with (default: before issue 45's "
                                                       "one-pass change)")
    p.add_argument("--numel", default=str(1 << 20), help="elements of each tensor, comma-separated sizes")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--in-loop", default=None, metavar="MODELS", help="time measure inside these models' watched loops")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = load_before(args.before)
    if args.in_loop:
        for name in args.in_loop.split(","):
            in_loop(before, name, args.rounds)
        return 0
    for numel in (int(v) for v in args.numel.split(",")):
        print(f"stats.measure on {numel} elements, {args.threads} thread(s), median over {args.rounds} rounds of "
              f"the fastest of {args.calls} calls; before = {args.before}")
        print(f"{'tensor':24s} {'before ms':>10s} {'now ms':>10s} {'now/before':>11s} {'largest value diff':>19s} "
              f"{'sums':>9s}")
        for name, t in tensors(numel).items():
            b, n = [], []
            for _ in range(args.rounds):
                b.append(fastest(before.measure, t, args.calls))
                n.append(fastest(now.measure, t, args.calls))
            raw_b, raw_n = before.measure(t), now.measure(t)
            rb, rn = before.finish(raw_b), now.finish(raw_n)
            diff = max((abs(rn[k] - rb[k]) / max(abs(rb[k]), abs(rn[k])) if rb[k] != rn[k] else 0.0)
                       for k in ("max_abs", "mean", "std", "zeros", "min_nonzero") if rb[k] is not None)
            same = "same" if (raw_b["sum"], raw_b["sumsq"]) == (raw_n["sum"], raw_n["sumsq"]) else "differ"
            mb, mn = statistics.median(b) * 1e3, statistics.median(n) * 1e3
            print(f"{name:24s} {mb:10.3f} {mn:10.3f} {mn / mb:11.2f} {diff:19.2e} {same:>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
