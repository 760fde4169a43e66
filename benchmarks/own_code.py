"""The price of measuring own code (issue 15): one parity step, before and after, same machine.

    python benchmarks/own_code.py --model resnet50 --batch 2 --target cpu          # this checkout
    PYTHONPATH=/path/to/old/checkout python benchmarks/own_code.py ...              # another commit

Prints one JSON line: the parity step's wall and CPU time (medians of ``--repeats``; with one
thread the CPU time is the steadiest figure on a shared machine), a bare float32
step of the same model in the same process (the ratio is what to compare across commits: it
cancels a machine that is busier on one run than on the other), and this process's peak RSS
(run one measurement per process, so the peak is this parity step's).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch

import convcheck
from convcheck.measure.parity import run_parity
from convcheck.targets.spec import Target
from reference_models import get_model, get_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    spec = get_spec(a.model)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in get_model(a.model).state_dict().items()}

    def build(t: Target):
        m = get_model(a.model)
        m.load_state_dict(state)
        t.runner.place(m)
        return m.train()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn((a.batch, *spec.input_shape), generator=gen, dtype=torch.float64)
    y = torch.randint(0, spec.num_classes, (a.batch,), generator=gen)
    bare = build(Target.parse("cpu"))

    def bare_step():
        bare.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(bare(x.float()), y).backward()

    target = Target.parse(a.target)
    bares, parities, cpu = [], [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        bare_step()
        bares.append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.process_time()
        result = run_parity(build, (x, y), [target])
        parities.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    rows = result.layers
    print(json.dumps(dict(
        convcheck=convcheck.__file__, model=a.model, batch=a.batch, target=a.target, threads=a.threads,
        bare_s=statistics.median(bares), parity_s=statistics.median(parities),
        parity_x_bare=statistics.median(parities) / statistics.median(bares),
        parity_cpu_s=statistics.median(cpu),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        rows=len(rows), own_code_rows=int(rows["module"].str.contains("own code").sum()),
        flagged=int(rows["flagged"].sum()),
    )))


if __name__ == "__main__":
    sys.exit(main())
