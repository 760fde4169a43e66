"""Floors for the rows of real GPU layer tables, computed on this CPU (used by ``floors.py gpu``).

A floor needs no GPU: it is float64 arithmetic on operands rounded to the target's precision.
Each run's weights and first batch are rebuilt from its seed (their SHA-256 checked against the
run's ``summary.json``), the float64 judge runs here, and every forward and gradient row of a GPU
target gets the floor of that target's precision model on an H200.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import torch

from convcheck.plan.seeded_data import hash_state_dict, load_batches
from convcheck.numerics.metrics import rel_l2
from convcheck.plan.models import resolve_model
from convcheck.measure.parity.floor import FloorMeter, reference_grads
from convcheck.measure.parity.judge_pass import run_judge
from convcheck.measure.parity.local import private_copy
from convcheck.pipeline import initial_state, model_builder
from convcheck.targets.runners import cross_entropy
from convcheck.numerics.formats import FLOAT32, TF32
from convcheck.targets.runners.precision import OpPrecision, PrecisionModel, op_class
from convcheck.targets.spec import Target
from convcheck.numerics.thresholds import GRAD_ACCUMULATION
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES

# copied from ../shared/gpu-runs/h200-2026-11-30 (tests/data/real/README.md)
DEFAULT_RUNS = Path(__file__).resolve().parents[1] / "tests" / "data" / "real" / "h200-2026-11-30"


def h200_precision(spec: str) -> tuple[PrecisionModel, torch.dtype]:
    """A GPU target's precision model and compute dtype on the H200 of those runs (torch 2.11:
    TF32 on for cuDNN convolutions, off for matmul with plain ``cuda``; FACTS.md)."""
    if spec == "cuda":
        fp32, tf32 = OpPrecision(FLOAT32, FLOAT32), OpPrecision(TF32, FLOAT32)
        return PrecisionModel(matmul=fp32, conv=tf32, elementwise=fp32), torch.float32
    runner = Target.parse(spec).runner  # tf32 / no-tf32 / amp-*: their models do not ask the GPU
    return runner.precision, runner.compute_dtype


def _rebuild(run: Path):
    s = json.loads((run / "summary.json").read_text())
    m = s["model"]
    resolved = resolve_model(m["name"], input_shape=tuple(m["input_shape"]), num_classes=m["num_classes"])
    state = initial_state(resolved, s["seed"])
    if hash_state_dict(state) != s["initial_weights_sha256"]:
        raise SystemExit(f"{run.name}: initial weights differ from the run's")
    b = load_batches(None, input_shape=resolved.input_shape, num_classes=resolved.num_classes,
                     batch_size=s["config"]["batch_size"], num_batches=s["config"]["steps"], seed=s["seed"])
    if b.hashes[0] != s["data"]["batch_sha256"][0] and not _same_stats(b.stats(), s["data"]["stats"]):
        raise SystemExit(f"{run.name}: the batches differ from the run's")
    return s, model_builder(resolved, state), b.batches[0]


def _same_stats(mine: dict, theirs: dict) -> bool:
    """The batch hash's recipe may change between versions; the run's statistics over all of its
    batches (min, max, mean, std, labels) pin the same numbers down too."""
    return all(math.isclose(float(mine[k]), float(v), rel_tol=1e-9, abs_tol=1e-12) for k, v in theirs.items())


def run_rows(run: Path) -> list[dict]:
    s, build, batch = _rebuild(run)
    judge = Target.parse("cpu:float64")
    calls, _, judge_grads, _ = run_judge(build(judge), batch, judge.runner, s["seed"], cross_entropy)
    table = pd.read_csv(run / "layers.csv")
    model = build(Target.parse("cpu"))
    modules = dict(model.named_modules())
    out = []
    for spec in [t for t in s["targets"] if t.startswith("cuda")]:
        precision, compute_dtype = h200_precision(spec)
        meter = FloorMeter(precision, judge.runner)
        rows = table[table["target"] == spec]
        half = compute_dtype if compute_dtype.itemsize == 2 else torch.float32
        for r in rows.itertuples():
            jc = calls.get(r.layer)  # a gradient row names the module: its first call's key
            module = modules.get(r.layer.split("#")[0])
            if jc is None or module is None:
                continue
            args = tuple(a.to(torch.float32) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in jc.inputs)
            if r.kind == "forward":
                ref = judge.runner.reference_module(private_copy(module))
                floor = meter.forward(module, ref, args, jc.output, None, half)
            else:
                floor = _grad_floor(meter, module, jc, args, half, r, judge_grads, judge.runner)
            out.append(dict(run=run.name, target=spec, kind=r.kind, layer=r.layer, module=r.module,
                            param=r.param if isinstance(r.param, str) else "", K=r.K, local=r.local, floor=floor))
    return out


def _grad_floor(meter, module, jc, args, half, r, judge_grads, judge) -> float:
    pname = r.param.rsplit(".", 1)[-1]
    jg = judge_grads.get(r.param)
    if jc.grad_output is None or jg is None:
        return math.nan
    matmul = op_class(module) != "elementwise"
    g = jc.grad_output.to(half if matmul else torch.float32)
    ref = judge.reference_module(private_copy(module))
    want = None if meter.rounds_grads(module, args, g) else reference_grads(ref, args, g, judge)
    best = meter.grads(module, ref, args, g, half if matmul else torch.float32, want)
    if pname not in best:
        return math.nan
    acc = GRAD_ACCUMULATION * meter.precision.for_module(module).accumulate.unit_roundoff * math.sqrt(max(1, r.K))
    return rel_l2(best[pname], jg) + acc


def gpu_rows(runs: Path) -> pd.DataFrame:
    rows = []
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and p.name.startswith("compare-")):
        rows += run_rows(run)
    return verdicts(pd.DataFrame(rows))


def verdicts(t: pd.DataFrame) -> pd.DataFrame:
    """over_floor and flagged for rows of GPU local errors against computed floors."""
    tol = DEFAULT_TOLERANCES
    t["over_floor"] = t["local"] / t["floor"]
    t["flagged"] = [tol.is_flagged(e, f) for e, f in zip(t["local"], t["floor"])]
    return t


def summary(t: pd.DataFrame) -> str:
    lines = ["| run | GPU target | kind | rows | flagged | max local/floor (row) | median |",
             "|---|---|---|---|---|---|---|"]
    for (run, target, kind), g in t.groupby(["run", "target", "kind"], sort=False):
        g = g[g["over_floor"].map(math.isfinite)]
        if not len(g):
            continue
        w = g.sort_values("over_floor").iloc[-1]
        lines.append(f"| {run} | {target} | {kind} | {len(g)} | {int(g['flagged'].sum())} | "
                     f"{w['over_floor']:.2f} ({w['param'] or w['layer']}, K={int(w['K'])}, local {w['local']:.2e}) | "
                     f"{g['over_floor'].median():.2f} |")
    return "\n".join(lines)
