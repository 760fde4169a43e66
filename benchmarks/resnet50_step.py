#!/usr/bin/env python
"""ResNet-50 at 224x224: the time and memory of one training step per target, bare (issue 44).

    python benchmarks/resnet50_step.py [--targets cpu,cpu:float64] [--batch-size 2] [--steps 3]
    python benchmarks/resnet50_step.py --targets cuda,cuda:tf32,cuda:amp-bf16,cuda:float64 --batch-size 32   # a GPU

What a ``convcheck compare --model resnet50`` has to pay for at the least: each arm's training step (the float32
target, the float64 judge). One process, the zoo's ``resnet50`` (torchvision's layout, 1000 classes) placed for
each target in turn, convcheck's default optimizer (Adam, lr 1e-3) and the synthetic 224x224 batches ``compare``
draws (``run.BareModel``), each target in a process of its own (its peak memory is its own). One warm-up step, then ``--steps`` timed steps (the device synchronised); the figure is
their median. Memory: on the CPU the growth of the process's peak resident set from before the model was built to
the last step (``ru_maxrss``: the model, its gradients, Adam's two moments, the activations of one step); on a GPU
``torch.cuda.max_memory_allocated`` over the same span. Prints a Markdown table and, with ``--json FILE``, every
sample. Keep it small on a shared machine (batch 2-4, a few steps). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import run as bench  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402

MODEL = "resnet50"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def measure(target: Target, batches, steps: int) -> dict:
    gc.collect()
    cuda = target.torch_device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(target.torch_device)
        before = torch.cuda.memory_allocated(target.torch_device) / 2**20
    else:
        before = _peak_mib()
    model = bench.BareModel(MODEL, batches, target)
    model.step()  # warm-up: the allocator's growth, the first call's one-off costs
    times = []
    for _ in range(steps):
        bench._sync(target)
        t0 = time.perf_counter()
        model.step()
        bench._sync(target)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(target.torch_device) / 2**20) if cuda else _peak_mib()
    del model
    return {"target": str(target), "step_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3),
            "memory_mib": round(peak - before), "memory_what": "cuda max allocated" if cuda else "peak RSS growth"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="resnet50_step", description=__doc__.strip().splitlines()[0])
    ap.add_argument("--targets", default="cpu,cpu:float64")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write every sample to this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one target, its row as JSON
    args = ap.parse_args(argv)
    if args.one:
        resolved = bench._resolved(MODEL)
        batches = bench._batches(resolved, args.batch_size, args.steps + 1)
        print(json.dumps(measure(Target.parse(args.one), batches, args.steps)))
        return 0
    targets = [Target.parse(s) for s in args.targets.split(",")]
    rows = []
    for t in targets:
        done = subprocess.run([sys.executable, __file__, "--one", str(t), "--batch-size", str(args.batch_size),
                               "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    device = ", ".join(sorted({torch.cuda.get_device_name(t.torch_device) if t.torch_device.type == "cuda"
                               else (platform.processor() or platform.machine()) for t in targets}))
    print(f"{MODEL} at 3x224x224, batch {args.batch_size}, {args.steps} timed steps after one warm-up; {device}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| target | s / step (median) | steps (s) | memory (MiB) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| `{r['target']}` | {r['median_s']} | {', '.join(map(str, r['step_s']))} | "
              f"{r['memory_mib']} ({r['memory_what']}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": MODEL, "batch_size": args.batch_size, "steps": args.steps,
                                               "device": device, "torch": torch.__version__,
                                               "threads": torch.get_num_threads(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
