#!/usr/bin/env python
"""The bare run a ``convcheck compare`` is held against: N plain training steps of the zoo model.

    python benchmarks/bare_steps.py MODEL [--target cuda] [--steps 10] [--batch-size 32] [--runs 2]

One process, no convcheck in the loop: ``run.BareModel`` (the zoo model placed for the target,
convcheck's default optimizer and learning rate, the synthetic batches ``compare`` would draw)
makes ``--steps`` steps from fresh weights, ``--runs`` times; each run is timed from building the
model to the last step's end (the device synchronised), so the first run pays what a first run
pays (cuDNN's algorithm search, allocator growth) and the later ones do not. Prints one JSON
object: every run's seconds, ``cold_s`` (the first), ``warm_s`` (the fastest of the others: the
stricter denominator) and the device. ``scripts/device-check`` divides its ResNet-50 compare's
wall time and stages by ``warm_s`` (issue 14, item 3: goal within 20x). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import run as bench  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def one_run(name: str, batches, target: Target, steps: int) -> float:
    bench._sync(target)
    t0 = time.perf_counter()
    model = bench.BareModel(name, batches, target)
    for _ in range(steps):
        model.step()
    bench._sync(target)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bare_steps", description=__doc__.strip().splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--target", default="cpu", help="a convcheck target (default cpu: float32)")
    ap.add_argument("--steps", type=_positive, default=10)
    ap.add_argument("--batch-size", type=_positive, default=32)
    ap.add_argument("--runs", type=_positive, default=2)
    args = ap.parse_args(argv)
    target = Target.parse(args.target)
    resolved = bench._resolved(args.model)
    batches = bench._batches(resolved, args.batch_size, args.steps)  # one batch a step, as compare draws
    runs = [one_run(args.model, batches, target, args.steps) for _ in range(args.runs)]
    device = (torch.cuda.get_device_name(target.torch_device) if target.torch_device.type == "cuda"
              else platform.processor() or platform.machine())
    print(json.dumps({
        "model": args.model, "target": str(target), "steps": args.steps, "batch_size": args.batch_size,
        "runs_s": [round(r, 4) for r in runs], "cold_s": round(runs[0], 4),
        "warm_s": round(min(runs[1:]) if len(runs) > 1 else runs[0], 4),
        "device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
