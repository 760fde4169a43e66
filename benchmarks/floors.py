#!/usr/bin/env python
"""Layer floors: the measurements the flag rule was chosen from, and its detection limits.

    .venv/bin/python benchmarks/floors.py healthy [--models lenet,cifar_cnn,...] [--targets ...]
    .venv/bin/python benchmarks/floors.py gpu [--runs ../shared/gpu-runs/h200-2026-11-30]
    .venv/bin/python benchmarks/floors.py sweep [--targets ...] [--channels 1,8,64,512]
    .venv/bin/python benchmarks/floors.py all

* healthy  every forward and gradient row of the healthy zoo in every CPU precision target:
           own error (``intrinsic``) over its measured floor; what float32 adds beyond its floor
           (for the absolute term); rows flagged by the rule in force.
* gpu      the real H200 layer tables (``gpu-runs/``): the same weights and first batch are
           rebuilt here (hashes checked against ``summary.json``), the floors are computed on
           this CPU with the GPU target's precision model, and the GPU's measured local errors
           are held against them (no intrinsic column there: local is the GPU's own error plus
           its input's rounding, which the floor contains too).
* sweep    the injected-error sweep (``tests/scenarios/sweep.py``): a conv wrong by a relative
           EPS unless in float64, at several K; the smallest flagged EPS over the conv's healthy
           local error ("noise"), for the rule in force and the old u*sqrt(K) rule.

Raw rows go to ``benchmarks/results/floors/*.csv``; the tables to ``benchmarks/results/floors.md``.
Nothing here asserts anything: the tests do (``tests/measure/test_floor.py``, ``tests/scenarios/test_detection.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from convcheck.plan.seeded_data import load_batches  # noqa: E402
from convcheck.plan.models import resolve_model  # noqa: E402
from convcheck.measure.parity import checks, run_parity  # noqa: E402
from convcheck.pipeline import initial_state, model_builder  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402
from convcheck.numerics.thresholds import FLOOR_ABSOLUTE  # noqa: E402
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES  # noqa: E402
from scenarios.sweep import detection_limit  # noqa: E402

import gpu_floors  # noqa: E402  (benchmarks/gpu_floors.py)

OUT = HERE / "results" / "floors"
CPU_TARGETS = ("cpu", "cpu:bf16", "cpu:fp16", "cpu:amp-bf16", "cpu:emulate-tf32")
# model -> (batch, input shape or None for the model's own): the sizes the suite and the GPU runs use,
# plus a ResNet at 32x32 and batch 2 (a BatchNorm over 2 values: the worst-conditioned healthy case).
HEALTHY_PLAN = {
    "lenet": [(32, None)],
    "cifar_cnn": [(16, None)],
    "resnet18": [(2, (3, 32, 32)), (4, (3, 64, 64))],
    "resnet34": [(2, (3, 64, 64))],
    "resnet50": [(2, None)],
}
COLS = ["model", "input", "batch", "target", "kind", "layer", "module", "param", "K", "u", "local", "intrinsic",
        "floor", "over_floor", "flagged"]


def _log(msg: str) -> None:
    print(f"[floors {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- healthy zoo ------------------------------------------------------------------------------------------

def healthy(models, targets) -> pd.DataFrame:
    """Every row measured (``checks.measuring_all``): the true floor and own error, not the cheap bound."""
    frames = []
    for name in models:
        for batch, shape in HEALTHY_PLAN[name]:
            kw = dict(input_shape=shape, num_classes=10) if shape else {}
            m = resolve_model(name, **kw)
            b = load_batches(None, input_shape=m.input_shape, num_classes=m.num_classes, batch_size=batch,
                             num_batches=1, seed=0)
            t0 = time.perf_counter()
            with checks.measuring_all():
                r = run_parity(model_builder(m, initial_state(m, 0)), b.batches[0],
                               [Target.parse(t) for t in targets])
            _log(f"{name} {m.input_shape} batch {batch}: {time.perf_counter() - t0:.1f}s")
            t = r.layers.assign(model=name, input="x".join(map(str, m.input_shape)), batch=batch)
            frames.append(t[COLS])
    return pd.concat(frames, ignore_index=True)


def healthy_summary(t: pd.DataFrame) -> str:
    f = DEFAULT_TOLERANCES.bound_factor
    lines = ["| target | kind | rows | flagged | max own/floor (row) | 99th pct | max own error | "
             "max (own - F x floor) |", "|---|---|---|---|---|---|---|---|"]
    for (target, kind), g in t.groupby(["target", "kind"], sort=False):
        g = g[g["over_floor"].map(math.isfinite)]
        w = g.sort_values("over_floor").iloc[-1]
        excess = (g["intrinsic"] - f * g["floor"]).max()
        lines.append(f"| {target} | {kind} | {len(g)} | {int(g['flagged'].sum())} | {w['over_floor']:.2f} "
                     f"({w['model']} {w['input']} b{w['batch']} {w['param'] or w['layer']}, K={int(w['K'])}) | "
                     f"{g['over_floor'].quantile(0.99):.2f} | {g['intrinsic'].max():.2e} | {excess:.2e} |")
    return "\n".join(lines)


# --- the sweep --------------------------------------------------------------------------------------------

def sweep(targets, channels) -> pd.DataFrame:
    rows = []
    for target in targets:
        for c in channels:
            t0 = time.perf_counter()
            lim = detection_limit(target, c)
            _log(f"sweep {target} K={lim.K}: noise {lim.noise:.2e}, after {lim.eps_after:.3g} ({lim.after:.2f}x), "
                 f"before {lim.eps_before:.3g} ({lim.before:.0f}x) [{time.perf_counter() - t0:.1f}s]")
            rows.append(dict(target=target, K=lim.K, noise=lim.noise, floor=lim.floor, eps_after=lim.eps_after,
                             after=lim.after, eps_before=lim.eps_before, before=lim.before))
    return pd.DataFrame(rows)


def sweep_summary(t: pd.DataFrame) -> str:
    lines = ["| target | K | healthy noise | floor | smallest flagged EPS before (x noise) | "
             "after (x noise) |", "|---|---|---|---|---|---|"]
    for r in t.itertuples():
        before = f"{r.eps_before:.3g} ({r.before:.0f}x)" if math.isfinite(r.eps_before) else "none up to 4"
        lines.append(f"| {r.target} | {r.K} | {r.noise:.2e} | {r.floor:.2e} | {before} | "
                     f"{r.eps_after:.3g} ({r.after:.1f}x) |")
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------------

def _write(name: str, frame: pd.DataFrame) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    frame.to_csv(OUT / f"{name}.csv", index=False, float_format="%.6g")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("healthy", "gpu", "sweep", "all"))
    ap.add_argument("--models", default=",".join(HEALTHY_PLAN))
    ap.add_argument("--targets", default=",".join(CPU_TARGETS))
    ap.add_argument("--channels", default="1,8,64,512", help="sweep: conv input channels (K = 9 x channels)")
    ap.add_argument("--runs", default=str(gpu_floors.DEFAULT_RUNS))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--name", default="", help="suffix of the output files (floors-<what><name>.md, <what><name>.csv)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    targets = [t for t in args.targets.split(",") if t]
    parts = []
    if args.what in ("healthy", "all"):
        t = healthy([m for m in args.models.split(",") if m], targets)
        _write("healthy" + args.name, t)
        parts.append("## Healthy zoo on this CPU: own error over floor\n\n" + healthy_summary(t))
    if args.what in ("gpu", "all"):
        t = gpu_floors.gpu_rows(Path(args.runs))
        _write("gpu" + args.name, t)
        parts.append("## Real H200 layer tables against floors computed here\n\n" + gpu_floors.summary(t))
    if args.what in ("sweep", "all"):
        t = sweep(targets, [int(c) for c in args.channels.split(",")])
        _write("sweep" + args.name, t)
        parts.append("## Injected-error sweep: detection limits\n\n" + sweep_summary(t))
    head = (f"# Layer floors (bound_factor F = {DEFAULT_TOLERANCES.bound_factor:g}, absolute term "
            f"{FLOOR_ABSOLUTE:g}); torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    text = head + "\n" + "\n\n".join(parts) + "\n"
    print(text)
    (HERE / "results" / f"floors-{args.what}{args.name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
