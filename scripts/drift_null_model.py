"""Issue 24 item 5b: the drift test's two null models on same-precision pairs, side by side.

For each scenario (a BatchNorm CNN written as a user would, on ``cpu,ddp:cpu:2`` and friends) the run is made
twice from the same seed: with the envelope runs nudged once before step 0 (the old null model, still the
one of different-precision pairs) and nudged after every step too (the null model of same-precision pairs).
Printed per scenario: the final spread of the envelope runs, the drift's largest ratio to that spread, the
verdict and its exit code under each; ``*`` marks the null model ``convcheck compare`` picks for the pair.

    python scripts/drift_null_model.py [--steps 30] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from unittest import mock

import torch.nn as nn

import convcheck.pipeline as pipeline
from convcheck.diagnose.evidence import gather
from convcheck.measure.train import make_arms, same_precision
from convcheck.targets.spec import parse_targets


def bn_cnn() -> nn.Module:
    """A standard small BatchNorm CNN (3x32x32, 10 classes)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


# name -> (targets, options)
SCENARIOS = {
    "syncbn-2-per-rank": ("cpu,ddp:cpu:2", dict(batch_size=4, ddp_sync_bn=True)),
    "syncbn-2-per-rank-sgd": ("cpu,ddp:cpu:2", dict(batch_size=4, ddp_sync_bn=True, optimizer="sgd", lr=0.05)),
    "bn-16-per-rank": ("cpu,ddp:cpu:2", dict(batch_size=32)),
    "bn-2-per-rank": ("cpu,ddp:cpu:2", dict(batch_size=4)),
    "bn-2-per-rank-sgd": ("cpu,ddp:cpu:2", dict(batch_size=4, optimizer="sgd", lr=0.05)),
    "bn-16-per-rank-sgd": ("cpu,ddp:cpu:2", dict(batch_size=32, optimizer="sgd", lr=0.05)),
    "cpu-vs-bf16": ("cpu,cpu:bf16", dict(batch_size=32)),
}


def run(targets: str, options: dict, steps: int, every_step: bool | None):
    arms = functools.partial(make_arms, every_step=every_step)
    with mock.patch.object(pipeline, "make_arms", arms):
        r = pipeline.compare(bn_cnn, targets, input_shape=(3, 32, 32), num_classes=10, steps=steps, envelope=3,
                             verify=False, env_findings=[], threads=1, **options)
    c = r.training.curves
    env = c[c["role"] == "envelope"]
    spread = float(env[env["step"] == env["step"].max()]["dist_ref"].max())
    ev = gather(r)
    ratio = ev.drift.value if ev.drift is not None else math.nan
    finals = {str(t): o.final_loss for t, o in r.training.outcomes.items()}
    return dict(spread=spread, ratio=ratio, drift=ev.drift.name if ev.drift else None, category=r.verdict.category,
                exit=0 if r.ok else 1, headline=r.verdict.headline, finals=finals)


def main(argv=None) -> int:  # noqa: D103
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", default="")
    a = p.parse_args(argv)
    names = [n for n in SCENARIOS if not a.only or n in a.only.split(",")]
    for name in names:
        targets, options = SCENARIOS[name]
        print(f"== {name}: {targets} {options}, {a.steps} steps, envelope 3", flush=True)
        auto = same_precision(parse_targets(targets))
        for label, every in (("nudged once", False), ("per step", True)):
            m = run(targets, options, a.steps, every)
            label += " *" if every == auto else ""
            finals = ", ".join(f"{k} {v:.4g}" for k, v in m["finals"].items())
            print(f"  {label:<12} final spread {m['spread']:.3g}  drift {m['ratio']:.3g}x ({m['drift']})  "
                  f"-> {m['category']} exit {m['exit']}  [{finals}]", flush=True)
            print(f"  {'':<12} {m['headline']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
