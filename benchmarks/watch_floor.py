"""The floor under ``convcheck.watch``'s statistics (issue 25): what the reductions alone cost, in one process.

For each model: the bare SGD step, and over the same step's leaf outputs (captured once, outside any hook)
three of the six statistics at the least - ``aminmax`` (max |x|; NaN and Inf reach it), ``sum`` (mean),
the 2-norm (std), no temporary - run bare, with no Python around them but the loop; then all six by
``convcheck.watch.stats.measure`` on the same outputs (what the watch runs: the share of zeros and the
smallest nonzero |x| cost more passes on the outputs that hold zeros, ReLU's);
then the watched step itself. Each figure is a median over the rounds, as a share of the bare step:

    python benchmarks/watch_floor.py --models cifar_cnn,resnet18 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convcheck  # noqa: E402
from convcheck.watch import stats  # noqa: E402
from reference_models import get_spec  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _three_passes(outs: list[torch.Tensor]) -> None:
    """max |x| (NaN/Inf reach it), mean and std: three reductions, no temporary."""
    for o in outs:
        lo, hi = torch.aminmax(o)
        torch.stack([lo, hi, o.sum(), torch.linalg.vector_norm(o)]).tolist()


def measure(name: str, rounds: int, batch: int) -> dict:
    spec = get_spec(name)
    torch.manual_seed(0)
    model = spec.factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, *spec.input_shape), torch.randint(0, spec.num_classes, (batch,))

    def step(w=None):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)

    outs: list[torch.Tensor] = []
    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(lambda mod, a, o: outs.append(o.detach().clone())) for m in leaves]
    step()
    for h in handles:
        h.remove()
    rows = {"bare": [], "floor": [], "measure": [], "watched": []}
    zeros = sum(1 for o in outs if float(o.amin()) == 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            rows["bare"].append(_timed(step))
            rows["floor"].append(_timed(lambda: _three_passes(outs)))
            rows["measure"].append(_timed(lambda: [stats.measure(o) for o in outs]))
            with convcheck.watch(model, opt, out=Path(tmp) / f"w{r}", snapshot_steps=()) as w:
                rows["watched"].append(_timed(lambda: step(w)))
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"model": name, "outputs": len(outs), "zeros": zeros, "bare_ms": med["bare"] * 1e3,
            "floor": med["floor"] / med["bare"], "measure": med["measure"] / med["bare"],
            "watched": med["watched"] / med["bare"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="cifar_cnn,resnet18")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name in args.models.split(","):
        r = measure(name, args.rounds, args.batch)
        print(f"{r['model']:<10} bare step {r['bare_ms']:.1f} ms, {r['outputs']} leaf outputs ({r['zeros']} holding "
              f"zeros) | max, mean, std alone (three bare reductions): +{r['floor'] * 100:.1f}% | all six, "
              f"stats.measure on them: +{r['measure'] * 100:.1f}% | "
              f"the watched step: {r['watched']:.3f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
