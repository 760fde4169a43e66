#!/usr/bin/env python3
"""Which rounding a target's TF32 matmuls and convolutions use (issue 29), compared element by element.

    python scripts/tf32_rounding.py                     # every target here: cuda:tf32, cuda:no-tf32 on a GPU
    python scripts/tf32_rounding.py --targets cpu:emulate-tf32,cpu:emulate-tf32-rz

For each target it runs pytorch/pytorch#53635's ``[1024.5] @ [[1.0]]`` (1025 rounding to nearest with ties
away, 1024 with ties to even or truncating) and a seeded batch of matmuls and convolutions under the
target's flags (``Target.applied()``: TF32 on for ``cuda:tf32``), and compares each result, element by
element, with the CPU emulation of each rounding of the operands (``RNE``, ``RNA``, ``RZ``: float32
operands rounded to TF32, products summed in float32) and with plain float32 (no rounding: what a kernel
that does not use TF32 gives, e.g. cuDNN's float32 kernels for small convolutions).

Two kinds of case. ``exact``: operands made so that every sum is exact once they are rounded (one
non-zero term per output: a tie-rich column times powers of two), so the element-by-element equality
names the rounding (``matched``) whatever the kernel's summation order. ``random``: normal operands;
the sums' order differs between kernels, so each candidate's relative L2 distance is reported and the
``closest`` named (all of them when equally close), with the mean signed relative error against float64 (truncation's negative bias).

Prints one JSON object (``scripts/device-check`` keeps it as ``tf32-rounding.json``). Exit 0 when every
case ran, 2 on an unknown or unavailable target.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from the source tree

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from convcheck.errors import ConvcheckError  # noqa: E402
from convcheck.numerics.formats import RNE, TF32, TF32_RZ  # noqa: E402
from convcheck.targets.runners.precision import round_to  # noqa: E402
from convcheck.targets.spec import Target  # noqa: E402

CANDIDATES = {"RNE": replace(TF32, rounding=RNE), "RNA": TF32, "RZ": TF32_RZ, "float32": None}
TIE = 0x1000  # the low 13 bits TF32 drops, exactly halfway


def tie_rich(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` float32 values in [1, 2^8): a third exactly halfway between TF32 neighbours (half of those
    with an even lower neighbour, half odd), a third just above or below halfway, a third random."""
    x = (torch.rand(n, generator=gen) * 8).exp2()
    bits = x.view(torch.int32) & ~0x1FFF
    kind = torch.arange(n) % 3
    near = torch.where(torch.rand(n, generator=gen) < 0.5, TIE - 1, TIE + 1)
    low = torch.randint(0, 0x2000, (n,), generator=gen, dtype=torch.int32)
    bits = bits | torch.where(kind == 0, TIE, torch.where(kind == 1, near, low)).to(torch.int32)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return bits.view(torch.float32) * sign


def powers_of_two(shape, gen: torch.Generator) -> torch.Tensor:
    e = torch.randint(-4, 5, shape, generator=gen).float()
    return e.exp2() * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)


def cases(gen: torch.Generator, size: int) -> dict:
    """name -> (kind, op, operands): float32 CPU tensors, the same for every target."""
    m = size
    a = torch.zeros(m, 64)
    a[:, 0] = tie_rich(m, gen)  # one non-zero term per output: exact once rounded
    b = torch.randn(64, m, generator=gen)
    b[0] = powers_of_two((m,), gen)
    img = torch.zeros(4, 16, 24, 24)
    img[:, 0] = tie_rich(4 * 24 * 24, gen).view(4, 24, 24)
    w1 = torch.zeros(32, 16, 1, 1)
    w1[:, 0, 0, 0] = powers_of_two((32,), gen)
    w3 = torch.zeros(32, 16, 3, 3)
    w3[:, 0, 1, 1] = powers_of_two((32,), gen)
    return {
        "mm-exact": ("exact", torch.mm, (a, b)),
        "conv1x1-exact": ("exact", F.conv2d, (img, w1)),
        "conv3x3-exact": ("exact", lambda x, w: F.conv2d(x, w, padding=1), (img, w3)),
        "mm-random": ("random", torch.mm, (torch.randn(m, 4 * m, generator=gen), torch.randn(4 * m, m, generator=gen))),
        "linear-random": ("random", F.linear, (torch.randn(64, m, generator=gen), torch.randn(m, m, generator=gen))),
        "conv3x3-random": ("random", lambda x, w: F.conv2d(x, w, padding=1),
                           (torch.randn(4, 32, 16, 16, generator=gen), torch.randn(64, 32, 3, 3, generator=gen))),
        "conv-small-random": ("random", F.conv2d,
                              (torch.randn(1, 3, 8, 8, generator=gen), torch.randn(4, 3, 3, 3, generator=gen))),
    }


def emulated(op, operands, fmt) -> torch.Tensor:
    """The CPU float32 result on operands rounded to ``fmt`` (None: float32 as they are)."""
    return op(*(t if fmt is None else round_to(t, fmt) for t in operands))


def compare(got: torch.Tensor, kind: str, op, operands, exact64: torch.Tensor) -> dict:
    out: dict = {"exact_fraction": {}, "rel_l2": {}}
    ref_norm = exact64.norm().item() or 1.0
    for name, fmt in CANDIDATES.items():
        emu = emulated(op, operands, fmt)
        out["exact_fraction"][name] = round((got == emu).float().mean().item(), 6)
        out["rel_l2"][name] = (got.double() - emu.double()).norm().item() / ref_norm
    nz = exact64 != 0
    rel = (got.double() - exact64)[nz] / exact64[nz].abs() * exact64[nz].sign()
    out["mean_signed_rel_error"] = rel.mean().item()  # negative: magnitudes shrink (truncation)
    full = [n for n, f in out["exact_fraction"].items() if f == 1.0]
    out["matched"] = full if kind == "exact" else None
    best = min(out["rel_l2"].values())
    out["closest"] = [n for n, d in out["rel_l2"].items() if d == best]  # ties: every one as close
    return out


def run_target(spec: str, gen_seed: int, size: int) -> dict:
    target = Target.parse(spec)
    target.check_available()
    device = target.runner.torch_device
    a, b = torch.tensor([[1024.5]]), torch.tensor([[1.0]])
    result: dict = {"target": spec, "device": str(device), "cases": {}}
    gen = torch.Generator().manual_seed(gen_seed)
    with target.applied():
        result["published_1024_5"] = (a.to(device) @ b.to(device)).item()
        result["flags"] = {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                           "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}
        outs = {}
        for name, (kind, op, operands) in cases(gen, size).items():
            outs[name] = op(*(t.to(device) for t in operands)).cpu()
    for name, (kind, op, operands) in cases(torch.Generator().manual_seed(gen_seed), size).items():
        exact64 = op(*(t.double() for t in operands))
        result["cases"][name] = {"kind": kind, **compare(outs[name], kind, op, operands, exact64)}
    exact = [c["matched"] for c in result["cases"].values() if c["kind"] == "exact"]
    common = set(exact[0]).intersection(*exact[1:]) if exact else set()
    result["matched"] = sorted(common, key=list(CANDIDATES).index)  # the roundings every exact case agrees on
    return result


def default_targets() -> list[str]:
    specs = ["cpu:emulate-tf32", "cpu:emulate-tf32-rz", "cpu"]
    if torch.cuda.is_available():
        specs = ["cuda:tf32", "cuda:no-tf32", *specs]
    return specs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="", help="comma-separated specs (default: every TF32-relevant one here)")
    ap.add_argument("--size", type=int, default=256, help="matrix side of the matmul cases (default 256)")
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args(argv)
    specs = [s for s in args.targets.split(",") if s] or default_targets()
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
                    "candidates": list(CANDIDATES), "targets": {}}
    try:
        for spec in specs:
            report["targets"][spec] = run_target(spec, args.seed, args.size)
    except ConvcheckError as exc:
        print(f"tf32_rounding: {exc}", file=sys.stderr)
        return 2
    report["summary"] = {spec: {"1024.5 @ 1.0": r["published_1024_5"], "matched": r["matched"],
                                "closest": {n: c["closest"] for n, c in r["cases"].items() if c["kind"] == "random"}}
                         for spec, r in report["targets"].items()}
    print(json.dumps(report, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
