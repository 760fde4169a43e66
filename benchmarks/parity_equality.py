#!/usr/bin/env python
"""Parity's tables before and after a performance change (issue 14, item 2).

    PYTHONPATH=<old tree> python benchmarks/parity_equality.py --save DIR    # the old code's tables
    PYTHONPATH=<new tree> python benchmarks/parity_equality.py --check DIR   # the new code's, compared

Runs ``run_parity`` on lenet (batch 32), cifar_cnn (16) and resnet18 (2) against cpu, cpu:bf16,
cpu:fp16, cpu:emulate-tf32 and cpu:amp-bf16 in one call, and each target alone, and compares every
column of the table, the losses, the self differences, the stochastic layers and the first flagged
layers. Without ``--rtol`` a value must be bitwise the same; with it, a float column may move by that
relative amount (a change that computes the same quantity in another order) while every text,
count and flag, and so every verdict read from the table, must stay the same. Nothing is timed.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
from pathlib import Path

import torch

from convcheck.plan.seeded_data import load_batches
from convcheck.plan.models import resolve_model
from convcheck.measure.parity import run_parity
from convcheck.pipeline import initial_state, model_builder
from convcheck.measure.table_schema import named
from convcheck.targets.spec import Target

MODELS = {"lenet": 32, "cifar_cnn": 16, "resnet18": 2}
TARGETS = ["cpu", "cpu:bf16", "cpu:fp16", "cpu:emulate-tf32", "cpu:amp-bf16"]
FLOAT_COLUMNS = ("K", "u", "floor", "bound", "propagated", "local", "intrinsic", "over_floor", "needed", "ref_absmax")


def cases():
    """(label, thunk) for every run compared: all targets in one call, then each alone."""
    for name, batch in MODELS.items():
        yield f"{name}-all", (lambda n=name, b=batch: _run(n, b, TARGETS))
        for t in TARGETS:
            yield f"{name}-{t}", (lambda n=name, b=batch, t=t: _run(n, b, [t]))


def _run(name: str, batch: int, targets: list[str]) -> dict:
    resolved = resolve_model(name)
    build = model_builder(resolved, initial_state(resolved, 0))
    x, y = next(iter(load_batches(None, input_shape=resolved.input_shape, num_classes=resolved.num_classes,
                                  batch_size=batch, num_batches=1, seed=0).batches))
    r = run_parity(build, (x, y), [Target.parse(t) for t in targets], seed=0)
    # keyed by name and in lists, as the result held them before it keyed them by Target (saved tables compare)
    return dict(layers=r.layers, first=named(r.first_flagged), losses=named(r.losses),
                selfdiff=named(r.self_difference), stochastic=list(r.stochastic_layers), judge_loss=r.judge_loss)


def _same(a, b, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if a == b:
            return math.copysign(1, a) == math.copysign(1, b)
        return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * max(abs(a), abs(b))
    return a == b


def differences(old: dict, new: dict, rtol: float) -> list[str]:
    """Every value that differs (beyond ``rtol`` for float columns)."""
    a, b = old["layers"], new["layers"]
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return [f"layers: shape {a.shape} -> {b.shape}"]
    out = []
    for col in a.columns:
        tol = rtol if col in FLOAT_COLUMNS else 0.0
        bad = [i for i, (x, y) in enumerate(zip(a[col].tolist(), b[col].tolist())) if not _same(x, y, tol)]
        if bad:
            i = bad[0]
            out.append(f"layers.{col}: {len(bad)} rows differ, first at {i} ({a['layer'].iloc[i]}): "
                       f"{a[col].iloc[i]!r} -> {b[col].iloc[i]!r}")
    for key in ("first", "stochastic"):
        if old[key] != new[key]:
            out.append(f"{key}: {old[key]} -> {new[key]}")
    for key in ("losses", "selfdiff"):
        if old[key].keys() != new[key].keys() or any(not _same(old[key][k], new[key][k], 0.0) for k in old[key]):
            out.append(f"{key}: {old[key]} -> {new[key]}")
    if not _same(old["judge_loss"], new["judge_loss"], 0.0):
        out.append(f"judge_loss: {old['judge_loss']!r} -> {new['judge_loss']!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, help="write this code's tables under this folder")
    mode.add_argument("--check", type=Path, help="compare this code's tables with those saved there")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative change allowed in float columns (default 0)")
    ap.add_argument("--only", default="", help="comma-separated case labels (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    only = {s for s in args.only.split(",") if s}
    failed = 0
    for label, run in cases():
        if only and label not in only:
            continue
        got = run()
        path = (args.save or args.check) / f"{label}.pkl"
        if args.save:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pickle.dumps(got))
            print(f"{label}: saved ({len(got['layers'])} rows)", flush=True)
            continue
        diff = differences(pickle.loads(path.read_bytes()), got, args.rtol)
        failed += bool(diff)
        print(f"{label}: {'equal' if diff == [] else 'DIFFERENT'}" + "".join(f"\n  {d}" for d in diff), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
