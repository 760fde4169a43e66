"""The flag rule against real GPU layer tables (an H200, tests/data/real/README.md).

The floors need no GPU: each run's weights and first batch are rebuilt from its seed, the
float64 judge runs here, and every GPU row's floor is computed with that target's precision model
(``benchmarks/gpu_floors.py``). The GPU's measured local errors must not be flagged against them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_floors  # noqa: E402

from convcheck.numerics.tolerances import DEFAULT_TOLERANCES  # noqa: E402

RUNS = gpu_floors.DEFAULT_RUNS


@pytest.mark.parametrize("run", [
    "compare-lenet-cpu_cuda", "compare-lenet-cuda_amp-bf16", "compare-lenet-cuda_amp-fp16",
    "compare-lenet-tf32_no-tf32", "compare-cifar_cnn-tf32_emulate-tf32",
    pytest.param("compare-resnet50-cpu_cuda", marks=pytest.mark.slow),
])
def test_no_real_gpu_row_is_flagged_against_its_floor(run):
    t = gpu_floors.verdicts(pd.DataFrame(gpu_floors.run_rows(RUNS / run)))
    assert len(t) > 20 and t["floor"].map(math.isfinite).all()
    assert not t["flagged"].any(), t[t["flagged"]]
    # where the precision is reduced (TF32, bf16, fp16: floors above float32's) the GPU stays
    # within 2.4x its floor (cuDNN's TF32 weight gradients; most rows ~1x), half the factor
    reduced = t[t["floor"] > 1e-5]
    assert len(reduced) and reduced["over_floor"].max() < DEFAULT_TOLERANCES.bound_factor / 2
