"""In-process A/B of how the watch's hooks are routed (issue 45): process-wide hooks looked up by identity
(``watch/attach.py``, now) against the same watch's hooks registered on every module and on the optimizer (as
before issue 45), rounds alternated with a bare round, N watched steps a round; min and median CPU time.

    python benchmarks/watch_routing_ab.py --model cifar_cnn --batch 16 --rounds 10 --threads 1

One intra-op thread by default: on a shared machine two threads' spinning makes CPU time as noisy as wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convcheck  # noqa: E402
from convcheck.watch import attach  # noqa: E402
from reference_models import get_spec  # noqa: E402


def per_module(w) -> None:
    """Route ``w``'s hooks as before issue 45: on the modules and the optimizer themselves."""
    for h in w.handles:
        h.remove()
    w.handles.clear()
    attach._WATCHES.append(w)
    w.handles.append(w.outer.register_forward_pre_hook(lambda m, a: w._root_pre(m, a)))
    w.handles.append(w.outer.register_forward_hook(lambda m, a, k, o: w._root_forward(m, a, k, o), with_kwargs=True))
    w.handles += [mod.register_forward_hook(w._forward) for mod in w.names if mod is not w.model]
    w.handles += [w.optimizer.register_step_pre_hook(w._pre_step), w.optimizer.register_step_post_hook(w._post_step)]

    class _Current:
        def remove(self):
            if w in attach._WATCHES:
                attach._WATCHES.remove(w)

    w.handles.append(_Current())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cifar_cnn")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = get_spec(args.model)
    torch.manual_seed(0)
    model = spec.factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(args.batch, *spec.input_shape), torch.randint(0, spec.num_classes, (args.batch,)))
               for _ in range(args.steps)]

    def steps(w=None) -> float:
        c = time.process_time()
        for x, y in batches:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if w is not None:
                w.step(loss)
        return time.process_time() - c

    steps()
    res: dict[str, list[float]] = {"bare": [], "process-wide": [], "per-module": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            res["bare"].append(steps())
            for kind in ("process-wide", "per-module"):
                with convcheck.watch(model, opt, out=Path(tmp) / f"{kind}{r}", snapshot_steps=()) as w:
                    if kind == "per-module":
                        per_module(w)
                    res[kind].append(steps(w))
    bare = statistics.median(res["bare"])
    for kind, times in res.items():
        print(f"{args.model} {kind:<13} CPU min {min(times):.3f} s, median {statistics.median(times):.3f} s "
              f"({statistics.median(times) / bare:.3f}x bare)")


if __name__ == "__main__":
    main()
