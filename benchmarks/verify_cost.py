"""Cost of verified remedies (issue 24): the verify stage's re-runs as a ratio of one training run of one arm.

Scenarios (small real models with the problem, as tests/verify/test_verify.py has them):
  softmax   a naive softmax overflowing float16 -> keep it in float32 (the default: one re-run)
  eps       Adam's eps 0 in float16 weights -> eps 1e-4 (--verify: the judge re-run beside it)
  bisect    two overflowing modules -> float32 for one does not verify -> bisection finds both (--verify)

The denominator is one arm's share of the comparison's own training (``train_s / arms``: every arm trains the
same steps in lockstep); the numerator the verify stage's wall time. Run:

    python benchmarks/verify_cost.py [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


from convcheck.pipeline import compare  # noqa: E402
from scenarios.verify_models import mlp, softmax_net, two_overflows_net  # noqa: E402

MNIST = dict(input_shape=(1, 28, 28), num_classes=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    cases = [
        ("softmax", softmax_net, dict(optimizer="sgd", lr=0.1, verify=None)),
        ("eps", mlp, dict(verify=True)),
        ("bisect", two_overflows_net, dict(optimizer="sgd", lr=0.05, verify=True)),
    ]
    print(f"{'case':<9} {'status':<13} {'re-runs':>7} {'train_s':>8} {'arms':>4} {'verify_s':>8} "
          f"{'verify / one arm':>16} {'verify / whole training':>23}")
    for name, model, kw in cases:
        t0 = time.perf_counter()
        r = compare(model, "cpu,cpu:fp16", steps=args.steps, envelope=0, batch_size=16, env_findings=[], **MNIST,
                    **kw)
        wall = time.perf_counter() - t0
        v, t = r.verification, r.timings
        arms = len(r.training.arms)
        one_arm = t["train_s"] / arms
        print(f"{name:<9} {v.status:<13} {len(v.attempts):>7} {t['train_s']:>8.2f} {arms:>4} {t['verify_s']:>8.2f} "
              f"{t['verify_s'] / one_arm:>16.2f} {t['verify_s'] / t['train_s']:>23.2f}   (compare {wall:.1f} s)")


if __name__ == "__main__":
    main()
