"""What ``convcheck.watch`` costs (issue 25): ratios against the bare loop, in one process.

For each model: N bare SGD steps and N watched steps (statistics every step, no snapshot), alternated
round by round so that both see the same machine; then one snapshot step against a bare step; and the
process's peak RSS growth over the watched rounds against the snapshot's size.

    python benchmarks/watch_overhead.py --models cifar_cnn,resnet18 --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convcheck  # noqa: E402
from reference_models import get_spec  # noqa: E402


def _steps(model, opt, batches, w=None) -> float:
    t0 = time.perf_counter()
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)
    return time.perf_counter() - t0


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, steps: int, rounds: int, batch: int) -> dict:
    spec = get_spec(name)
    torch.manual_seed(0)
    model = spec.factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(batch, *spec.input_shape), torch.randint(0, spec.num_classes, (batch,)))
               for _ in range(steps)]
    _steps(model, opt, batches[:2])  # warm up
    bare = watched = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            bare += _steps(model, opt, batches)
            with convcheck.watch(model, opt, out=Path(tmp) / f"w{r}", snapshot_steps=()) as w:
                watched += _steps(model, opt, batches, w)
        rss0 = _rss_mb()
        one_bare = min(_steps(model, opt, batches[:1]) for _ in range(3))
        with convcheck.watch(model, opt, out=Path(tmp) / "snap", snapshot_steps=(0,)) as w:
            one_snap = _steps(model, opt, batches[:1], w)
        snap_mb = sum(p.stat().st_size for p in (Path(tmp) / "snap" / "snapshots").iterdir()) / 1e6
        rss_growth = _rss_mb() - rss0
    return {"model": name, "stats_ratio": watched / bare, "snapshot_ratio": one_snap / one_bare,
            "snapshot_mb": snap_mb, "rss_growth_mb": rss_growth}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="cifar_cnn,resnet18")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}")
    for name in args.models.split(","):
        r = measure(name, args.steps, args.rounds, args.batch)
        print(f"{r['model']:<10} statistics every step: {r['stats_ratio']:.3f}x bare | one snapshot step: "
              f"{r['snapshot_ratio']:.2f}x a bare step ({r['snapshot_mb']:.1f} MB) | peak RSS growth "
              f"{r['rss_growth_mb']:.1f} MB")


if __name__ == "__main__":
    main()
