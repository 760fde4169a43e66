"""The watch on an accelerator (issue 35): a watched step against a bare one, reading once a step and per layer.

ResNet-50 at batch 64 under bfloat16 autocast by default (the issue's goal: the watch <= 1.10x a bare step with
``sync="step"``). Bare, ``sync="step"`` and ``sync="layer"`` rounds alternate in one process; each figure is the
median over the rounds of that round's seconds over the bare round's. Prints one JSON object (``scripts/
device-check`` keeps it as ``watch-gpu.json``). Runs on the CPU too (``--device cpu``), for its plumbing.

    python benchmarks/watch_gpu.py --model resnet50 --batch 64 --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convcheck  # noqa: E402
from reference_models import get_spec  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _round(model, opt, batches, device: str, dtype, w=None) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for x, y in batches:
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = p.parse_args()
    dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    spec = get_spec(args.model)
    torch.manual_seed(0)
    model = spec.factory().to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [(torch.randn(args.batch, *spec.input_shape, device=args.device),
                torch.randint(0, spec.num_classes, (args.batch,), device=args.device)) for _ in range(args.steps)]
    _round(model, opt, batches[:2], args.device, dtype)  # warm up (cuDNN's algorithm search, the allocator)
    ratios: dict = {"step": [], "layer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            bare = _round(model, opt, batches, args.device, dtype)
            for sync in ("step", "layer"):
                with convcheck.watch(model, opt, out=Path(tmp) / f"{sync}{r}", snapshot_steps=(), sync=sync) as w:
                    ratios[sync].append(_round(model, opt, batches, args.device, dtype, w) / bare)
    print(json.dumps({"model": args.model, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                      "device": args.device, "autocast": args.dtype, "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                      "watch_step_ratio": statistics.median(ratios["step"]),
                      "watch_layer_ratio": statistics.median(ratios["layer"]), "goal_ratio": 1.10,
                      "rounds_step": ratios["step"], "rounds_layer": ratios["layer"]}, indent=1))


if __name__ == "__main__":
    main()
