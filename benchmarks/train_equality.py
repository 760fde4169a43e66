#!/usr/bin/env python
"""Training's figures, bitwise, before and after a performance change (issue 14, item 2).

    PYTHONPATH=<old tree> python benchmarks/train_equality.py --save DIR    # the old code's figures
    PYTHONPATH=<new tree> python benchmarks/train_equality.py --check DIR   # the new code's, compared

Runs ``run_training`` on lenet, cifar_cnn and resnet18 for the arm sets the benchmark and the
suite use (``make_arms([cpu, cpu:bf16], envelope=3)``, ``make_arms([cpu, cpu:emulate-tf32],
envelope=3)``, and the benchmark's default pair) plus a clipped SGD recipe on lenet, and compares
the curves, layer_grads and activations tables and the non-finite producers with ``DataFrame.equals``
and exact float equality (NaN equal to NaN only where both are NaN). A shortcut that moves any
figure's last bit fails here. Nothing is timed.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
from pathlib import Path

import pandas as pd
import torch

from convcheck.plan.config import CompareConfig
from convcheck.plan.seeded_data import load_batches
from convcheck.plan.models import resolve_model
from convcheck.pipeline import initial_state, model_builder
from convcheck.plan.recipe import build_recipe
from convcheck.targets.spec import Target, default_judge
from convcheck.measure.train import TrainConfig, make_arms, run_training

PAIRS = {"bf16": ["cpu", "cpu:bf16"], "tf32": ["cpu", "cpu:emulate-tf32"], "f64": ["cpu", "cpu:float64"]}
# model: (batch, steps, pairs)
PLAN = {"lenet": (16, 4, ("bf16", "tf32", "f64")), "cifar_cnn": (8, 3, ("bf16", "tf32", "f64")),
        "resnet18": (2, 2, ("bf16", "tf32"))}


def cases():
    """(label, thunk) for every run compared."""
    judge = default_judge()[0]
    for name, (batch, steps, pairs) in PLAN.items():
        for pair in pairs:
            yield f"{name}-{pair}", (lambda n=name, b=batch, s=steps, p=pair: _run(n, b, s, PAIRS[p], judge, None))
    clipped = build_recipe(CompareConfig(optimizer="sgd", lr=0.05, clip_grad_norm=0.5))
    yield "lenet-bf16-clipped-sgd", lambda: _run("lenet", 16, 4, PAIRS["bf16"], judge, clipped)


def _run(name, batch, steps, pair, judge, recipe) -> dict:
    resolved = resolve_model(name)
    build = model_builder(resolved, initial_state(resolved, 0))
    batches = list(load_batches(None, input_shape=resolved.input_shape, num_classes=resolved.num_classes,
                                batch_size=batch, num_batches=steps, seed=0).batches)
    arms = make_arms([Target.parse(s) for s in pair], envelope=3, seed=0, judge=judge)
    r = run_training(build, batches, arms, TrainConfig(steps=steps, seed=0, recipe=recipe))
    return dict(curves=r.curves, layer_grads=r.layer_grads, activations=r.activations,
                # keyed by arm name, as the result held them before it keyed them by Arm (saved figures compare)
                producer={a.name: v for a, v in r.nonfinite_producer.items()},
                weights={a.name: v for a, v in r.nonfinite_weights.items()})


def _same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def differences(old: dict, new: dict) -> list[str]:
    """Every table or value that is not bitwise the same."""
    out = []
    for key in ("curves", "layer_grads", "activations"):
        a, b = old[key], new[key]
        if not a.equals(b) or list(a.columns) != list(b.columns) or list(a.dtypes) != list(b.dtypes):
            out.append(f"{key}: DataFrame.equals is False")
            continue
        for col in a.columns:
            bad = [i for i, (x, y) in enumerate(zip(a[col].tolist(), b[col].tolist())) if not _same_value(x, y)]
            if bad:
                out.append(f"{key}.{col}: {len(bad)} rows differ, first at {bad[0]}: {a[col].iloc[bad[0]]!r} "
                           f"-> {b[col].iloc[bad[0]]!r}")
    for key in ("producer", "weights"):
        if old[key] != new[key]:
            out.append(f"{key}: {old[key]} -> {new[key]}")
    return out


def as_watched(old: dict) -> dict:
    """The old figures restricted to what each role is watched for since issue 28 (``ArmState``): the
    activation rows of the judge only, the per-layer gradient rows and the producers of the judge and
    the targets (an envelope run keeps its curve rows: loss, distances, global gradient norm)."""
    role = dict(zip(old["curves"]["arm"], old["curves"]["role"]))
    curves = old["curves"].copy()
    curves.loc[curves["role"] == "envelope", "dist_judge"] = float("nan")  # not measured since
    keep = lambda df, roles: df[df["arm"].map(role).isin(roles)].reset_index(drop=True)  # noqa: E731
    return dict(old, curves=curves, layer_grads=keep(old["layer_grads"], ("judge", "target")),
                activations=keep(old["activations"], ("judge",)),
                producer={a: (v if role.get(a) != "envelope" else None) for a, v in old["producer"].items()},
                weights={a: (v if role.get(a) != "envelope" else False) for a, v in old["weights"].items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, help="write this code's figures under this folder")
    mode.add_argument("--check", type=Path, help="compare this code's figures with those saved there")
    ap.add_argument("--only", default="", help="comma-separated case labels (default: all)")
    ap.add_argument("--as-watched", action="store_true",
                    help="with --check: figures saved before issue 28's per-role watching, compared as it keeps them")
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
            print(f"{label}: saved ({len(got['curves'])} curve rows)")
            continue
        saved = pickle.loads(path.read_bytes())
        diff = differences(as_watched(saved) if args.as_watched else saved, got)
        failed += bool(diff)
        print(f"{label}: {'DIFFERENT' if diff else 'bitwise equal'}" + "".join(f"\n  {d}" for d in diff))
    return 1 if failed else 0


if __name__ == "__main__":
    pd.set_option("display.precision", 17)
    sys.exit(main())
